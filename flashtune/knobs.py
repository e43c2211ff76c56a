"""Every environment variable flashtune reads, declared once and typed.

Read a knob with ``knobs.CACHE_DIR.get()``; values are parsed on each call so tests and
users can change the environment at run time. ``flashtune knobs`` (CLI) and the README list
them all from ``ALL``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import platformdirs

from flashtune.errors import KnobError

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected one of {sorted(_TRUE | _FALSE - {''})}")


def _choice(*options: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in options:
            raise ValueError(f"expected one of {list(options)}")
        return value

    return parse


@dataclass(frozen=True)
class Knob(Generic[T]):
    """One environment variable: its name, parser, default and documentation."""

    name: str
    parse: Callable[[str], T]
    default: Callable[[], T]
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default()
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise KnobError(
                f"environment variable {self.name}={raw!r} is invalid: {exc}. "
                f"Fix or unset it ({self.doc})"
            ) from exc

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name))


def _user_cache() -> Path:
    return Path(platformdirs.user_cache_dir("flashtune", appauthor=False))


def _default_db() -> str:
    data = Path(platformdirs.user_data_dir("flashtune", appauthor=False))
    return f"sqlite:///{data / 'tuning.db'}"


CACHE_DIR: Knob[Path] = Knob(
    "FLASHTUNE_CACHE_DIR",
    lambda raw: Path(raw).expanduser(),
    _user_cache,
    "directory for compiled kernels and emulator builds (default: the user cache directory)",
)
DB_URL: Knob[str] = Knob(
    "FLASHTUNE_DB",
    str,
    _default_db,
    "SQLAlchemy URL or file path of the tuning database (default: tuning.db in the user "
    "data directory)",
)
BACKEND: Knob[str] = Knob(
    "FLASHTUNE_BACKEND",
    _choice("auto", "cuda", "emulator"),
    lambda: "auto",
    "kernel backend: auto (CUDA tensors on the GPU), cuda, or emulator (CPU tensors)",
)
LOG_LEVEL: Knob[str] = Knob(
    "FLASHTUNE_LOG_LEVEL",
    _choice("debug", "info", "warning", "error"),
    lambda: "warning",
    "log level of the 'flashtune' logger",
)
CUDA_HOME: Knob[Path | None] = Knob(
    "FLASHTUNE_CUDA_HOME",
    lambda raw: Path(raw).expanduser(),
    lambda: None,
    "optional CUDA toolkit root, searched after the nvidia pip wheels for headers and tools",
)
HOST_CXX: Knob[str] = Knob(
    "FLASHTUNE_CXX",
    str,
    lambda: "g++",
    "host C++20 compiler used to build the CPU emulator",
)
EMULATOR_ARCH: Knob[str] = Knob(
    "FLASHTUNE_EMULATOR_ARCH",
    _choice("sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_100", "sm_120"),
    lambda: "sm_90",
    "arch of the emulator's virtual device: configs are chosen as for a GPU of this arch",
)
EMULATOR_ASAN: Knob[bool] = Knob(
    "FLASHTUNE_EMULATOR_ASAN",
    _parse_bool,
    lambda: False,
    "build emulated kernels with AddressSanitizer to catch out-of-bounds global accesses",
)
EMULATOR_TIMEOUT_S: Knob[float] = Knob(
    "FLASHTUNE_EMULATOR_DEADLOCK_S",
    float,
    lambda: 10.0,
    "seconds without progress after which the emulator reports a hang",
)
COMPILE_WORKERS: Knob[int] = Knob(
    "FLASHTUNE_COMPILE_WORKERS",
    int,
    lambda: max(1, (os.cpu_count() or 2)),
    "processes used to compile kernels in parallel",
)

ALL: tuple[Knob[object], ...] = (  # type: ignore[assignment]
    CACHE_DIR,
    DB_URL,
    BACKEND,
    LOG_LEVEL,
    CUDA_HOME,
    HOST_CXX,
    EMULATOR_ARCH,
    EMULATOR_ASAN,
    EMULATOR_TIMEOUT_S,
    COMPILE_WORKERS,
)
