"""Megatron-LM's pretrain() begins with `ft_integration.setup()`, which parses the whole
command line again (Megatron's parser: about 800 options, each dataclass field's help read
from its source with `inspect`) only to read `--enable-ft-package`. That was 0.2 s of a
spare's 0.26 s build alone (8 ranks, CPU), time the survivors wait in the rendezvous, and
0.2 s of every rank's start.

Under hot-swap the arguments are parsed already (the script's own parse: `get_args()`), and
pretrain() runs again in every spare. `on_parsed_arguments` answers the question from them:
without the flag, setup has nothing to do; with it, Megatron's own setup runs unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator


def skipping_reparse(setup: Callable[..., Any],
                     enabled: Callable[[], bool]) -> Callable[..., Any]:
    """`setup`, called only where `enabled()` says the FT package is on."""

    @functools.wraps(setup)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return setup(*args, **kwargs) if enabled() else None

    return wrapper


@contextlib.contextmanager
def on_parsed_arguments() -> Iterator[None]:
    """While inside, Megatron's `ft_integration.setup` reads `--enable-ft-package` from the
    parsed arguments instead of parsing the command line again."""
    from megatron.training import ft_integration, get_args

    original = ft_integration.setup
    ft_integration.setup = skipping_reparse(
        original, lambda: bool(getattr(get_args(), "enable_ft_package", False)))
    try:
        yield
    finally:
        ft_integration.setup = original
