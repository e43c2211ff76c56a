"""Precompiled kernels: a cache directory an application can ship, served without NVRTC.

``precompile`` compiles kernels for an arch and stores each cubin in the artifact cache
(namespace ``shipped``) under a name derived from the kernel source's digest and the arch
alone, i.e. nothing about the compiling machine's toolchain. The CUDA backend looks there
first (``load_shipped``), so a machine with only this directory (FLASHTUNE_CACHE_DIR), CuPy
and a driver loads these kernels without NVRTC or the CUDA headers.

Which kernels: ``planned_kernels`` asks the dispatcher, for an arch (or a named GPU) and the
problems and sequence buckets given, exactly what the runtime would choose there;
``default_kernels`` lists the default config of every compiled head dim, dtype and mask.
"""

from __future__ import annotations

import io
import json
import logging
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from flashtune._version import __version__
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import (
    COMPILED_HEAD_DIMS,
    MAX_SEQ_BUCKET,
    MIN_SEQ_BUCKET,
    DType,
    KernelConfig,
    KernelSource,
    Problem,
    ProblemBucket,
)
from flashtune.errors import CompileError
from flashtune.families import render
from flashtune.runtime.cache import ArtifactCache
from flashtune.runtime.dispatch import DeviceLike, Dispatcher, default_config, get_dispatcher

NAMESPACE = "shipped"
#: Bump when the stored layout changes.
FORMAT = 1
#: Every sequence bucket the dispatcher can be asked about.
ALL_BUCKETS: tuple[int, ...] = tuple(
    1 << e for e in range(MIN_SEQ_BUCKET.bit_length() - 1, MAX_SEQ_BUCKET.bit_length())
)

log = logging.getLogger("flashtune.precompile")


def artifact_name(source: KernelSource, arch: str) -> str:
    """File stem of a shipped cubin: source digest prefix, arch and entry (readable)."""
    return f"{source.digest[:32]}_{get_arch(arch).name}_{source.entry}"


def _pack(source: KernelSource, arch: str, cubin: bytes) -> bytes:
    meta = {"format": FORMAT, "source_digest": source.digest, "arch": arch,
            "entry": source.entry, "flashtune_version": __version__}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("meta.json", json.dumps(meta, sort_keys=True))
        zf.writestr("kernel.cubin", cubin)
    return buf.getvalue()


def load_shipped(source: KernelSource, arch: str, cache: ArtifactCache | None = None
                 ) -> bytes | None:
    """The precompiled cubin of ``source`` for ``arch``, or None if there is none (or it is
    damaged or belongs to another source: then it is ignored with a warning)."""
    store = cache if cache is not None else ArtifactCache()
    spec = get_arch(arch)
    name = artifact_name(source, spec.name)
    data = store.load_bytes(NAMESPACE, name, ".zip")
    if data is None:
        return None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            meta = json.loads(zf.read("meta.json"))
            if (meta.get("format") == FORMAT and meta.get("source_digest") == source.digest
                    and meta.get("arch") == spec.name and meta.get("entry") == source.entry):
                return zf.read("kernel.cubin")
            log.warning("precompiled artifact %s describes another kernel (%s); ignoring it",
                        name, {k: meta.get(k) for k in ("format", "arch", "entry")})
    except (zipfile.BadZipFile, KeyError, ValueError) as exc:
        log.warning("precompiled artifact %s is unreadable (%s); ignoring it", name, exc)
    return None


@dataclass(frozen=True)
class Precompiled:
    """One kernel written to the shipped cache."""

    problem: Problem
    config: KernelConfig
    arch: str
    entry: str
    path: Path
    registers: int
    spill_bytes: int


def precompile(kernels: Iterable[tuple[Problem, KernelConfig]], arch: str, *,
               cache: ArtifactCache | None = None, workers: int | None = None,
               progress: bool | None = False) -> list[Precompiled]:
    """Compile each (problem, config) for ``arch`` and store it in ``cache`` (default: the
    FLASHTUNE_CACHE_DIR cache) for NVRTC-free loading.

    This is the build step, so it needs NVRTC: kernels are compiled in parallel
    (``workers`` processes, default FLASHTUNE_COMPILE_WORKERS) through the compiler, which
    keeps its own artifacts in the default cache, so ``cache`` holds only what is shipped.
    Kernels already shipped are kept. Raises ToolchainNotFound without NVRTC and
    CompileError naming every kernel that failed (the others are stored first).
    """
    from flashtune.runtime.compiler import compile_many

    store = cache if cache is not None else ArtifactCache()
    spec = get_arch(arch)
    chosen: dict[str, tuple[Problem, KernelConfig, KernelSource]] = {}
    for problem, config in kernels:
        source = render(problem, config)
        chosen.setdefault(source.digest, (problem, config, source))
    results = compile_many([source for _, _, source in chosen.values()], [spec.name],
                           workers, progress=progress)
    done: list[Precompiled] = []
    failed: list[str] = []
    for (problem, config, source), result in zip(chosen.values(), results, strict=True):
        if result.kernel is None:
            failed.append(f"{source.entry}: {result.failure.message if result.failure else ''}")
            continue
        name = artifact_name(source, spec.name)
        if load_shipped(source, spec.name, store) is None:
            store.discard(NAMESPACE, name, ".zip")  # a damaged or foreign file, if any
            store.put_bytes(NAMESPACE, name, ".zip",
                            _pack(source, spec.name, result.kernel.cubin))
        path = store.path_for(NAMESPACE, name, ".zip")
        resources = result.kernel.resources
        done.append(Precompiled(problem, config, spec.name, source.entry, path,
                                resources.registers, resources.spill_bytes))
        log.info("precompiled %s for %s -> %s", source.entry, spec.name, path)
    if failed:
        raise CompileError(f"{len(failed)} of {len(chosen)} kernels failed to compile for "
                           f"{spec.name} (the other {len(done)} are stored): "
                           + "; ".join(failed))
    return done


def all_problems(head_dims: Iterable[int] = COMPILED_HEAD_DIMS,
                 dtypes: Iterable[DType] = tuple(DType),
                 causal: Iterable[bool] = (False, True)) -> list[Problem]:
    """Every forward Problem of the given head dims, dtypes and masks."""
    masks = tuple(causal)
    kinds = tuple(dtypes)
    return [Problem(head_dim=d, dtype=t, causal=c) for d in head_dims for t in kinds
            for c in masks]


def default_kernels(arch: str, problems: Iterable[Problem] | None = None
                    ) -> list[tuple[Problem, KernelConfig]]:
    """The built-in default config of each problem (default: every compiled head dim)."""
    chosen = all_problems() if problems is None else list(problems)
    return [(p, default_config(p, get_arch(arch).name)) for p in chosen]


def planned_kernels(device: DeviceLike, problems: Iterable[Problem],
                    buckets: Iterable[int] = ALL_BUCKETS, *,
                    dispatcher: Dispatcher | None = None
                    ) -> list[tuple[Problem, KernelConfig]]:
    """What the runtime would run on ``device`` for these problems and sequence buckets
    (tuned results of the device or its arch, else defaults), without duplicates."""
    chooser = dispatcher if dispatcher is not None else get_dispatcher()
    found: dict[tuple[str, str], tuple[Problem, KernelConfig]] = {}
    sizes = tuple(buckets)
    for problem in problems:
        for seqlen in sizes:
            decision = chooser.decide(ProblemBucket(problem, seqlen), device)
            found[(problem.key(), decision.config.key())] = (problem, decision.config)
    return [found[k] for k in sorted(found)]
