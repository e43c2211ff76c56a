"""What the commands share: the problem and config options, --db, and the error printer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from flashtune.codegen.dtypes import Dtypes, Fp8Type
from flashtune.codegen.spec import DType

if TYPE_CHECKING:
    from flashtune.families.base import KernelFamily

OpOpt = Annotated[str, typer.Option(
    "--op", help="Kernel family (`flashtune families` lists them).")]
HeadDim = Annotated[int | None, typer.Option(
    "--head-dim", help="Head dimension (multiple of 8, <= 256); default 128, 64 for --op mla "
                       "(the RoPE part of its 576-wide latent).", show_default=False)]
HeadDimV = Annotated[int | None, typer.Option(
    "--head-dim-v", help="V's head dimension where it differs from --head-dim (multiple of 8, "
    "<= 256; the mma.sync forward and backward), e.g. 128 with --head-dim 192.")]
#: The element type every command defaults to. fp16: every arch flashtune compiles for has
#: its tensor-core MMA, and its 10 mantissa bits make a check's tolerance the stricter one;
#: bf16 is one option away (--dtype bf16), as in the README's examples.
DEFAULT_DTYPE = DType.FP16
DTypeOpt = Annotated[DType, typer.Option("--dtype", case_sensitive=False,
                                         help="Element type of q, k, v.")]
InputDTypeOpt = Annotated[str | None, typer.Option(
    "--input-dtype", metavar="TYPE",
    help="Q, K and V's type for a family whose inputs differ from O's (--op fwd8: e4m3, "
         "the default, or e5m2; --op mla: e4m3, the FP8 latent cache beside bf16 Q and O); "
         "--dtype is then O's type.")]
Causal = Annotated[bool, typer.Option("--causal/--no-causal", help="Causal masking.")]
ConfigKey = Annotated[str | None, typer.Option(
    "--config", help="Config key, e.g. m128_n64_w4_s2 (fields below override it).")]
BlockM = Annotated[int | None, typer.Option("--block-m", help="Query rows per block (B_r).")]
BlockN = Annotated[int | None, typer.Option("--block-n", help="Key rows per tile (B_c).")]
Warps = Annotated[int | None, typer.Option("--warps", help="Warps per block.")]
Stages = Annotated[int | None, typer.Option("--stages", help="K/V pipeline stages.")]
FixOpt = Annotated[list[str] | None, typer.Option(
    "--fix", metavar="NAME=VALUE",
    help="Hold a knob of the family's space at one value, repeatable (e.g. --fix "
         "pingpong=1); `flashtune space --op OP` names the knobs.")]
DbOpt = Annotated[str | None, typer.Option(
    "--db", metavar="URL",
    help="Tuning database URL or SQLite file path (default: FLASHTUNE_DB, else the user data "
         "dir).")]


def problem_dtypes(family: KernelFamily, dtype: DType, input_dtype: str | None = None
                   ) -> dict[str, str]:
    """The Problem fields (dtype, kv_dtype, o_dtype) of ``--dtype`` and ``--input-dtype``
    for ``family``: ``dtype`` is every operand's type, or O's for a family whose inputs have
    another type (the FP8 forward: ``--op fwd8 --dtype bf16`` is e4m3 Q, K, V with a bf16
    O, ``--input-dtype e5m2`` makes them e5m2; for a family whose Q is O's type, the type
    names the K/V cache's: ``--op mla --dtype bf16 --input-dtype e4m3``). BadParameter
    naming the family's choices for a pair it does not take."""
    if input_dtype is None or input_dtype.lower() == dtype.value:
        if Dtypes.same(dtype) in family.dtypes or input_dtype is not None:
            return {"dtype": dtype.value}
        # Inputs of another type than O's (FP8): the first declared (e4m3, FA3's).
        order = list(Fp8Type)
        mixed = sorted((d for d in family.dtypes if d.o is dtype and not d.uniform),
                       key=lambda d: order.index(d.q) if isinstance(d.q, Fp8Type) else -1)
        if not mixed:
            return {"dtype": dtype.value}
        input_dtype = str(mixed[0].q.value)
    for d in family.dtypes:
        if d.o is dtype and input_dtype.lower() in (str(d.q.value), str(d.kv.value)):
            return {"dtype": d.q.value, "kv_dtype": d.kv.value, "o_dtype": d.o.value}
    taken = sorted({str(d.kv.value) for d in family.dtypes if d.o is dtype})
    raise typer.BadParameter(
        f"{input_dtype!r} with O in {dtype.value}: the {family.op!r} family takes "
        f"{', '.join(taken) or 'no inputs with that O type'}", param_hint="--input-dtype")


def fail(message: object) -> typer.Exit:
    """Print ``message`` as an error on stderr (markup and control characters escaped);
    the caller raises the returned Exit(1)."""
    Console(stderr=True).print(f"[bold red]error:[/] {escape(str(message))}", highlight=False)
    return typer.Exit(1)
