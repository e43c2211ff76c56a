"""Precompiled kernels: a directory an application can ship, served without NVRTC.

``precompile`` compiles kernels for an arch and writes each cubin to ``<dir>/kernels/``
under a name derived from the kernel source's digest and the arch alone (nothing about the
compiling machine's toolchain), plus ``<dir>/MANIFEST_NAME``, the manifest of every
artifact's sha256. The CUDA backend looks in the directories of the setting
FLASHTUNE_PRECOMPILED_DIR first (``load_shipped``), so a machine with only such a
directory, CuPy and a driver loads these kernels without NVRTC or the CUDA headers.

Security model of a shipped directory: it is read-only (artifacts and manifest are written
0444, directories 0755) and readable by every user, so it may belong to another user (the
one who installed the application); it must not be writable by anyone but its owner, and
its parents must let no one else replace it (owned by root, you or its owner, and not
writable by every user without the sticky bit: ``runtime.ownership``, the cache's check).
flashtune never writes there at run time. Each artifact is verified against the manifest
before it is used: an artifact that differs from its manifest digest, or one listed but
missing, is a ``CacheError`` naming the file and the fix (restore the directory) -- never a
silent rebuild over a shipped file. Kernels the manifest does not list are compiled into
the private cache as usual.

Which kernels: ``planned_kernels`` asks the dispatcher, for an arch (or a named GPU) and the
problems and sequence buckets given, exactly what the runtime would choose there;
``default_kernels`` lists the default config of every compiled head dim, dtype and mask.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import os
import stat
import tempfile
import threading
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashtune import families, settings
from flashtune._version import __version__
from flashtune.codegen.arch import compile_target, device_arch, get_arch
from flashtune.codegen.dtypes import Dtypes
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
from flashtune.errors import CacheError, CompileError, InvalidProblem
from flashtune.families import render
from flashtune.runtime.dispatch import (
    DeviceLike,
    Dispatcher,
    NamedDevice,
    default_config,
    get_dispatcher,
)
from flashtune.toolchain.cache import write_error
from flashtune.toolchain.ownership import describe_owner, unsafe_ancestor

#: Bump when the stored layout changes.
FORMAT = 2
MANIFEST_NAME = "flashtune-precompiled.json"
MANIFEST_FORMAT = "flashtune-precompiled"
KERNELS_DIR = "kernels"
#: Every sequence bucket the dispatcher can be asked about.
ALL_BUCKETS: tuple[int, ...] = tuple(
    1 << e for e in range(MIN_SEQ_BUCKET.bit_length() - 1, MAX_SEQ_BUCKET.bit_length())
)
#: A manifest larger than this is refused before parsing.
MAX_MANIFEST_BYTES = 16 * 1024 * 1024

log = logging.getLogger("flashtune.precompile")


def artifact_name(source: KernelSource, arch: str) -> str:
    """File stem of a shipped cubin: source digest prefix, the arch it is built for (an
    arch-specific source's own target, e.g. sm_90a) and entry (readable)."""
    return f"{source.digest[:32]}_{compile_target(source.target, arch).name}_{source.entry}"


def _relative(source: KernelSource, arch: str) -> str:
    return f"{KERNELS_DIR}/{artifact_name(source, arch)}.zip"


def _pack(source: KernelSource, arch: str, cubin: bytes) -> bytes:
    meta = {"format": FORMAT, "source_digest": source.digest, "arch": arch,
            "entry": source.entry, "flashtune_version": __version__}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("meta.json", json.dumps(meta, sort_keys=True))
        zf.writestr("kernel.cubin", cubin)
    return buf.getvalue()


def _unpack(data: bytes, source: KernelSource, arch: str, where: Path) -> bytes:
    """The cubin in a verified artifact; CacheError if it describes another kernel."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            meta = json.loads(zf.read("meta.json"))
            if (isinstance(meta, dict) and meta.get("format") == FORMAT
                    and meta.get("source_digest") == source.digest
                    and meta.get("arch") == arch and meta.get("entry") == source.entry):
                return zf.read("kernel.cubin")
            shown = ({k: meta.get(k) for k in ("format", "arch", "entry")}
                     if isinstance(meta, dict) else meta)
            problem = f"describes another kernel ({shown})"
    except (zipfile.BadZipFile, KeyError, ValueError) as exc:
        problem = f"is unreadable ({exc})"
    raise CacheError(f"the precompiled artifact {where} {problem} although its manifest digest "
                     "matches; the directory was written by another tool. Rebuild it with "
                     "`flashtune precompile`")


# ------------------------------------------------------------------ the manifest


@dataclass(frozen=True)
class _Manifest:
    directory: Path
    digests: Mapping[str, str]


_manifests: dict[tuple[str, int, int, int], _Manifest] = {}
_manifests_lock = threading.Lock()


def _check_shipped(path: Path, st: os.stat_result, what: str) -> None:
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(
            f"the precompiled {what} {path} is writable by other users ({describe_owner(st)}); "
            "flashtune loads native code from it and refuses it. Fix: chmod go-w it (a "
            "shipped directory is read-only and writable by its owner at most)")


def _check_shipped_ancestors(directory: Path, st_dir: os.stat_result) -> None:
    """The parents of a shipped directory must not let anyone but root, you or the
    directory's own owner (who installed it) replace it with their own cubins."""
    found = unsafe_ancestor(directory.resolve(), (0, os.geteuid(), st_dir.st_uid))
    if found is not None:
        parent, why = found
        raise CacheError(
            f"the precompiled directory {directory} (FLASHTUNE_PRECOMPILED_DIR) is refused: "
            f"its parent directory {parent} {why}, so another user could replace the "
            "directory and its manifest and make flashtune run their code. Fix: install it "
            "under a directory only its owner can write (or chmod o-w / chmod +t "
            f"{parent}), and point FLASHTUNE_PRECOMPILED_DIR there")


def _read_regular(path: Path, what: str) -> tuple[bytes, os.stat_result]:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CacheError(f"cannot read the precompiled {what} {path}: "
                         f"{exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CacheError(f"the precompiled {what} {path} is not a regular file")
        _check_shipped(path, st, what)
        if what == "manifest" and st.st_size > MAX_MANIFEST_BYTES:
            raise CacheError(f"the precompiled manifest {path} is larger than "
                             f"{MAX_MANIFEST_BYTES} bytes; it is not a flashtune manifest")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read(), st
    finally:
        os.close(fd)


def _parse_manifest(raw: bytes, where: Path) -> dict[str, str]:
    try:
        data: Any = json.loads(raw.decode("utf-8"))
        if data.get("format") != MANIFEST_FORMAT or data.get("version") != FORMAT:
            raise ValueError(f"format {data.get('format')!r} version {data.get('version')!r}, "
                             f"expected {MANIFEST_FORMAT!r} version {FORMAT}")
        artifacts = data["artifacts"]
        digests: dict[str, str] = {}
        for name, entry in artifacts.items():
            digest = entry["sha256"]
            if (not isinstance(name, str) or not name.startswith(KERNELS_DIR + "/")
                    or "/" in name[len(KERNELS_DIR) + 1:] or ".." in name
                    or not isinstance(digest, str) or len(digest) != 64):
                raise ValueError(f"entry {name!r} is malformed")
            digests[name] = digest
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CacheError(f"the precompiled manifest {where} is damaged ({exc}); restore the "
                         "directory or rebuild it with `flashtune precompile`") from None
    return digests


def _manifest(directory: Path) -> _Manifest:
    """The verified manifest of a shipped directory (memoised while it is unchanged)."""
    path = directory / MANIFEST_NAME
    try:
        st_dir = os.stat(directory)
    except OSError as exc:
        raise CacheError(f"the precompiled directory {directory} cannot be read "
                         f"({exc.strerror or exc}); fix FLASHTUNE_PRECOMPILED_DIR") from None
    _check_shipped(directory, st_dir, "directory")
    _check_shipped_ancestors(directory, st_dir)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CacheError(f"{directory} (FLASHTUNE_PRECOMPILED_DIR) has no {MANIFEST_NAME}; "
                         "it was not written by `flashtune precompile`") from None
    _check_shipped(path, st, "manifest")
    memo_key = (str(path), st.st_ino, st.st_mtime_ns, st.st_size)
    found = _manifests.get(memo_key)
    if found is None:
        raw, _ = _read_regular(path, "manifest")
        found = _Manifest(directory, _parse_manifest(raw, path))
        with _manifests_lock:
            _manifests[memo_key] = found
    kernels = directory / KERNELS_DIR
    if kernels.exists():
        _check_shipped(kernels, os.stat(kernels), "directory")
    return found


def load_shipped(source: KernelSource, arch: str,
                 directories: Iterable[Path] | None = None) -> bytes | None:
    """The precompiled cubin of ``source`` for ``arch`` from the shipped directories (default:
    the setting FLASHTUNE_PRECOMPILED_DIR), or None if none of them lists it.

    Raises CacheError when a directory is writable by other users, its manifest is damaged,
    or the listed artifact is missing or differs from its manifest digest.
    """
    spec = compile_target(source.target, arch)
    rel = _relative(source, spec.name)
    for directory in (settings.PRECOMPILED_DIRS.get() if directories is None else directories):
        manifest = _manifest(Path(directory))
        if rel not in manifest.digests:
            continue
        path = Path(directory) / rel
        try:
            data, _ = _read_regular(path, "artifact")
        except FileNotFoundError:
            raise CacheError(f"the precompiled artifact {path} is listed in the manifest but "
                             "missing; restore the directory from the application's package "
                             "(flashtune never rebuilds a shipped file)") from None
        if hashlib.sha256(data).hexdigest() != manifest.digests[rel]:
            raise CacheError(
                f"the precompiled artifact {path} does not match the digest in "
                f"{Path(directory) / MANIFEST_NAME}: it was changed after `flashtune "
                "precompile`. Restore the directory from the application's package (flashtune "
                "never rebuilds over a shipped file)")
        return _unpack(data, source, spec.name, path)
    return None


# ------------------------------------------------------------------ writing


def _write_readonly(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, read-only for everyone (0444)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o444)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _existing_digests(out: Path) -> dict[str, str]:
    """The manifest entries of ``out`` whose files still match (kept by a new precompile)."""
    path = out / MANIFEST_NAME
    if not path.is_file():
        return {}
    try:
        digests = _parse_manifest(path.read_bytes(), path)
    except CacheError:
        return {}
    kept = {}
    for name, digest in digests.items():
        try:
            if hashlib.sha256((out / name).read_bytes()).hexdigest() == digest:
                kept[name] = digest
        except OSError:
            continue
    return kept


def write_manifest(out: Path, digests: Mapping[str, str]) -> Path:
    """Write the manifest of ``out`` listing ``digests`` (relative path -> sha256)."""
    body = {"format": MANIFEST_FORMAT, "version": FORMAT, "flashtune_version": __version__,
            "artifacts": {name: {"sha256": digest} for name, digest in sorted(digests.items())}}
    path = out / MANIFEST_NAME
    _write_readonly(path, (json.dumps(body, indent=1, sort_keys=True) + "\n").encode())
    return path


@dataclass(frozen=True)
class Precompiled:
    """One kernel written to a shipped directory."""

    problem: Problem
    config: KernelConfig
    arch: str
    entry: str
    path: Path
    registers: int
    spill_bytes: int


def precompile(kernels: Iterable[tuple[Problem, KernelConfig]], arch: str, out: Path, *,
               workers: int | None = None, progress: bool | None = False
               ) -> list[Precompiled]:
    """Compile each (problem, config) for a device of ``arch`` into the shipped directory
    ``out``: an arch-specific kernel for its own target (sm_90a), any other for the device's
    arch (sm_90 when ``arch`` is sm_90a), the names a device of that arch loads.

    This is the build step, so it needs NVRTC: kernels are compiled in parallel
    (``workers`` processes, default FLASHTUNE_COMPILE_WORKERS) through the compiler, which
    keeps its own artifacts in the private cache, so ``out`` holds only what is shipped:
    ``kernels/*.zip`` and the manifest, read-only (0444) in directories of mode 0755.
    Kernels already in ``out`` are kept. Raises ToolchainNotFound without NVRTC, CacheError
    when ``out`` cannot be written, and CompileError naming every kernel that failed (the
    others are stored first).
    """
    from flashtune.toolchain.compiler import compile_many

    spec = get_arch(arch)
    chosen: dict[str, tuple[Problem, KernelConfig, KernelSource]] = {}
    for problem, config in kernels:
        source = render(problem, config)
        chosen.setdefault(source.digest, (problem, config, source))
    folder = Path(out).expanduser().absolute()
    try:  # before compiling: a directory that cannot be written fails at once
        (folder / KERNELS_DIR).mkdir(parents=True, exist_ok=True)
        for directory in (folder, folder / KERNELS_DIR):
            os.chmod(directory, 0o755)
    except OSError as exc:
        raise write_error(exc, folder, "the precompiled directory", "--out") from None
    # Built as a device of this compute capability loads them: a portable source for the
    # device's own arch (sm_90 when asked for sm_90a, where a cc 9.0 GPU looks for it), an
    # arch-specific one for its target.
    results = compile_many([source for _, _, source in chosen.values()],
                           [device_arch(spec).name], workers, progress=progress)
    digests = _existing_digests(folder)
    done: list[Precompiled] = []
    failed: list[str] = []
    try:
        for (problem, config, source), result in zip(chosen.values(), results, strict=True):
            if result.kernel is None:
                message = result.failure.message if result.failure else ""
                failed.append(f"{source.entry}: {message}")
                continue
            target = result.kernel.arch  # the source's own arch-specific target, if any
            rel = _relative(source, target)
            data = _pack(source, target, result.kernel.cubin)
            if digests.get(rel) != hashlib.sha256(data).hexdigest():
                _write_readonly(folder / rel, data)
                digests[rel] = hashlib.sha256(data).hexdigest()
            resources = result.kernel.resources
            done.append(Precompiled(problem, config, target, source.entry, folder / rel,
                                    resources.registers, resources.spill_bytes))
            log.info("precompiled %s for %s -> %s", source.entry, spec.name, folder / rel)
        write_manifest(folder, digests)
    except OSError as exc:
        raise write_error(exc, folder, "the precompiled directory", "--out") from None
    if failed:
        raise CompileError(f"{len(failed)} of {len(chosen)} kernels failed to compile for "
                           f"{spec.name} (the other {len(done)} are stored): "
                           + "; ".join(failed))
    return done


#: The kernel families a backward pass runs (``runtime.backward``).
BACKWARD_OPS: tuple[str, ...] = ("bwd", "bwddet", "bwdpre", "bwdsum")


def all_problems(head_dims: Iterable[int] = COMPILED_HEAD_DIMS,
                 dtypes: Iterable[DType] = tuple(DType),
                 causal: Iterable[bool] = (False, True),
                 ops: Iterable[str] = ("fwd",)) -> list[Problem]:
    """Every Problem of the given families (default: the forward), head dims, dtypes and
    masks; a family without a mask (the backward's row kernels) serves a causal call with
    its causal=False problem. ``dtypes`` are O's types: a family whose inputs have other
    types (the FP8 forward, MLA's FP8 cache) gives a problem for each input type it declares
    beside them (and the uniform one where it takes it too)."""
    masks = tuple(causal)
    kinds = tuple(dtypes)
    found: dict[str, Problem] = {}
    for op in ops:
        family = families.get(op)
        for d, t, c in itertools.product(head_dims, kinds, masks):
            # O's type t; a family with inputs of other types (FP8) takes each it declares
            inputs = sorted((x for x in family.dtypes if x.o is t and not x.uniform), key=str)
            # ... and the uniform one where it also takes that (MLA: a 16-bit or FP8 cache)
            uniform = [(t, t)] if not inputs or Dtypes.same(t) in family.dtypes else []
            for q, kv in uniform + [(x.q, x.kv) for x in inputs]:
                for problem in (Problem(head_dim=d, dtype=q, causal=c, op=op, kv_dtype=kv,
                                        o_dtype=t),
                                Problem(head_dim=d, dtype=q, causal=False, op=op,
                                        kv_dtype=kv, o_dtype=t)):
                    try:
                        family.check_problem(problem)
                    except InvalidProblem:
                        continue
                    found.setdefault(problem.key(), problem)
                    break
    return list(found.values())


def default_kernels(arch: str, problems: Iterable[Problem] | None = None
                    ) -> list[tuple[Problem, KernelConfig]]:
    """The built-in default config of each problem (default: every compiled head dim), as
    a virtual device of ``arch`` runs it (sm_90a: the sm_90a family where it serves, and
    the portable kernel a device falls back to if it is refused them: runtime.first_use)."""
    spec = get_arch(arch)
    chosen = all_problems() if problems is None else list(problems)
    kernels = []
    for problem in chosen:
        served = families.served_on_virtual(problem, spec)
        kernels.append((served, default_config(served, spec.name)))
        if served != problem:
            kernels.append((problem, default_config(problem, device_arch(spec).name)))
    return kernels


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
            bucket = ProblemBucket(problem, seqlen)
            decisions = [chooser.decide(bucket, device)]
            if decisions[0].problem != problem:  # the family that serves it there (sm_90a)
                # and the portable kernel the device falls back to (runtime.first_use)
                portable = NamedDevice(device.name, device.arch, arch_specific_kernels=False)
                decisions.append(chooser.decide(bucket, portable))
            for decision in decisions:
                found[(decision.problem.key(), decision.config.key())] = (decision.problem,
                                                                         decision.config)
    return [found[k] for k in sorted(found)]

