"""Host-side costs of flashtune, measurable on any machine (no GPU needed):

- cold NVRTC compile time per kernel (empty cache), the cached load time and the memo hit,
  from benchmarks/compile_time.py (min and max are not reported there);
- warm dispatch overhead per call, from benchmarks/host_overhead.py;
- emulator throughput: the forward kernel (batch 1, 2 heads, 512 tokens, head dim 128,
  bf16) in the CPU emulator, build excluded, in seconds per call and tokens per second.

Every row is a median over repeats. ``--short`` is the CI mode (few repeats, one cold
compile). The table is printed with rich; ``--json PATH`` also writes the rows with the
environment (date, CPU, versions).

    python benchmarks/host.py --short
    python benchmarks/host.py --json .bench/host.json
    python benchmarks/host.py --rows compile,emulator

Exit status: 0 when every row was measured, 1 when a row failed (or, with --strict, could not
be measured because its part of flashtune is missing), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    Stats,
    add_benchmarks_to_path,
    environment_info,
    format_seconds,
    write_json,
)

#: The emulator row's call: forward, batch 1, 2 heads, 512 tokens, head dim 128, bf16.
EMU_BATCH, EMU_HEADS, EMU_SEQLEN, EMU_HEAD_DIM = 1, 2, 512, 128


@dataclass(frozen=True)
class Settings:
    """How hard to measure: repeats per row and the CI (short) mode."""

    repeats: int
    short: bool

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")


@dataclass(frozen=True)
class HostRow:
    """One measured quantity in seconds: the median over ``repeats``, with the min and max
    where the measuring function reports them."""

    name: str
    status: str  # ok | unavailable | error
    median_s: float | None = None
    repeats: int | None = None
    min_s: float | None = None
    max_s: float | None = None
    rate: str = ""  # a derived throughput, e.g. "2.1k tokens/s"
    note: str = ""

    def __post_init__(self) -> None:
        if self.status not in ("ok", "unavailable", "error"):
            raise ValueError(f"status {self.status!r} is not ok/unavailable/error")
        measured = self.median_s is not None and self.repeats is not None
        if (self.status == "ok") != measured:
            raise ValueError(f"row {self.name!r}: median_s and repeats are required exactly "
                             "when status is ok")
        if self.median_s is not None and not self.median_s > 0:
            raise ValueError(f"row {self.name!r}: median_s={self.median_s} must be > 0")

    @classmethod
    def of(cls, name: str, stats: Stats, rate: str = "", note: str = "") -> HostRow:
        return cls(name, "ok", stats.median, stats.count, stats.minimum, stats.maximum,
                   rate, note)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "median_s": self.median_s,
                "min_s": self.min_s, "max_s": self.max_s, "repeats": self.repeats,
                "rate": self.rate, "note": self.note}


RowFn = Callable[[Settings], list[HostRow]]


def _sibling(module: str, *names: str) -> tuple[Any, ...]:
    """Functions ``names`` of benchmarks/<module>.py; ImportError says which is missing."""
    add_benchmarks_to_path()
    mod = importlib.import_module(module)
    found = []
    for name in names:
        fn = getattr(mod, name, None)
        if not callable(fn):
            raise ImportError(f"benchmarks/{module}.py has no function {name}()")
        found.append(fn)
    return tuple(found)


# --- rows ---------------------------------------------------------------------------------


def emulator_rows(settings: Settings) -> list[HostRow]:
    """The forward kernel in the emulator: build (excluded) then the timed calls."""
    import torch
    from _attention_impls import REL_ERR_TOLERANCE, reference, relative_error
    from _flashtune_adapter import default_call

    name = (f"emulator fwd b{EMU_BATCH} h{EMU_HEADS} n{EMU_SEQLEN} d{EMU_HEAD_DIM} bf16, "
            "per call")
    gen = torch.Generator().manual_seed(1234)
    size = (EMU_BATCH, EMU_SEQLEN, EMU_HEADS, EMU_HEAD_DIM)
    q, k, v = (torch.randn(size, generator=gen).to(torch.bfloat16) for _ in range(3))
    fn, config = default_call(q, k, v, False, backend="emulator")  # builds the kernel
    # The first launch (page-in, thread pools) stays out of the numbers; its output is
    # checked, so a throughput is never reported for a kernel that computes garbage.
    err = relative_error(fn(), reference(q, k, v, causal=False))
    if not err <= REL_ERR_TOLERANCE:
        return [HostRow(name, "error", note=f"config {config}: wrong output, relative error "
                                             f"{err:.3g} > {REL_ERR_TOLERANCE}")]
    samples = []
    for _ in range(settings.repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    stats = Stats.of(samples)
    tokens = EMU_BATCH * EMU_SEQLEN
    return [HostRow.of(name, stats, rate=f"{tokens / stats.median:,.0f} tokens/s",
                       note=f"config {config}; build excluded; rel. error {err:.1e}")]


def dispatch_rows(settings: Settings) -> list[HostRow]:
    """Warm flashtune.attention overhead per call, launch stubbed, and its parts
    (benchmarks/host_overhead.py), on CUDA tensors when a GPU is present."""
    import torch

    (measure,) = _sibling("host_overhead", "measure")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls = 300 if settings.short else 2000
    rows = []
    for i, (name, samples) in enumerate(measure(repeats=settings.repeats, calls=calls,
                                                 device=device)):
        # Samples carry wall-clock and CPU seconds per call (older versions: a plain list).
        stats = Stats.of(getattr(samples, "wall", samples))
        cpu = getattr(samples, "cpu", None)
        notes = [f"CPU {format_seconds(Stats.of(cpu).median)}"] if cpu else []
        if i == 0:  # the whole call; the rows after it are its parts
            notes.append(f"{device} tensors, {calls} calls per repeat")
        rows.append(HostRow.of(name.rstrip(), stats,
                               rate=f"{1 / stats.median:,.0f} calls/s" if i == 0 else "",
                               note="; ".join(notes)))
    return rows


def compile_rows(settings: Settings) -> list[HostRow]:
    """Cold NVRTC compile (empty cache), cached load (memo cleared, disk cache warm) and
    memo hit of the default forward kernel, d128 bf16 non-causal, for the present GPU's
    arch or sm_90 (benchmarks/compile_time.py)."""
    import torch

    from flashtune.codegen.spec import DType, Problem
    from flashtune.families import render
    from flashtune.runtime.dispatch import default_config

    (measure,) = _sibling("compile_time", "measure")
    arch = "sm_90"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}"
    problem = Problem(head_dim=128, dtype=DType.BF16, causal=False)
    config = default_config(problem, arch)
    kernel, (cold, cold_cpu), cached, memo = measure(render(problem, config), arch,
                                                     settings.repeats)
    what = f"{problem.key()} {config.key()} for {arch}"
    regs = kernel.resources.registers
    return [
        HostRow("cold NVRTC compile, per kernel", "ok", cold, settings.repeats,
                note=f"{what}; {regs} registers; CPU {cold_cpu:.2f} s"),
        HostRow("cached load (disk cache, memo cleared)", "ok", cached, settings.repeats,
                note=what),
        HostRow("in-process memo hit", "ok", memo, max(settings.repeats, 100), note=what),
    ]


ROWS: dict[str, RowFn] = {
    "compile": compile_rows,
    "dispatch": dispatch_rows,
    "emulator": emulator_rows,
}


def run_rows(selected: Sequence[str], settings: Settings) -> list[HostRow]:
    """Run the selected row functions; a failure becomes an error row, never an exception."""
    rows: list[HostRow] = []
    for key in selected:
        try:
            rows += ROWS[key](settings)
        except ImportError as exc:
            rows.append(HostRow(key, "unavailable", note=str(exc)))
        except Exception as exc:
            text = str(exc).strip().splitlines()
            rows.append(HostRow(key, "error",
                                note=f"{type(exc).__name__}: {text[0] if text else ''}"[:300]))
    return rows


def print_table(rows: Sequence[HostRow], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col, justify in (("measurement", "left"), ("median", "right"), ("min", "right"),
                         ("max", "right"), ("n", "right"), ("rate", "right"),
                         ("note", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    def fmt(value: float | None) -> str:
        return "" if value is None else format_seconds(value)

    for r in rows:
        if r.median_s is None:
            table.add_row(r.name, r.status.upper(), "", "", "", "", r.note)
        else:
            table.add_row(r.name, fmt(r.median_s), fmt(r.min_s), fmt(r.max_s),
                          str(r.repeats), r.rate, r.note)
    Console(width=160).print(table)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", action="store_true",
                   help="CI mode: few repeats (3 unless --repeats is given)")
    p.add_argument("--repeats", type=int, default=None, help="repeats per row (default 10)")
    p.add_argument("--rows", default=",".join(ROWS),
                   help=f"comma list of {','.join(ROWS)} (default all)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the rows and the environment as JSON")
    p.add_argument("--strict", action="store_true",
                   help="fail when a row cannot be measured (part of flashtune missing)")
    args = p.parse_args(argv)
    args.rows = [r for r in args.rows.replace(" ", ",").split(",") if r]
    for r in args.rows:
        if r not in ROWS:
            p.error(f"--rows: {r!r} is not one of {list(ROWS)}")
    if args.repeats is None:
        args.repeats = 3 if args.short else 10
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    add_benchmarks_to_path()
    env = environment_info()
    t0 = time.perf_counter()
    rows = run_rows(args.rows, Settings(repeats=args.repeats, short=args.short))
    took = time.perf_counter() - t0
    title = (f"flashtune host-side costs ({env['date_utc']}, {env['cpu']} x{env['cpu_count']}, "
             f"{env.get('gpu') or 'no GPU'})")
    print_table(rows, title)
    print(f"host.py measured {len(rows)} row(s) in {took:.1f} s")
    if args.json is not None:
        write_json(args.json, {"environment": env, "seconds": took,
                               "command": " ".join(sys.argv if argv is None else argv),
                               "rows": [r.to_dict() for r in rows]})
    failing = {"error", "unavailable"} if args.strict else {"error"}
    return 1 if any(r.status in failing for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
