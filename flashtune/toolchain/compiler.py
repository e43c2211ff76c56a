"""NVRTC: KernelSource -> cubin (and PTX) plus resource usage, for any named arch, no GPU.

``compile_source(source, "sm_90")`` returns a frozen CompiledKernel. Results are kept in an
in-process memo and on disk (ArtifactCache namespace ``cubin``) under a compile key that
hashes everything that changes the binary: the source digest (rendered code, flashtune
headers, template options, flashtune version), the arch, the NVRTC version and binaries,
the contents of the toolkit headers the kernel includes and the final NVRTC option list.
Concurrent processes compile each key once (the cache's per-artifact lock).

A failed compilation raises CompileError with NVRTC's log and the path where the failing
source was saved: a folder of the cache's ``failed`` namespace holding the source, the
flashtune headers it includes and ``nvrtc.log`` (options and log), so it compiles by hand.
Failures are not cached: fixing the cause and retrying recompiles.

``compile_many`` / ``compile_pairs`` compile many (source, arch) pairs in a process pool.
"""

from __future__ import annotations

import hashlib
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from flashtune import settings
from flashtune.codegen.arch import ArchSpec, compile_target, get_arch
from flashtune.codegen.spec import KernelSource
from flashtune.errors import CompileError, ToolchainNotFound
from flashtune.toolchain import nvrtc
from flashtune.toolchain.cache import ArtifactCache
from flashtune.toolchain.compiled import (
    ARTIFACT_FORMAT,
    CompiledKernel,
    CompileFailure,
    pack,
    unpack,
)
from flashtune.toolchain.cuda import CUDA_HEADERS, INSTALL_HINT, Toolchain, find_toolchain
from flashtune.toolchain.processes import compile_process_pool
from flashtune.toolchain.resources import Resources, parse_ptxas_log

__all__ = [
    "CompiledKernel",
    "CompileFailure",
    "CompileResult",
    "Resources",
    "compile_source",
    "compile_many",
    "compile_pairs",
    "compile_key",
    "nvrtc_options",
    "clear_memo",
]

#: Options the compiler adds after the source's own options and the arch.
COMPILER_OPTIONS: tuple[str, ...] = ("--ptxas-options=-v",)
CACHE_NAMESPACE = "cubin"
FAILED_NAMESPACE = "failed"
MEMO_SIZE = 512

_ANGLE_INCLUDE = re.compile(r"^\s*#\s*include\s*<([^>]+)>", re.MULTILINE)


class _BuildFailed(Exception):
    def __init__(self, failure: CompileFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class _Memo:
    """A small thread-safe LRU of CompiledKernel by compile key (PTX stripped)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[str, CompiledKernel] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> CompiledKernel | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, kernel: CompiledKernel) -> None:
        with self._lock:
            self._items[kernel.compile_key] = (kernel if kernel.ptx is None
                                               else replace(kernel, ptx=None))
            self._items.move_to_end(kernel.compile_key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


_memo = _Memo(MEMO_SIZE)


def clear_memo() -> None:
    """Forget in-process results (the disk cache is untouched)."""
    _memo.clear()


def _key_options(source: KernelSource, spec: ArchSpec) -> tuple[str, ...]:
    return (*source.options, f"--gpu-architecture={spec.name}", *COMPILER_OPTIONS)


def nvrtc_options(source: KernelSource, arch: str, toolchain: Toolchain) -> tuple[str, ...]:
    """The final NVRTC option list for ``source`` on ``arch``.

    flashtune's own headers are handed to NVRTC in memory (exactly the contents covered by
    ``source.digest``); only the CUDA include directory is passed as a path.
    """
    return (*_key_options(source, get_arch(arch)), f"-I{toolchain.include_dir}")


_toolkit_headers_memo: dict[tuple[str, Path], tuple[str, ...]] = {}


def toolkit_headers(source: KernelSource, toolchain: Toolchain) -> tuple[str, ...]:
    """Toolkit headers whose contents go into the compile key: CUDA_HEADERS plus every
    ``#include <...>`` of the source or its headers that resolves in the include dir.

    Memoised by the source digest, which covers the code and headers scanned here.
    """
    memo_key = (source.digest, toolchain.include_dir)
    found = _toolkit_headers_memo.get(memo_key)
    if found is None:
        names = set(CUDA_HEADERS)
        for text in (source.code, *source.headers.values()):
            for name in _ANGLE_INCLUDE.findall(text):
                if (toolchain.include_dir / name).is_file():
                    names.add(name)
        found = _toolkit_headers_memo[memo_key] = tuple(sorted(names))
    return found


def compile_key(source: KernelSource, arch: str, toolchain: Toolchain | None = None) -> str:
    """sha256 hex digest naming the binary that compiling ``source`` for ``arch`` yields.

    The include directory enters through the contents of the headers used, not its path,
    so moving an environment keeps its cache valid.
    """
    spec = compile_target(source.target, arch)
    tc = toolchain if toolchain is not None else find_toolchain()
    lib = nvrtc.load(tc.nvrtc_path)
    major, minor = lib.version
    h = hashlib.sha256()
    parts = (
        f"flashtune compile key v{ARTIFACT_FORMAT}",
        source.digest,
        spec.name,
        f"nvrtc {major}.{minor}",
        tc.nvrtc_fingerprint,
        tc.header_digest(toolkit_headers(source, tc)),
        *_key_options(source, spec),
    )
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def artifact_name(source: KernelSource, arch: str, key: str) -> str:
    """Cache file stem: key prefix first (spreads the shard dirs), then readable names."""
    return f"{key[:24]}_{get_arch(arch).name}_{source.entry}"


def check_arch_supported(lib: nvrtc.Nvrtc, spec: ArchSpec) -> None:
    """Raise ToolchainNotFound when this NVRTC cannot emit code for ``spec``."""
    number = spec.major * 10 + spec.minor
    if number not in lib.supported_archs:
        major, minor = lib.version
        raise ToolchainNotFound(
            f"NVRTC {major}.{minor} ({lib.path}) cannot compile for {spec.name}; it supports "
            f"{[f'sm_{a}' for a in lib.supported_archs]}. Install a newer NVRTC: {INSTALL_HINT}"
        )


def _run_nvrtc(lib: nvrtc.Nvrtc, source: KernelSource, options: Iterable[str]
               ) -> nvrtc.NvrtcResult:
    """The one place NVRTC is invoked (tests count calls here)."""
    return lib.compile(source.code, f"{source.entry}.cu", source.headers, tuple(options))


def _save_failure(cache: ArtifactCache, source: KernelSource, arch: str,
                  options: tuple[str, ...], nvrtc_log: str) -> Path:
    """Save the failing source with its flashtune headers (so it compiles by hand with
    ``-I<dir>`` plus the options) and NVRTC's log; return the source's path."""
    files = {f"{source.entry}.cu": source.code.encode()}
    files.update({name: text.encode() for name, text in source.headers.items()
                  if "/" not in name})
    files["nvrtc.log"] = ("options: " + " ".join(options) + "\n\n" + nvrtc_log).encode()
    folder = cache.put_files(FAILED_NAMESPACE, f"{source.entry}.{arch}.{source.digest[:12]}",
                             files)
    return folder / f"{source.entry}.cu"


def compile_or_fail(
    source: KernelSource,
    arch: str,
    *,
    ptx: bool = False,
    cache: ArtifactCache | None = None,
    toolchain: Toolchain | None = None,
) -> CompiledKernel | CompileFailure:
    """compile_source, returning a compilation failure as data instead of raising it.

    Errors that are not about this source (unknown arch, missing toolchain) still raise.
    A source with an arch-specific ``target`` is built for that target (codegen.arch.
    compile_target; InvalidConfig when ``arch`` cannot run it).
    """
    spec = compile_target(source.target, arch)
    tc = toolchain if toolchain is not None else find_toolchain()
    lib = nvrtc.load(tc.nvrtc_path)
    check_arch_supported(lib, spec)
    key = compile_key(source, spec.name, tc)
    if not ptx and (hit := _memo.get(key)) is not None:
        return hit
    store = cache if cache is not None else ArtifactCache()
    name = artifact_name(source, spec.name, key)
    options = nvrtc_options(source, spec.name, tc)

    def build(tmp_path: Path) -> None:
        result = _run_nvrtc(lib, source, options)
        if not result.ok:
            saved = _save_failure(store, source, spec.name, options, result.log)
            raise _BuildFailed(CompileFailure(
                f"NVRTC could not compile {source.entry} for {spec.name} ({result.status})",
                result.log, str(saved)))
        try:
            resources = parse_ptxas_log(result.log, source.entry,
                                        dynamic_smem=source.smem_bytes,
                                        max_threads=source.threads)
        except ValueError as exc:
            raise _BuildFailed(CompileFailure(str(exc), result.log, None)) from exc
        kernel = CompiledKernel(
            entry=source.entry, arch=spec.name, compile_key=key, source_digest=source.digest,
            resources=resources, nvrtc_version=lib.version, options=options,
            cubin=result.cubin, log=result.log,
        )
        tmp_path.write_bytes(pack(kernel, result.ptx))

    for _attempt in range(2):
        data = store.load_bytes(CACHE_NAMESPACE, name, ".zip")
        if data is None:
            try:
                store.get_or_build(CACHE_NAMESPACE, name, ".zip", build)
            except _BuildFailed as failed:
                return failed.failure
            data = store.load_bytes(CACHE_NAMESPACE, name, ".zip")
        kernel = unpack(data, key, want_ptx=ptx) if data is not None else None
        if kernel is not None:
            _memo.put(kernel)
            return kernel
        store.discard(CACHE_NAMESPACE, name, ".zip")
    raise CompileError(f"the cache entry {name} could not be written and read back in "
                       f"{store.root}; check the directory is writable and not full")


def compile_source(
    source: KernelSource,
    arch: str,
    *,
    ptx: bool = False,
    cache: ArtifactCache | None = None,
    toolchain: Toolchain | None = None,
) -> CompiledKernel:
    """Compile ``source`` for ``arch`` (e.g. "sm_90"), from the memo or disk cache if there.

    ``ptx=True`` also returns the PTX text. Raises InvalidConfig for an unknown arch,
    ToolchainNotFound when NVRTC or the headers are missing or NVRTC cannot target the
    arch, and CompileError (with NVRTC's log and the saved source) when compilation fails.
    """
    outcome = compile_or_fail(source, arch, ptx=ptx, cache=cache, toolchain=toolchain)
    if isinstance(outcome, CompileFailure):
        raise outcome.error()
    return outcome


@dataclass(frozen=True)
class CompileResult:
    """One (source, arch) pair of compile_many: the kernel, or why it failed."""

    source: KernelSource = field(repr=False)
    arch: str
    kernel: CompiledKernel | None
    failure: CompileFailure | None

    @property
    def ok(self) -> bool:
        return self.kernel is not None

    def unwrap(self) -> CompiledKernel:
        """The kernel, or the CompileError of the failure."""
        if self.kernel is None:
            assert self.failure is not None
            raise self.failure.error()
        return self.kernel


def _compile_in_worker(source: KernelSource, arch: str, cache_base: str
                       ) -> CompiledKernel | CompileFailure:
    return compile_or_fail(source, arch, cache=ArtifactCache(Path(cache_base)))


def _from_cache(source: KernelSource, spec: ArchSpec, cache: ArtifactCache, tc: Toolchain
                ) -> CompiledKernel | None:
    key = compile_key(source, spec.name, tc)
    hit = _memo.get(key)
    if hit is not None:
        return hit
    data = cache.load_bytes(CACHE_NAMESPACE, artifact_name(source, spec.name, key), ".zip")
    kernel = unpack(data, key, want_ptx=False) if data is not None else None
    if kernel is not None:
        _memo.put(kernel)
    return kernel


def compile_pairs(
    pairs: Sequence[tuple[KernelSource, str]],
    workers: int | None = None,
    *,
    cache: ArtifactCache | None = None,
    progress: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[CompileResult]:
    """Compile every (source, arch) pair, in a process pool of ``workers`` processes.

    Pairs found in the memo or disk cache are served without compiling. Results come back
    in the order of ``pairs``; a compilation failure is a result (``ok`` False), not an
    exception. An unknown arch or a missing toolchain raises before anything is compiled.
    ``progress`` shows a rich progress bar with the time remaining (default: when stderr
    is a terminal). ``on_progress(done, to_compile)`` is called once the cache has been
    consulted (``done`` 0: what is left to compile) and after each compilation.
    """
    n_workers = settings.COMPILE_WORKERS.get() if workers is None else workers
    if n_workers < 1:
        raise ValueError(f"workers={n_workers} must be >= 1")
    store = cache if cache is not None else ArtifactCache()
    tc = find_toolchain()
    lib = nvrtc.load(tc.nvrtc_path)
    specs = [compile_target(source.target, arch) for source, arch in pairs]
    for spec in set(specs):
        check_arch_supported(lib, spec)
    results: list[CompileResult | None] = [None] * len(pairs)
    pending: list[int] = []
    for i, ((source, _), spec) in enumerate(zip(pairs, specs, strict=True)):
        hit = _from_cache(source, spec, store, tc)
        if hit is not None:
            results[i] = CompileResult(source, spec.name, hit, None)
        else:
            pending.append(i)

    def record(i: int, outcome: CompiledKernel | CompileFailure) -> None:
        source, spec = pairs[i][0], specs[i]
        if isinstance(outcome, CompileFailure):
            results[i] = CompileResult(source, spec.name, None, outcome)
        else:
            _memo.put(outcome)
            results[i] = CompileResult(source, spec.name, outcome, None)

    show = sys.stderr.isatty() if progress is None else progress
    done = 0

    def advance() -> None:
        nonlocal done
        done += 1
        bar.advance(task)
        if on_progress is not None:
            on_progress(done, len(pending))

    if on_progress is not None:
        on_progress(0, len(pending))
    with Progress(
        TextColumn("compiling kernels"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
        console=Console(stderr=True), transient=True, disable=not show,
    ) as bar:
        task = bar.add_task("compile", total=len(pending))
        if n_workers == 1 or len(pending) <= 1:
            for i in pending:
                record(i, compile_or_fail(pairs[i][0], specs[i].name, cache=store,
                                          toolchain=tc))
                advance()
        else:
            pool = compile_process_pool(min(n_workers, len(pending)))
            try:
                futures = {
                    pool.submit(_compile_in_worker, pairs[i][0], specs[i].name,
                                str(store.base)): i
                    for i in pending
                }
                for future in as_completed(futures):
                    record(futures[future], future.result())
                    advance()
            finally:  # on Ctrl-C (or an error) only the compiles under way finish
                pool.shutdown(wait=False, cancel_futures=True)
    return [r for r in results if r is not None]


def compile_many(
    sources: Sequence[KernelSource],
    archs: Sequence[str],
    workers: int | None = None,
    *,
    cache: ArtifactCache | None = None,
    progress: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[CompileResult]:
    """Compile every source for every arch (source-major order); see compile_pairs."""
    return compile_pairs([(s, a) for s in sources for a in archs], workers, cache=cache,
                         progress=progress)
