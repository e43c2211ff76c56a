"""Instruction budget of the forward kernel's main loops for every default config of
head dims 64 and 128, against FlashAttention-2's figure for the same tile.

    python benchmarks/sass_budget.py [--dtype bf16] [--arch sm_80 --arch sm_90]
                                     [--head-dim 64 --head-dim 128] [--json]

For each default config (causal and not), and each tile FA2's figures are for that is not
the default (rows marked "reference", e.g. 128 x 32 at head dim 128 on sm_90), it compiles
the kernel with NVRTC (no GPU), finds the masked and unmasked main loops in the SASS
(flashtune.perf.sass.loops) and prints the static instructions per iteration per warp of the
unmasked loop, what it executes when the warp vote skips the rescale of O, the masked
loop's count ("-": masked steps are unrolled, or there is no mask), FA2's same-tile figure
from reference/fa2-sass-facts.md where it has one, and the ratio. Exit status 1 when an
unmasked loop of a printed row is above FA2's figure.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from flashtune.codegen.spec import DType
from flashtune.families import render
from flashtune.perf.sass.budget import (
    BudgetRow,
    budget_row,
    default_problems,
    reference_problems,
)
from flashtune.perf.sass.disasm import sass_listing
from flashtune.perf.sass.loops import main_loops
from flashtune.toolchain.compiler import compile_pairs


def budget(head_dims: list[int], dtypes: list[DType], archs: list[str]) -> list[BudgetRow]:
    """One row per (arch, head dim, dtype, mask) default config, then the reference tiles."""
    jobs = [(*job, "default") for job in default_problems(head_dims, dtypes, archs)]
    jobs += [(*job, "reference") for job in reference_problems(head_dims, dtypes, archs)]
    results = compile_pairs([(render(p, c), a) for p, c, a, _ in jobs])
    rows = []
    for (problem, config, arch, role), result in zip(jobs, results, strict=True):
        kernel = result.unwrap()
        function = sass_listing(kernel.cubin, arch).function(result.source.entry)
        rows.append(budget_row(problem, config, arch, main_loops(function), role))
    return rows


def _print(rows: list[BudgetRow]) -> None:
    table = Table(title="forward main loop: instructions per iteration per warp (static)")
    for name in ("arch", "problem", "config", "role", "unmasked", "no rescale", "masked", "FA2",
                 "ratio"):
        table.add_column(name, justify="left" if name in ("arch", "problem", "config", "role")
                         else "right")
    for r in rows:
        table.add_row(
            r.arch, r.problem.key(), r.config.key(), r.role,
            "-" if r.unmasked is None else str(r.unmasked.static),
            "-" if r.unmasked is None else str(r.unmasked.executed_min),
            "-" if r.masked is None else str(r.masked.static),
            "-" if r.fa2 is None else str(r.fa2.instructions),
            "-" if r.ratio is None else f"{r.ratio:.3f}",
        )
    Console(width=160).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, action="append", dest="head_dims")
    parser.add_argument("--dtype", choices=[d.value for d in DType], action="append",
                        dest="dtypes")
    parser.add_argument("--arch", action="append", dest="archs")
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    args = parser.parse_args(argv)
    rows = budget(args.head_dims or [64, 128],
                  [DType(d) for d in (args.dtypes or ["bf16"])],
                  args.archs or ["sm_80", "sm_90"])
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        _print(rows)
    over = [r for r in rows if r.ratio is not None and r.ratio > 1.0]
    for r in over:
        print(f"over budget: {r.arch} {r.problem.key()} {r.config.key()}: "
              f"{r.ratio:.3f} x FA2's {r.fa2.instructions if r.fa2 else '-'}", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
