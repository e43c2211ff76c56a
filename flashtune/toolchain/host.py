"""The CPU emulator's host toolchain: C++ compiler, CUDA include directories, ASan.

Nothing here builds anything; the emulator's ``build.py`` turns these facts into compiler
command lines and cache keys. The CUDA headers are found by the same search rule as NVRTC's
(``toolchain.cuda.search_layouts``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from flashtune import settings
from flashtune.errors import ToolchainNotFound
from flashtune.toolchain.cuda import search_layouts

#: Wheels whose headers the emulator compiles against (host-side half/bfloat16 types).
_CUDA_WHEELS = ("nvidia-cuda-runtime", "nvidia-cuda-crt", "nvidia-cuda-cccl",
                "nvidia-cuda-runtime-cu12")


@functools.lru_cache(maxsize=1)
def cuda_include_dirs() -> tuple[Path, ...]:
    """Include directories that provide cuda_fp16.h, cuda_bf16.h and the host-side CUDA
    headers (crt/host_defines.h), plus their ``cccl`` subdirectory where present.

    Searched in the order of ``toolchain.cuda.search_layouts``: the nvidia pip wheels, then
    ``FLASHTUNE_CUDA_HOME``, then /usr/local/cuda.
    """
    layouts = search_layouts([Path(p) for p in sys.path if p and Path(p).is_dir()],
                             settings.CUDA_HOME.get())
    candidates = [inc for layout in layouts for inc in layout.include_dirs]
    for inc in candidates:
        if (inc / "cuda_fp16.h").is_file() and (inc / "crt" / "host_defines.h").is_file():
            dirs = [inc]
            if (inc / "cccl").is_dir():
                dirs.append(inc / "cccl")
            return tuple(dirs)
    raise ToolchainNotFound(
        "the CPU emulator needs the CUDA headers cuda_fp16.h and crt/host_defines.h; searched "
        f"{[str(c) for c in candidates]}. Install them with `pip install flashtune[cu13]` "
        "(wheels nvidia-cuda-runtime, nvidia-cuda-crt, nvidia-cuda-cccl) or set "
        "FLASHTUNE_CUDA_HOME to a CUDA toolkit"
    )


@functools.lru_cache(maxsize=1)
def cuda_headers_identity() -> str:
    """Versions of the wheels that provide the CUDA headers (part of every cache key)."""
    parts = []
    for name in _CUDA_WHEELS:
        try:
            parts.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ";".join(parts) + "|" + ";".join(str(d) for d in cuda_include_dirs())


def host_compiler() -> str:
    """The host C++20 compiler (setting FLASHTUNE_CXX, default g++)."""
    return settings.HOST_CXX.get()


@functools.lru_cache(maxsize=8)
def compiler_identity(cxx: str) -> str:
    """``cxx --version`` (first line) and target: part of every cache key."""
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True,
                             timeout=60).stdout
        machine = subprocess.run([cxx, "-dumpmachine"], capture_output=True, text=True,
                                 check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ToolchainNotFound(
            f"host C++ compiler {cxx!r} cannot be run ({exc}); install g++ 12 or newer or set "
            "FLASHTUNE_CXX to a C++20 compiler"
        ) from exc
    return out.splitlines()[0].strip() + " / " + machine.strip()


@functools.lru_cache(maxsize=8)
def is_gcc(cxx: str) -> bool:
    """Whether ``cxx`` is GCC itself (not clang or another compiler that defines __GNUC__):
    only GCC's precompiled headers are made and used the way build.py does."""
    try:
        macros = subprocess.run([cxx, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True,
                                text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    names = {line.split()[1] for line in macros.splitlines() if line.startswith("#define ")}
    return "__GNUC__" in names and not names & {"__clang__", "__INTEL_LLVM_COMPILER",
                                                "__INTEL_COMPILER", "__NVCOMPILER"}


def asan_requested() -> bool:
    """Whether kernels are built with AddressSanitizer (setting FLASHTUNE_EMULATOR_ASAN)."""
    return settings.EMULATOR_ASAN.get()


@functools.lru_cache(maxsize=8)
def asan_runtime(cxx: str) -> Path:
    """Path of the compiler's AddressSanitizer runtime library."""
    out = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True,
                         check=False, timeout=60).stdout.strip()
    path = Path(out)
    if not path.is_absolute() or not path.exists():
        raise ToolchainNotFound(
            f"{cxx} has no AddressSanitizer runtime (libasan.so); install it (Debian: "
            "libasan8) or unset FLASHTUNE_EMULATOR_ASAN"
        )
    return path.resolve()


def asan_environment(cxx: str | None = None) -> dict[str, str]:
    """Environment variables a process needs to run ASan-instrumented emulated kernels.

    The sanitizer runtime must be the first library the process loads (LD_PRELOAD), and
    ``halt_on_error=0`` lets the emulator turn a report into an EmulatorError instead of
    ending the process.
    """
    return {
        "LD_PRELOAD": str(asan_runtime(cxx or host_compiler())),
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=0:allow_user_segv_handler=1",
        "FLASHTUNE_EMULATOR_ASAN": "1",
    }


def asan_loaded() -> bool:
    """Whether this process has the AddressSanitizer runtime loaded."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return "libasan" in maps


def check_asan_process() -> None:
    """Raise ToolchainNotFound unless this process can run ASan-instrumented kernels."""
    options = os.environ.get("ASAN_OPTIONS", "")
    if asan_loaded() and "halt_on_error=0" in options:
        return
    env = " ".join(f"{k}={v}" for k, v in asan_environment().items())
    raise ToolchainNotFound(
        "FLASHTUNE_EMULATOR_ASAN=1 needs a process started with the AddressSanitizer runtime "
        f"preloaded and recoverable reports; start it as: {env} python ..."
    )
