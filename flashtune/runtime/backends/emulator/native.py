"""ctypes view of the emulator ABI (include/flashtune_emu/abi.h) and library loading."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from pathlib import Path

from flashtune.errors import EmulatorDeadlock, EmulatorError

# Status codes (abi.h).
OK = 0
ERROR = 1
DEADLOCK = 2
BAD_LAUNCH = 3

CHECK_POISON_OPERANDS = 1
CHECK_BARRIER_SITE = 2

BLOCK_ORDER_LINEAR = 0
BLOCK_ORDER_SHUFFLED = 1

MESSAGE_BYTES = 1 << 16

#: One launch at a time per process: the runtime keeps global fiber state.
LAUNCH_LOCK = threading.Lock()
_LOADED: dict[Path, ctypes.CDLL] = {}
_LOAD_LOCK = threading.Lock()


MAX_SITES = 64
SITE_CP_ASYNC = 0
SITE_LDMATRIX = 1


class NativeSiteCounters(ctypes.Structure):
    """Mirror of ``struct ftemu_site_counters``."""

    _fields_ = [
        ("file", ctypes.c_char_p),
        ("line", ctypes.c_uint),
        ("kind", ctypes.c_int),
        ("requests", ctypes.c_ulonglong),
        ("phases", ctypes.c_ulonglong),
        ("wavefronts", ctypes.c_ulonglong),
        ("global_bytes", ctypes.c_ulonglong),
        ("sectors", ctypes.c_ulonglong),
        ("min_sectors", ctypes.c_ulonglong),
    ]


#: The scalar fields of ``struct ftemu_counters``, in order.
COUNTER_FIELDS = (
    "cp_async_copies", "cp_async_requests", "cp_async_bytes", "cp_async_fill_bytes",
    "cp_async_sectors", "cp_async_min_sectors", "cp_async_smem_phases",
    "cp_async_smem_wavefronts", "ldmatrix_count", "ldmatrix_phases", "ldmatrix_wavefronts",
    "mma_count", "shfl_count", "barrier_count", "ldg_bytes",
)


class Counters(ctypes.Structure):
    """Mirror of ``struct ftemu_counters``."""

    _fields_ = [
        *[(name, ctypes.c_ulonglong) for name in COUNTER_FIELDS],
        ("block_mma", ctypes.POINTER(ctypes.c_ulonglong)),
        ("block_mma_len", ctypes.c_ulonglong),
        ("nsites", ctypes.c_uint),
        ("sites_dropped", ctypes.c_uint),
        ("sites", NativeSiteCounters * MAX_SITES),
    ]


class LaunchConfig(ctypes.Structure):
    """Mirror of ``struct ftemu_launch_config``."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("dyn_smem_bytes", ctypes.c_ulonglong),
        ("smem_limit_bytes", ctypes.c_ulonglong),
        ("stack_bytes", ctypes.c_ulonglong),
        ("schedule", ctypes.c_int),
        ("checks", ctypes.c_int),
        ("hang_timeout_s", ctypes.c_double),
        ("counters", ctypes.POINTER(Counters)),
        ("block_order", ctypes.c_int),
        ("block_order_seed", ctypes.c_ulonglong),
    ]


def load(path: Path) -> ctypes.CDLL:
    """Load a kernel library once per process (RTLD_LOCAL: each binds to its own runtime)."""
    with _LOAD_LOCK:
        lib = _LOADED.get(path)
        if lib is None:
            lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
            _LOADED[path] = lib
        return lib


def entry_functions(lib: ctypes.CDLL, entry: str) -> tuple[Callable[..., int], str]:
    """The launcher of ``entry`` and its parameter type codes (see runtime.h type_code).

    Raises EmulatorError when the library has no launcher for ``entry`` (it is not the
    library that was built for this kernel).
    """
    try:
        launch = getattr(lib, f"ftemu_launch__{entry}")
        signature = getattr(lib, f"ftemu_signature__{entry}")
    except AttributeError:
        raise EmulatorError(
            f"the emulator library {lib._name} has no launcher for the kernel {entry}: it is "
            "not the library built for this kernel. It was discarded from the cache; run "
            "again to rebuild it") from None
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.POINTER(ctypes.c_void_p),
                       ctypes.c_char_p, ctypes.c_ulonglong]
    signature.restype = ctypes.c_char_p
    signature.argtypes = []
    codes: bytes = signature()
    launcher: Callable[..., int] = launch
    return launcher, codes.decode()


def raise_for_status(status: int, message: str) -> None:
    """Turn a launcher status into flashtune's typed errors."""
    if status == OK:
        return
    if status == DEADLOCK:
        raise EmulatorDeadlock(message)
    if status == BAD_LAUNCH:
        raise EmulatorError(f"invalid launch: {message}")
    raise EmulatorError(message or f"emulated launch failed with status {status}")
