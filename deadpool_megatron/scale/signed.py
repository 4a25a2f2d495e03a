"""control/auth.py's SignedStore over the harness's wire client: the same keys, the same
signed values (HMAC under the job token over the full key), the same requests."""

from __future__ import annotations

from deadpool_megatron.control.auth import UNSET, SignedStore, sign, verify
from deadpool_megatron.scale.wire import Connection, Store, Tally, Waiter


class SignedView:
    """A SignedStore of one epoch (`prefix`, e.g. "ep0/") over a shared connection."""

    def __init__(self, store: Store, token: str, prefix: str) -> None:
        self.store = store.under(prefix) if prefix else store
        self.token, self.prefix = token, prefix
        self._verified: dict[tuple[str, bytes], bytes | None] = {}

    def secret_name(self, key: str) -> str:
        return SignedStore.secret_name(self, key)  # type: ignore[arg-type]

    def waiter(self, conn: Connection) -> Waiter:
        """A blocking wait on `conn` (a connection of its own) under this view's prefix."""
        return Waiter(conn, self.store.prefix)

    def on(self, conn: Connection) -> "SignedView":
        """This view over another connection."""
        return SignedView(Store(conn), self.token, self.prefix)

    def set(self, key: str, value: str | bytes, tally: Tally) -> None:
        payload = value.encode() if isinstance(value, str) else value
        self.store.set(key, sign(self.token, self.prefix + key, payload), tally)

    async def read(self, key: str, tally: Tally) -> bytes | None:
        """SignedStore.read: CHECK, then (if set) `read_set`."""
        if not await self.store.check([key], tally):
            return None
        return await self.read_set(key, tally)

    async def read_set(self, key: str, tally: Tally) -> bytes | None:
        """SignedStore.read_set: one COMPARE_SET expecting UNSET, then the HMAC."""
        value = await self.store.compare_set(key, UNSET, UNSET, tally)
        return None if value == UNSET else self._verify(key, value)

    def _verify(self, key: str, value: bytes) -> bytes | None:
        """The HMAC check, once per (key, value) in this process: thousands of simulated
        workers read the same declaration, each real one on a CPU of its own."""
        found = self._verified.get((key, value), self)
        if found is self:
            found = self._verified[(key, value)] = verify(self.token, self.prefix + key, value)
        return found  # type: ignore[return-value]

    def append(self, key: str, value: str, tally: Tally) -> None:
        self.store.append(key, value.encode(), tally)

    async def check(self, keys: list[str], tally: Tally) -> bool:
        return await self.store.check(keys, tally)

    async def add(self, key: str, amount: int, tally: Tally) -> int:
        return await self.store.add(key, amount, tally)
