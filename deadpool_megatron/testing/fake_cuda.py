"""A fake CUDA device layer for CPU tests of the GPU branches.

Without a GPU, `torch.cuda` cannot say which device a thread would use. Inside `FakeCuda`
the calls the fault-tolerance layer makes (device choice, streams, events, RNG state) are
answered in Python: the current device is kept per thread, as CUDA keeps it, and every
call is recorded with the thread that made it and the device current in it. Tensors stay on
the CPU; "pinning" one marks it, so a test can ask which host buffers would be pinned. On
exit every patched function is put back.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


@dataclass(frozen=True)
class Call:
    thread: str
    what: str  # set_device, stream, event, record, get_rng_state, set_rng_state ...
    device: int  # the calling thread's current device when the call was made


class FakeStream:
    def __init__(self, layer: "FakeCuda", device: int | None = None) -> None:
        self.device = layer.current_device() if device is None else device
        self._layer = layer
        layer.record("stream")

    def wait_event(self, _event: object) -> None:
        self._layer.record("wait_event")

    def wait_stream(self, _other: object) -> None:
        return None

    def synchronize(self) -> None:
        self._layer.record("synchronize")


class FakeEvent:
    def __init__(self, layer: "FakeCuda") -> None:
        self._layer = layer
        layer.record("event")

    def record(self, _stream: object = None) -> None:
        self._layer.record("record")


@dataclass
class FakeCuda:
    """`with FakeCuda(devices=8) as cuda:` patches torch.cuda; `cuda.calls` is the log."""

    devices: int = 8
    calls: list[Call] = field(default_factory=list)
    rng: dict[int, torch.Tensor] = field(default_factory=dict)  # a state per device
    _local: threading.local = field(default_factory=threading.local)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    pinned: set[int] = field(default_factory=set)  # data pointers of "pinned" tensors
    _saved: dict[str, Any] = field(default_factory=dict)
    _saved_tensor: dict[str, Any] = field(default_factory=dict)
    _saved_torch: dict[str, Any] = field(default_factory=dict)

    # -- what the tests read -------------------------------------------------------------
    def current_device(self) -> int:
        return getattr(self._local, "device", 0)  # a new thread starts on device 0

    def record(self, what: str) -> None:
        with self._lock:
            self.calls.append(Call(threading.current_thread().name, what,
                                   self.current_device()))

    def devices_of(self, thread: str, what: str | None = None) -> set[int]:
        """The devices current in `thread` at its calls (of kind `what`)."""
        return {c.device for c in self.calls
                if c.thread == thread and (what is None or c.what == what)}

    # -- torch.cuda's functions ----------------------------------------------------------
    def set_device(self, device: int | torch.device) -> None:
        index = device.index if isinstance(device, torch.device) else int(device)
        if not 0 <= index < self.devices:
            raise RuntimeError(f"invalid device ordinal {index}")
        self._local.device = index
        self.record("set_device")

    def get_rng_state(self, device: int | str = "cuda") -> torch.Tensor:
        index = self.current_device() if isinstance(device, str) else int(device)
        return self.rng.setdefault(index, torch.zeros(16, dtype=torch.uint8)).clone()

    def set_rng_state(self, state: torch.Tensor, device: int | str = "cuda") -> None:
        index = self.current_device() if isinstance(device, str) else int(device)
        self.rng[index] = state.clone()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.get_rng_state(i) for i in range(self.devices)]

    def set_rng_state_all(self, states: list[torch.Tensor]) -> None:
        for i, state in enumerate(states):
            self.set_rng_state(state, i)

    def pin_memory(self, tensor: torch.Tensor, *_: object) -> torch.Tensor:
        """The tensor itself, marked pinned (CPU-only torch has no pinned allocator)."""
        self.pinned.add(tensor.data_ptr())
        self.record("pin_memory")
        return tensor

    def empty(self, *size: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        """torch.empty, where pin_memory=True gives a tensor marked pinned."""
        tensor = self._saved_torch["empty"](*size, **kwargs)
        return self.pin_memory(tensor) if pin_memory else tensor

    def is_pinned(self, tensor: torch.Tensor, *_: object) -> bool:
        return tensor.data_ptr() in self.pinned

    @contextlib.contextmanager
    def stream(self, _stream: object) -> Iterator[None]:
        yield

    def _patches(self) -> dict[str, Any]:
        return {
            "is_available": lambda: True,
            "device_count": lambda: self.devices,
            "set_device": self.set_device,
            "current_device": self.current_device,
            "Stream": lambda device=None, **_: FakeStream(self, device),
            "Event": lambda **_: FakeEvent(self),
            "stream": self.stream,
            "current_stream": lambda device=None: FakeStream(self, device),
            "synchronize": lambda device=None: None,
            "get_rng_state": self.get_rng_state,
            "set_rng_state": self.set_rng_state,
            "get_rng_state_all": self.get_rng_state_all,
            "set_rng_state_all": self.set_rng_state_all,
        }

    def __enter__(self) -> "FakeCuda":
        for name, replacement in self._patches().items():
            self._saved[name] = getattr(torch.cuda, name)
            setattr(torch.cuda, name, replacement)
        for name in ("pin_memory", "is_pinned"):
            self._saved_tensor[name] = getattr(torch.Tensor, name)
            method = getattr(self, name)  # a plain function: bound to the tensor by Python
            setattr(torch.Tensor, name, lambda tensor, *args, _m=method: _m(tensor, *args))
        self._saved_torch["empty"] = torch.empty
        torch.empty = self.empty
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(torch.cuda, name, original)
        self._saved.clear()
        for name, original in self._saved_tensor.items():
            setattr(torch.Tensor, name, original)
        self._saved_tensor.clear()
        for name, original in self._saved_torch.items():
            setattr(torch, name, original)
        self._saved_torch.clear()
