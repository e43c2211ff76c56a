"""Every environment variable flashtune reads, declared once, typed and validated.

Read a setting with ``settings.CACHE_DIR.get()``; values are parsed on each call so tests and
users can change the environment at run time. A value that does not parse or lies outside
its legal range raises ``SettingError`` naming the variable, the value and what is legal; no
value is ever silently replaced by a default. ``flashtune settings`` (CLI) and the README list
them all from ``ALL``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import platformdirs

from flashtune.errors import SettingError

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
#: Kernel pseudo-file systems: nothing of flashtune's can live there.
_PSEUDO_FS = (Path("/proc"), Path("/sys"), Path("/dev"))


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


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        text = raw.strip()
        if not re.fullmatch(r"[+-]?\d{1,19}", text):
            raise ValueError(f"expected an integer in [{lo}, {hi}]")
        value = int(text)
        if not lo <= value <= hi:
            raise ValueError(f"{value} is outside the legal range [{lo}, {hi}]")
        return value

    return parse


def _seconds_in(lo_exclusive: float, hi: float) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            raise ValueError(f"expected a number of seconds in ({lo_exclusive:g}, "
                             f"{hi:g}]") from None
        if not math.isfinite(value) or not lo_exclusive < value <= hi:
            raise ValueError(f"{value} is outside the legal range ({lo_exclusive:g}, {hi:g}] "
                             "seconds (a finite number)")
        return value

    return parse


def _absolute_path(raw: str) -> Path:
    """An absolute path, with ``~`` expanded; relative and unresolvable paths are refused."""
    text = raw.strip()
    if "\0" in text:
        raise ValueError("a path cannot contain a NUL character")
    try:
        path = Path(text).expanduser()
    except RuntimeError:  # an unknown ~user (or no home directory at all)
        path = Path(text)
    if text.startswith("~") and str(path).startswith("~"):
        raise ValueError(f"{text.split('/', 1)[0]!r} names no user's home directory; expected "
                         "an absolute path")
    if not path.is_absolute():
        raise ValueError("relative paths are refused (their meaning would change with the "
                         "working directory); expected an absolute path")
    for pseudo in _PSEUDO_FS:
        if path == pseudo or pseudo in path.parents:
            raise ValueError(f"{path} is inside {pseudo}, a kernel pseudo-file system; expected "
                             "a directory on a real file system")
    return path


def _directory_to_create(raw: str) -> Path:
    """An absolute path that is a directory or can become one (no file in the way)."""
    path = _absolute_path(raw)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{probe} is not a directory; expected a directory path")
    return path


def _existing_directory(raw: str) -> Path:
    path = _absolute_path(raw)
    if not path.is_dir():
        raise ValueError(f"{path} is not an existing directory")
    return path


def _directory_list(raw: str) -> tuple[Path, ...]:
    parts = [p for p in raw.split(os.pathsep) if p.strip()]
    return tuple(_existing_directory(p) for p in parts)


def _command(raw: str) -> str:
    text = raw.strip()
    if not text or re.search(r"[\s\x00-\x1f]", text):
        raise ValueError("expected one command name or path, without spaces or control "
                         "characters (e.g. g++-12 or /usr/bin/g++)")
    if "/" in text and not Path(text).expanduser().is_file():
        raise ValueError(f"{text} is not an existing file")
    return text


def _database_url(raw: str) -> str:
    text = raw.strip()
    if "\0" in text:
        raise ValueError("a database URL cannot contain a NUL character")
    return text


#: Tokens of FLASHTUNE_TRUSTED_SOURCES besides bundle digest prefixes and host names.
TRUST_LOCAL = "local"
TRUST_ALL = "all"
_TRUST_TOKEN = re.compile(r"local|all|[0-9a-f]{8,64}|host:[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


def _trusted_sources(raw: str) -> frozenset[str]:
    tokens = [t.strip() for t in raw.split(",") if t.strip()]
    for token in tokens:
        if not _TRUST_TOKEN.fullmatch(token):
            raise ValueError(f"{token!r} is not a source; expected a comma-separated list of "
                             "'local', 'all', bundle digest prefixes (8 to 64 lowercase hex "
                             "digits) or 'host:NAME'")
    return frozenset(tokens)


@dataclass(frozen=True)
class Setting(Generic[T]):
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
            raise SettingError(
                f"environment variable {self.name}={raw!r} is invalid: {exc}. "
                f"Fix or unset it ({self.doc})"
            ) from None

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name))


def _user_cache() -> Path:
    return Path(platformdirs.user_cache_dir("flashtune", appauthor=False))


def _default_db() -> str:
    data = Path(platformdirs.user_data_dir("flashtune", appauthor=False))
    return f"sqlite:///{data / 'tuning.db'}"


CACHE_DIR: Setting[Path] = Setting(
    "FLASHTUNE_CACHE_DIR",
    _directory_to_create,
    _user_cache,
    "absolute path of the private directory for compiled kernels and emulator builds "
    "(default: the user cache directory)",
)
PRECOMPILED_DIRS: Setting[tuple[Path, ...]] = Setting(
    "FLASHTUNE_PRECOMPILED_DIR",
    _directory_list,
    tuple,
    f"read-only directories written by `flashtune precompile` (separated by {os.pathsep!r}), "
    "searched for kernels before the cache; each is verified against its manifest",
)
DB_URL: Setting[str] = Setting(
    "FLASHTUNE_DB",
    _database_url,
    _default_db,
    "SQLAlchemy URL or file path of the tuning database (default: tuning.db in the user "
    "data directory)",
)
DB_BUSY_TIMEOUT_S: Setting[float] = Setting(
    "FLASHTUNE_DB_BUSY_TIMEOUT_S",
    _seconds_in(0.0, 3600.0),
    lambda: 60.0,
    "seconds a SQLite writer waits for another writer before failing, in (0, 3600]",
)
TRUSTED_SOURCES: Setting[frozenset[str]] = Setting(
    "FLASHTUNE_TRUSTED_SOURCES",
    _trusted_sources,
    lambda: frozenset({TRUST_LOCAL}),
    "whose results of OTHER devices may serve this one through the fallback tiers: "
    "'local' (tuned into this database), 'all', bundle digest prefixes or 'host:NAME', "
    "comma-separated (default: local)",
)
BACKEND: Setting[str] = Setting(
    "FLASHTUNE_BACKEND",
    _choice("auto", "cuda", "emulator"),
    lambda: "auto",
    "kernel backend: auto (CUDA tensors on the GPU), cuda, or emulator (CPU tensors)",
)
LOG_LEVEL: Setting[str] = Setting(
    "FLASHTUNE_LOG_LEVEL",
    _choice("debug", "info", "warning", "error"),
    lambda: "warning",
    "log level of the 'flashtune' logger",
)
CUDA_HOME: Setting[Path | None] = Setting(
    "FLASHTUNE_CUDA_HOME",
    _existing_directory,
    lambda: None,
    "optional CUDA toolkit root (an existing directory), searched after the nvidia pip "
    "wheels for headers and tools",
)
HOST_CXX: Setting[str] = Setting(
    "FLASHTUNE_CXX",
    _command,
    lambda: "g++",
    "host C++20 compiler used to build the CPU emulator (a command name or path)",
)
#: The archs of ``codegen.arch.ARCHS``, in its order (settings sit below codegen; a test holds
#: the two equal).
ARCH_NAMES = ("sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_120")
EMULATOR_ARCH: Setting[str] = Setting(
    "FLASHTUNE_EMULATOR_ARCH",
    _choice(*ARCH_NAMES),
    lambda: "sm_90",
    "arch of the emulator's virtual device: configs are chosen as for a GPU of this arch. "
    "sm_90 (the default) keeps the mma.sync kernels; sm_90a runs the sm_90a families (wgmma) "
    "as a compute capability 9.0 GPU does (unless FLASHTUNE_ARCH_SPECIFIC=0)",
)
ARCH_SPECIFIC: Setting[bool] = Setting(
    "FLASHTUNE_ARCH_SPECIFIC",
    _parse_bool,
    lambda: True,
    "serve calls on a GPU with the arch-specific kernel families it runs (the sm_90a wgmma "
    "forward on compute capability 9.0), each kernel checked against float64 on a small input "
    "before its first call (a failure turns them off for the process, with a warning); 0: the "
    "portable mma.sync kernels only",
)
FIRST_USE_TIMEOUT_S: Setting[float] = Setting(
    "FLASHTUNE_FIRST_USE_TIMEOUT_S",
    _seconds_in(0.0, 3600.0),
    lambda: 60.0,
    "seconds the first-use check of an arch-specific kernel waits for it to finish before it "
    "reports the kernel as hung, in (0, 3600]",
)
EMULATOR_ASAN: Setting[bool] = Setting(
    "FLASHTUNE_EMULATOR_ASAN",
    _parse_bool,
    lambda: False,
    "build emulated kernels with AddressSanitizer to catch out-of-bounds global accesses",
)
EMULATOR_TIMEOUT_S: Setting[float] = Setting(
    "FLASHTUNE_EMULATOR_DEADLOCK_S",
    _seconds_in(0.0, 86400.0),
    lambda: 10.0,
    "seconds without progress after which the emulator reports a hang, in (0, 86400]",
)
MAX_COMPILE_WORKERS = 1024
COMPILE_WORKERS: Setting[int] = Setting(
    "FLASHTUNE_COMPILE_WORKERS",
    _int_in(1, MAX_COMPILE_WORKERS),
    lambda: max(1, (os.cpu_count() or 2)),
    f"processes used to compile kernels in parallel, in [1, {MAX_COMPILE_WORKERS}]",
)

CHECK_INPUTS: Setting[bool] = Setting(
    "FLASHTUNE_CHECK_INPUTS",
    _parse_bool,
    lambda: False,
    "GPU: synchronise after attention_with_kvcache and raise a clear error for a bad cache "
    "length or block-table entry (costs a synchronisation; off, the kernel stops with a trap "
    "and the error surfaces at the next synchronisation). The emulator always checks",
)

BATCH_INVARIANT: Setting[bool] = Setting(
    "FLASHTUNE_BATCH_INVARIANT",
    _parse_bool,
    lambda: False,
    "attention_with_kvcache's default for batch_invariant: split each sequence by a fixed "
    "number of keys for its own length and run one tile for every cache capacity, so that "
    "a sequence's output is bitwise the same whatever else is in the batch",
)

ALL: tuple[Setting[object], ...] = (  # type: ignore[assignment]
    CACHE_DIR,
    PRECOMPILED_DIRS,
    DB_URL,
    DB_BUSY_TIMEOUT_S,
    TRUSTED_SOURCES,
    BACKEND,
    LOG_LEVEL,
    CUDA_HOME,
    HOST_CXX,
    EMULATOR_ARCH,
    ARCH_SPECIFIC,
    FIRST_USE_TIMEOUT_S,
    EMULATOR_ASAN,
    EMULATOR_TIMEOUT_S,
    COMPILE_WORKERS,
    CHECK_INPUTS,
    BATCH_INVARIANT,
)
