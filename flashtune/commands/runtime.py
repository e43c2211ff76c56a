"""``flashtune explain`` (which config the runtime would run, and why) and ``flashtune
precompile`` (fill a read-only directory of kernels that serves without NVRTC)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flashtune import settings
from flashtune.api.limits import check_seqlens
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import COMPILED_HEAD_DIMS, DType, Problem, seq_bucket
from flashtune.commands.options import DEFAULT_DTYPE, DbOpt, DTypeOpt, fail
from flashtune.db.records import BestEntry, printable
from flashtune.errors import FlashtuneError

if TYPE_CHECKING:  # the dispatcher and the families import torch: loaded when a command runs
    from flashtune.runtime.dispatch import DeviceLike, Dispatcher

DEFAULT_ARCH = "sm_90"

ArchOpt = Annotated[str | None, typer.Option(
    "--arch", help="GPU arch (sm_80 ... sm_120); default: the current GPU's, else sm_90.")]
DeviceOpt = Annotated[str | None, typer.Option(
    "--device", help="GPU name as stored in the tuning database, e.g. 'NVIDIA H100 80GB "
                     "HBM3' (its arch comes from the database unless --arch is given).")]


@dataclass(frozen=True)
class _Entries:
    entries: tuple[BestEntry, ...]

    def all_best(self) -> tuple[BestEntry, ...]:
        return self.entries


def _dispatcher(db: str | None) -> Dispatcher:
    """The runtime's dispatcher, or one over ``db`` (read now, so a bad --db fails here
    instead of silently falling back to the defaults)."""
    from flashtune.runtime.dispatch import Dispatcher

    if db is None:
        return Dispatcher()
    from flashtune.db.store import TuningStore

    with TuningStore(db, create=False) as store:
        source = _Entries(tuple(store.all_best()))
    return Dispatcher(lambda: source)


def _device_arch_from_db(name: str, db: str | None) -> str:
    from flashtune.db.store import TuningStore

    with TuningStore(db, create=False) as store:
        record = store.device(name)
    if record is None:
        raise FlashtuneError(f"device {name!r} is not in the tuning database; give its arch "
                             "with --arch (e.g. --arch sm_90) or check the name with "
                             "`flashtune db list`")
    return record.arch


def resolve_device(arch: str | None, device: str | None, db: str | None) -> DeviceLike:
    """The device a question is about: a named GPU, a virtual GPU of an arch, or this GPU."""
    from flashtune.runtime.device import DeviceInfo
    from flashtune.runtime.dispatch import NamedDevice

    if device is not None:
        found = get_arch(arch).name if arch else _device_arch_from_db(device, db)
        return NamedDevice(device, found)
    if arch is not None:
        return DeviceInfo.virtual(arch)
    import torch

    if torch.cuda.is_available():
        return DeviceInfo.current()
    return DeviceInfo.virtual(DEFAULT_ARCH)


def explain_command(
    head_dim: Annotated[int, typer.Option("--head-dim", help="Head dimension.")],
    seqlen: Annotated[int, typer.Option("--seqlen", help="Query sequence length.")],
    seqlen_k: Annotated[int | None, typer.Option(
        "--seqlen-k", help="Key sequence length (default: --seqlen).")] = None,
    dtype: DTypeOpt = DEFAULT_DTYPE,
    causal: Annotated[bool, typer.Option("--causal/--no-causal")] = False,
    op: Annotated[str, typer.Option(
        "--op", help="Kernel family (`flashtune families` lists them).")] = "fwd",
    arch: ArchOpt = None,
    device: DeviceOpt = None,
    db: DbOpt = None,
) -> None:
    """Print which config attention would run for a problem on a GPU, and which tier of the
    lookup (exact, nearest, same_arch, default) answered. Nothing is compiled or tuned."""
    from flashtune import families
    from flashtune.runtime.installed import serving_state

    try:
        problem = Problem(head_dim=head_dim, dtype=dtype, causal=causal, op=op)
        families.get(op)
        check_seqlens(seqlen, seqlen if seqlen_k is None else seqlen_k)
        bucket = problem.bucket(seqlen, seqlen if seqlen_k is None else seqlen_k)
        target = resolve_device(arch, device, db)
        decision = _dispatcher(db).decide(bucket, target)
        # the family that serves the call (an sm_90a one on a cc 9.0 GPU), as attention runs it
        source = families.render(decision.problem, decision.config)
    except FlashtuneError as exc:
        raise fail(str(exc)) from exc
    from flashtune.runtime.precompile import load_shipped

    try:
        shipped = load_shipped(source, decision.arch) is not None
        dirs = ", ".join(map(str, settings.PRECOMPILED_DIRS.get()))
    except FlashtuneError as exc:
        raise fail(str(exc)) from exc
    console = Console(highlight=False, soft_wrap=True)
    console.print(escape(printable(decision.describe())))
    if decision.entry is not None:
        state = serving_state(decision.entry)
        console.print(escape(printable(f"origin:   {decision.entry.origin} ({state})")))
    console.print(f"kernel:   {source.entry} ({source.threads} threads, "
                  f"{source.smem_bytes} B dynamic shared memory)")
    if dirs:
        console.print(f"cache:    precompiled cubin {'present' if shipped else 'absent'} in "
                      f"{escape(dirs)}")
    else:
        console.print("cache:    precompiled cubin absent (FLASHTUNE_PRECOMPILED_DIR is not "
                      "set): compiled with NVRTC on first use")


def _problems(head_dims: list[int] | None, dtypes: list[DType] | None,
              causal: bool | None, backward: bool = False, fp8: bool = False
              ) -> list[Problem]:
    from flashtune.runtime.precompile import BACKWARD_OPS, all_problems

    masks = (False, True) if causal is None else (causal,)
    ops = ("fwd", *(BACKWARD_OPS if backward else ()), *(("fwd8",) if fp8 else ()))
    return all_problems(head_dims or COMPILED_HEAD_DIMS, dtypes or tuple(DType), masks, ops)


def precompile_command(
    arch: Annotated[str, typer.Option("--arch", help="Arch to compile for, e.g. sm_90.")],
    head_dim: Annotated[list[int] | None, typer.Option(
        "--head-dim", help="Head dim (repeatable; default with --all-defaults: "
                           f"{', '.join(map(str, COMPILED_HEAD_DIMS))}).")] = None,
    dtype: Annotated[list[DType] | None, typer.Option(
        "--dtype", case_sensitive=False, help="Element type (repeatable; default both).")
    ] = None,
    causal: Annotated[bool | None, typer.Option(
        "--causal/--no-causal", help="Only causal / only full attention (default both).")
    ] = None,
    seqlen: Annotated[list[int] | None, typer.Option(
        "--seqlen", help="Sequence length to plan for (repeatable; default every bucket).")
    ] = None,
    all_defaults: Annotated[bool, typer.Option(
        "--all-defaults", help="Compile the built-in default config of every selected "
                               "problem instead of asking the dispatcher.")] = False,
    backward: Annotated[bool, typer.Option(
        "--backward/--no-backward", help="Also the backward pass's kernels (bwd, bwddet, "
                                         "bwdpre, bwdsum) of the selected problems.")
    ] = False,
    fp8: Annotated[bool, typer.Option(
        "--fp8/--no-fp8", help="Also the FP8 forward's kernels (e4m3 and e5m2 inputs with "
                               "--dtype as O's type; sm_89 and later).")] = False,
    device: DeviceOpt = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "--cache-dir", help="Directory to fill (read-only artifacts and their "
                                     "manifest; serve it with FLASHTUNE_PRECOMPILED_DIR).")
    ] = None,
    db: DbOpt = None,
) -> None:
    """Compile kernels for an arch into a directory that the runtime then serves without
    NVRTC (ship it with an application and point FLASHTUNE_PRECOMPILED_DIR at it).

    Without --all-defaults, the kernels are the ones the runtime would choose on the arch
    (or the named --device) for the selected problems and sequence lengths: tuned results
    of the device or its arch family, else the defaults.
    """
    from flashtune.runtime.precompile import (
        ALL_BUCKETS,
        default_kernels,
        planned_kernels,
        precompile,
    )

    if head_dim is None and not all_defaults:
        raise fail("nothing to compile: give --head-dim (repeatable) or --all-defaults")
    if out is None:
        raise fail("no output directory: give --out DIR (the directory to ship)")
    try:
        spec = get_arch(arch)
        problems = _problems(head_dim, dtype, causal, backward, fp8)
        if all_defaults:
            kernels = default_kernels(spec.name, problems)
        else:
            target = resolve_device(spec.name, device, db)
            for n in seqlen or ():
                check_seqlens(n, n)
            buckets = sorted({seq_bucket(n) for n in seqlen}) if seqlen else ALL_BUCKETS
            kernels = planned_kernels(target, problems, buckets, dispatcher=_dispatcher(db))
        done = precompile(kernels, spec.name, out, progress=None)
    except FlashtuneError as exc:
        raise fail(str(exc)) from exc
    table = Table("kernel", "registers", "spill bytes", title=f"precompiled for {spec.name}")
    for item in done:
        table.add_row(item.entry, str(item.registers), str(item.spill_bytes))
    console = Console(highlight=False, soft_wrap=True)
    console.print(table)
    root = out.expanduser().absolute()
    console.print(f"{len(done)} kernel(s) in {escape(str(root))}; serve them with "
                  f"FLASHTUNE_PRECOMPILED_DIR={escape(str(root))}")
