"""The registry of kernel backends: ``get_backend(name)`` returns one shared instance per name.

A backend runs on one kind of tensor: ``cuda`` on CUDA tensors, ``emulator`` on CPU tensors.
Backends are created lazily on first use, so importing flashtune never imports CuPy or builds
the emulator. ``register_backend`` adds a backend (used by tests and benchmarks).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from flashtune.errors import InvalidInput
from flashtune.runtime.backends.base import Backend

#: torch device types a backend can serve.
TENSOR_DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: its name, the torch device type of its tensors, its factory."""

    name: str
    device_type: str
    factory: Callable[[], Backend]

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"backend name {self.name!r} must be a non-empty identifier")
        if self.device_type not in TENSOR_DEVICES:
            raise ValueError(f"backend {self.name!r}: device_type={self.device_type!r}; "
                             f"expected one of {TENSOR_DEVICES}")


def _make_cuda() -> Backend:
    from flashtune.runtime.backends.cuda import CudaBackend

    return CudaBackend()


def _make_emulator() -> Backend:
    from flashtune.runtime.backends.emulator import EmulatorBackend

    backend: Backend = EmulatorBackend()
    return backend


_lock = threading.Lock()
_entries: dict[str, BackendEntry] = {
    "cuda": BackendEntry("cuda", "cuda", _make_cuda),
    "emulator": BackendEntry("emulator", "cpu", _make_emulator),
}
_instances: dict[str, Backend] = {}


def register_backend(name: str, device_type: str, factory: Callable[[], Backend]) -> None:
    """Add (or replace) backend ``name`` serving tensors of ``device_type`` ('cuda'/'cpu')."""
    entry = BackendEntry(name, device_type, factory)
    with _lock:
        _entries[name] = entry
        _instances.pop(name, None)


def unregister_backend(name: str) -> None:
    """Remove a backend added with ``register_backend`` (the built-in ones stay)."""
    if name in ("cuda", "emulator"):
        raise ValueError(f"the built-in backend {name!r} cannot be removed")
    with _lock:
        _entries.pop(name, None)
        _instances.pop(name, None)


def backend_names() -> tuple[str, ...]:
    return tuple(sorted(_entries))


def backend_entry(name: str) -> BackendEntry:
    """The registration of ``name``; InvalidInput naming the known backends if unknown."""
    try:
        return _entries[name]
    except KeyError:
        raise InvalidInput(
            f"backend={name!r} is unknown; expected one of {list(backend_names())} "
            "(or None for the FLASHTUNE_BACKEND default)"
        ) from None


def get_backend(name: str) -> Backend:
    """The process-wide instance of backend ``name``, created on first use."""
    backend = _instances.get(name)
    if backend is not None:
        return backend
    entry = backend_entry(name)
    with _lock:
        backend = _instances.get(name)
        if backend is None:
            backend = entry.factory()
            _instances[name] = backend
    return backend


__all__ = [
    "Backend",
    "BackendEntry",
    "backend_entry",
    "backend_names",
    "get_backend",
    "register_backend",
    "unregister_backend",
]
