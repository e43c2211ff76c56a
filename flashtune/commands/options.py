"""What the commands share: the problem and config options, --db, and the error printer."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from flashtune.codegen.spec import DType

OpOpt = Annotated[str, typer.Option(
    "--op", help="Kernel family (`flashtune families` lists them).")]
HeadDim = Annotated[int, typer.Option("--head-dim", help="Head dimension (multiple of 8, <= 256).")]
#: The element type every command defaults to. fp16: every arch flashtune compiles for has
#: its tensor-core MMA, and its 10 mantissa bits make a check's tolerance the stricter one;
#: bf16 is one option away (--dtype bf16), as in the README's examples.
DEFAULT_DTYPE = DType.FP16
DTypeOpt = Annotated[DType, typer.Option("--dtype", case_sensitive=False,
                                         help="Element type of q, k, v.")]
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


def fail(message: object) -> typer.Exit:
    """Print ``message`` as an error on stderr (markup and control characters escaped);
    the caller raises the returned Exit(1)."""
    Console(stderr=True).print(f"[bold red]error:[/] {escape(str(message))}", highlight=False)
    return typer.Exit(1)
