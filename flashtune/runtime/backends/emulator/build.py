"""Building the emulator: the runtime library once, then one shared library per kernel source.

The runtime (fibers, scheduler, collectives, checks) is compiled once per toolchain and
cached; a kernel build compiles only the kernel source, a generated launcher and the
kernel-side headers, and links against the cached runtime by its absolute path. Both are
cached through ArtifactCache, keyed by everything that changes the binary: sources, the
contents of the emulator headers and of the kernel's include directories, compiler flags,
compiler identity and CUDA header versions.

The header every kernel build includes first (``flashtune_emu/runtime.h``, which pulls in the
C++ standard library and the CUDA half/bfloat16 headers: about 45,000 lines) is precompiled
once per compiler and flag set where the compiler is GCC: parsing it is about half of a kernel
build. Its flag set leaves out the -D options of macros the prelude never reads, so kernels
that differ only in their own macros share it. A precompiled header GCC cannot use (a macro
it reads is defined another way) is skipped by GCC itself (it parses the header as usual), so
it only ever changes the build's time, never its result.

Each library carries its own cache key as the exported string ``ftemu_build_key``
(``flashtune-emulator-key:<key>``); ``bound_library`` checks the file for it before the
library is handed out, so a library of another kernel (or another runtime) that lands under
a key is discarded and rebuilt instead of loaded.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from flashtune.errors import CacheError, CompileError
from flashtune.toolchain import host as toolchain
from flashtune.toolchain.cache import ArtifactCache

#: The emulator's own headers (runtime.h, primitives.h, abi.h) and runtime sources.
INCLUDE_DIR = Path(__file__).resolve().parent / "include"
RUNTIME_SOURCE_DIR = INCLUDE_DIR / "flashtune_emu" / "src"

NAMESPACE = "emulator"
_ENTRY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,200}$")
_DEFINE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(=[A-Za-z0-9_.+-]*)?$")
_HEADER_SUFFIXES = (".h", ".hpp", ".cuh", ".inc")
_KEY_PREFIX = "flashtune-emulator-key:"
#: What a host compiler prints when the disk is full (GNU as/ld, g++ and clang).
_DISK_FULL = re.compile(r"No space left on device|Disk quota exceeded", re.IGNORECASE)
log = logging.getLogger("flashtune.emulator")

#: Flags of every emulator compilation (kernel and runtime).
BASE_FLAGS: tuple[str, ...] = (
    "-std=c++20", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-strict-aliasing",
    "-Wno-unknown-pragmas", "-DFLASHTUNE_EMULATOR=1",
)
RUNTIME_OPT: tuple[str, ...] = ("-O2",)
#: Kernel code runs little arithmetic of its own (mma and friends run in the runtime), so
#: a light optimisation level keeps builds fast; see the measurements in tests/emulator.
KERNEL_OPT: tuple[str, ...] = ("-O1",)
ASAN_FLAGS: tuple[str, ...] = (
    "-fsanitize=address", "-fsanitize-recover=address", "-fno-omit-frame-pointer", "-g",
)


@dataclass(frozen=True)
class BuildOptions:
    """What a kernel build depends on beyond its source text."""

    include_dirs: tuple[Path, ...] = ()
    defines: tuple[str, ...] = ()
    asan: bool = False
    opt: tuple[str, ...] = KERNEL_OPT
    cxx: str = field(default_factory=toolchain.host_compiler)

    def __post_init__(self) -> None:
        for d in self.defines:
            if not _DEFINE_RE.match(d):
                raise ValueError(f"define {d!r} is malformed; expected NAME or NAME=VALUE")
        for flag in self.opt:
            if not re.match(r"^-O[0-3sg]$|^-g$", flag):
                raise ValueError(f"optimisation flag {flag!r} is not one of -O0..-O3, -Os, -g")


@dataclass(frozen=True)
class BuiltLibrary:
    """A compiled kernel library and what it took to get it."""

    path: Path
    runtime: Path
    entries: tuple[str, ...]
    key: str
    build_seconds: float  # 0.0 when it came from the cache


def _hash_files(h: hashlib._Hash, files: Iterable[Path], root: Path) -> None:
    for path in sorted(files):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")


def _emulator_files() -> list[Path]:
    return [p for p in INCLUDE_DIR.rglob("*") if p.is_file()]


def _header_files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file() and p.suffix in _HEADER_SUFFIXES]


def _flags(asan: bool, opt: Sequence[str]) -> list[str]:
    return [*BASE_FLAGS, *opt, *(ASAN_FLAGS if asan else ())]


def _object_flags(flags: Sequence[str]) -> list[str]:
    """``flags`` for a compile that makes no shared library (an object, a precompiled header)."""
    return [f for f in flags if f != "-shared"]


def _include_flags(extra: Sequence[Path]) -> list[str]:
    dirs = [INCLUDE_DIR, *extra, *toolchain.cuda_include_dirs()]
    return [f"-I{d}" for d in dirs]


def key_marker(key: str) -> bytes:
    """The bytes every library built under ``key`` contains (its ``ftemu_build_key``)."""
    return (_KEY_PREFIX + key).encode() + b"\0"


def key_source(key: str) -> str:
    """C++ that defines the exported ``ftemu_build_key`` string of a library."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", key):
        raise ValueError(f"build key {key!r} is malformed")
    return (f'\nextern "C" __attribute__((visibility("default"), used)) const char '
            f'ftemu_build_key[] = "{_KEY_PREFIX}{key}";\n')


def _compile(cmd: list[str], what: str, source_text: str, cache: ArtifactCache, key: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        output = proc.stderr or proc.stdout
        full = _DISK_FULL.search(output)
        if full is not None:
            raise CacheError(
                f"the host compiler could not write {what} for the CPU emulator: the disk (or "
                f"your quota) is full ({full.group(0)}). Free space in "
                f"{cache.base} and the temporary directory, or point FLASHTUNE_CACHE_DIR and "
                "TMPDIR at another disk")
        saved = cache.put_bytes(NAMESPACE + "-failed", key, ".cu", source_text.encode())
        raise CompileError(
            f"the host compiler failed to build {what} for the CPU emulator (exit code "
            f"{proc.returncode}); fix the source or the toolchain",
            log=output[-20000:],
            source_path=saved,
        )


def bound_library(cache: ArtifactCache, key: str, build: Callable[[Path], None]) -> Path:
    """The library cached under ``key``, built if needed, checked to carry ``key``.

    A library without its key (another kernel's, copied or renamed into place) is never
    loaded: it is discarded and rebuilt once; a rebuild that still lacks it is a CacheError.
    """
    marker = key_marker(key)
    for _attempt in range(2):
        path = cache.get_or_build(NAMESPACE, key, ".so", build)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CacheError(f"cannot read the emulator library {path}: {exc}") from None
        if marker in data:
            return path
        log.warning("the emulator library %s is not the build of key %s (another library "
                    "was put in its place); discarding and rebuilding it", path, key)
        cache.discard(NAMESPACE, key, ".so")
    raise CacheError(f"the emulator library {path} still lacks its build key {key} after a "
                     "rebuild; check FLASHTUNE_CXX and remove the cache directory "
                     f"{cache.root / NAMESPACE}")


def runtime_library(cache: ArtifactCache | None = None, *, asan: bool = False,
                    cxx: str | None = None) -> Path:
    """The emulator runtime library for this toolchain (built once, then cached)."""
    cache = cache or ArtifactCache()
    cxx = cxx or toolchain.host_compiler()
    flags = _flags(asan, RUNTIME_OPT)
    h = hashlib.sha256(b"flashtune-emulator-runtime\0")
    h.update("\0".join([toolchain.compiler_identity(cxx), toolchain.cuda_headers_identity(),
                        *flags]).encode())
    _hash_files(h, _emulator_files(), INCLUDE_DIR)
    key = "rt-" + h.hexdigest()[:40]
    sources = sorted(RUNTIME_SOURCE_DIR.glob("*.cpp"))

    def build(tmp: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="flashtune-emu-rt-") as work:
            marker = Path(work) / "build_key.cpp"
            marker.write_text(key_source(key))

            def compile_one(source: Path) -> Path:
                obj = Path(work) / f"{source.stem}.o"
                _compile([cxx, *_object_flags(flags), *_include_flags(()),
                          "-c", str(source), "-o", str(obj)],
                         f"the emulator runtime ({source.name})", source.read_text(), cache,
                         key)
                return obj

            # One compiler a source, on every core: the first emulator launch waits for this.
            with ThreadPoolExecutor(max_workers=min(len(sources) + 1, os.cpu_count() or 1),
                                    thread_name_prefix="flashtune-emu-rt") as pool:
                objects = list(pool.map(compile_one, [*sources, marker]))
            # Kernel libraries name the runtime by this soname; the loader matches it against
            # the runtime already loaded from the cache (kernel.py loads it first), wherever
            # the cache directory lives.
            _compile([cxx, *flags, *map(str, objects), "-o", str(tmp),
                      f"-Wl,-soname,libftemu-{key}.so", "-ldl", "-lpthread"],
                     "the emulator runtime", "\n".join(s.read_text() for s in sources),
                     cache, key)

    return bound_library(cache, key, build)


#: The plain header a kernel build includes first, and what stands in for it where a
#: precompiled form exists.
PRELUDE = "flashtune_emu/runtime.h"
_PRELUDE_STUB = f'#include "{PRELUDE}"\n'
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Preludes already looked up in this process, by cache and key: a lookup reads and checks
#: about 60 MB, and a failed build is not retried for every kernel.
_PRELUDES: dict[tuple[Path, str], str] = {}


@functools.lru_cache(maxsize=1)
def _prelude_names() -> frozenset[str]:
    """Every identifier the emulator's headers mention."""
    return frozenset(word for path in _header_files(INCLUDE_DIR)
                     for word in _IDENTIFIER.findall(path.read_text()))


def prelude_flags(flags: Sequence[str]) -> list[str]:
    """``flags`` less the -D options of macros the prelude does not read, the flags its
    precompiled form is built and keyed with. A define stays when the emulator's headers name
    its macro or when its name is reserved (a leading underscore: the switches of the standard
    library and the CUDA headers). Where a define left out does reach the prelude after all,
    GCC refuses the precompiled form and parses the header, so the choice changes build times
    only."""
    def read_by_prelude(flag: str) -> bool:
        name = flag[2:].split("=", 1)[0]
        return name.startswith("_") or name in _prelude_names()

    return [f for f in flags if not f.startswith("-D") or read_by_prelude(f)]


def prelude_include(cache: ArtifactCache, runtime: Path, flags: Sequence[str], cxx: str
                    ) -> str:
    """What a kernel build compiled with ``flags`` passes to ``-include``: under GCC a cached
    header that includes PRELUDE, with its precompiled form (``.gch``) beside it; PRELUDE
    itself for other compilers or where the precompiled form failed to build (logged once)."""
    if not toolchain.is_gcc(cxx):
        return PRELUDE
    flags = prelude_flags(flags)
    h = hashlib.sha256(b"flashtune-emulator-prelude\0")
    # The runtime's name covers the emulator headers, the CUDA headers and the compiler.
    h.update("\0".join([runtime.name, *flags]).encode())
    key = "pch-" + h.hexdigest()[:40]
    memo = (cache.root, key)
    if memo not in _PRELUDES:
        stub = cache.put_bytes(NAMESPACE, key, ".h", _PRELUDE_STUB.encode())

        def build(tmp: Path) -> None:
            cmd = [cxx, *_object_flags(flags), *_include_flags(()),
                   "-x", "c++-header", str(stub), "-o", str(tmp)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise CompileError("the emulator's precompiled header did not build",
                                   log=(proc.stderr or proc.stdout)[-4000:])

        try:
            cache.get_or_build(NAMESPACE, key, ".h.gch", build)
            _PRELUDES[memo] = str(stub)
        except CompileError as exc:
            log.warning("%s; kernel builds parse %s instead", exc, PRELUDE)
            _PRELUDES[memo] = PRELUDE
    return _PRELUDES[memo]


def launcher_source(entries: Sequence[str]) -> str:
    """The generated tail of a kernel source: one exported launcher per entry point."""
    for entry in entries:
        if not _ENTRY_RE.match(entry):
            raise ValueError(f"entry {entry!r} is not a C identifier")
    lines = ["", "// ---- flashtune emulator launchers (generated) ----"]
    lines += [f"FTEMU_DEFINE_LAUNCHER({entry})" for entry in entries]
    return "\n".join(lines) + "\n"


def kernel_library(code: str, entries: Sequence[str], options: BuildOptions,
                   cache: ArtifactCache | None = None) -> BuiltLibrary:
    """Compile ``code`` (CUDA source) with launchers for ``entries`` into a cached library."""
    if not entries:
        raise ValueError("at least one entry point is needed")
    cache = cache or ArtifactCache()
    runtime = runtime_library(cache, asan=options.asan, cxx=options.cxx)
    source = code + launcher_source(entries)
    flags = _flags(options.asan, options.opt) + [f"-D{d}" for d in options.defines]
    h = hashlib.sha256(b"flashtune-emulator-kernel\0")
    h.update(runtime.name.encode() + b"\0" + source.encode() + b"\0")
    h.update("\0".join([toolchain.compiler_identity(options.cxx), *flags]).encode())
    for d in options.include_dirs:
        h.update(str(d).encode() + b"\0")
        _hash_files(h, _header_files(d), d)
    key = "k-" + h.hexdigest()[:40]
    file_stem = entries[0] if len(entries) == 1 else "kernels"
    elapsed = 0.0

    def build(tmp: Path) -> None:
        nonlocal elapsed
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="flashtune-emu-") as work:
            src = Path(work) / f"{file_stem}.cu"
            src.write_text(source + key_source(key))
            cmd = [options.cxx, *flags, *_include_flags(options.include_dirs),
                   "-include", prelude_include(cache, runtime, flags, options.cxx), "-x", "c++",
                   str(src), "-x", "none",
                   str(runtime), "-o", str(tmp)]
            _compile(cmd, f"kernel {', '.join(entries)}", source, cache, key)
        elapsed = time.perf_counter() - start

    path = bound_library(cache, key, build)
    return BuiltLibrary(path=path, runtime=runtime, entries=tuple(entries), key=key,
                        build_seconds=elapsed)
