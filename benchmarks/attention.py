"""Attention throughput, forward and forward+backward: flashtune (tuned and default config)
against torch SDPA (flash and cuDNN backends) and flash-attn, over the field's standard sweep.

Sweep (FlashAttention's benchmark): hidden size 2048, so H = 2048 / D heads; (batch, seqlen)
from (32, 512) to (1, 16k); causal and not; fp16 and bf16; ``--passes fwd`` (default),
``fwdbwd`` or ``both``. FLOPs = 4*B*N*N*H*D for the forward, 3.5 times that for forward +
backward (backward = 2.5 x forward), halved when causal. Each implementation is checked
against the float64 reference (output, and for fwd+bwd the gradients of dO), then timed
with CUDA events after warm-up: median of the repeats, L2 flushed before each; a fwd+bwd
repeat is one forward and one backward (torch.autograd.grad).

    python benchmarks/attention.py --out .bench/attention             # the full sweep
    python benchmarks/attention.py --subset --dtypes bf16 --head-dims 128 --time-budget 120
    python benchmarks/attention.py --seqlens 4096 --head-dims 128 --causal full
    python benchmarks/attention.py --subset --passes fwdbwd --head-dims 128
    python benchmarks/attention.py --plan-only --out DIR              # list the sweep, no GPU

Writes DIR/attention.csv (one row per shape and implementation, rewritten after every
measurement so an interrupted run keeps what it measured), DIR/attention_env.json (date,
GPU, versions, command) and DIR/attention.png; prints a table of TFLOP/s and the ratio to
SDPA's flash backend. Exit status: 0 ok, 1 some flashtune output was wrong or failed,
2 no GPU (or bad arguments), 124 stopped by SIGTERM after writing what was measured.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _attention_impls import (  # noqa: E402
    BASELINE,
    IMPLS,
    REL_ERR_TOLERANCE,
    GradReference,
    Impl,
    Reference,
    Timer,
    Unavailable,
    grad_error,
    grad_reference,
    poison_next_output,
    reference,
    relative_error,
)
from _common import (  # noqa: E402
    Deadline,
    Stats,
    add_benchmarks_to_path,
    attention_flops,
    environment_info,
    write_csv,
    write_json,
)

HIDDEN = 2048
FULL_POINTS = ((32, 512), (16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384))
SUBSET_POINTS = ((16, 1024), (4, 4096), (1, 16384))
DTYPES = ("fp16", "bf16")
HEAD_DIMS = (64, 128)
PASSES = ("fwd", "fwdbwd")
#: FLOPs of forward + backward over the forward's (backward = 2.5 x forward).
FWD_BWD_FLOPS = 3.5
CSV_FIELDS = ("date_utc", "gpu", "pass", "dtype", "head_dim", "heads", "batch", "seqlen",
              "causal", "impl", "config", "status", "median_ms", "min_ms", "max_ms", "repeats",
              "tflops", "ratio_vs_sdpa", "rel_err", "note")


@dataclass(frozen=True)
class Shape:
    """One point of the sweep."""

    dtype: str
    head_dim: int
    causal: bool
    batch: int
    seqlen: int
    passes: str = "fwd"

    def __post_init__(self) -> None:
        if self.passes not in PASSES:
            raise ValueError(f"passes {self.passes!r} is not one of {PASSES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {DTYPES}")
        if self.head_dim < 8 or HIDDEN % self.head_dim:
            raise ValueError(f"head_dim {self.head_dim} must divide the hidden size {HIDDEN}")
        if self.batch < 1 or self.seqlen < 1:
            raise ValueError(f"batch and seqlen must be >= 1, got {self.batch}, {self.seqlen}")

    @property
    def heads(self) -> int:
        return HIDDEN // self.head_dim

    @property
    def backward(self) -> bool:
        return self.passes == "fwdbwd"

    @property
    def flops(self) -> float:
        fwd = attention_flops(self.batch, self.seqlen, self.seqlen, self.heads, self.head_dim,
                              self.causal)
        return fwd * FWD_BWD_FLOPS if self.backward else fwd

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"{self.passes} {self.dtype} d{self.head_dim} {mask} b{self.batch} n{self.seqlen}"


@dataclass(frozen=True)
class Result:
    """One implementation on one shape. ``status``: ok, wrong, error, unavailable, skipped,
    planned."""

    shape: Shape
    impl: str
    status: str
    config: str = ""
    stats: Stats | None = None  # milliseconds
    rel_err: float | None = None
    ratio_vs_sdpa: float | None = None
    note: str = ""

    @property
    def tflops(self) -> float | None:
        if self.status != "ok" or self.stats is None:
            return None
        return self.shape.flops / (self.stats.median * 1e-3) / 1e12

    def row(self, gpu: str) -> dict[str, Any]:
        s = self.shape
        return {
            "gpu": gpu, "pass": s.passes, "dtype": s.dtype, "head_dim": s.head_dim,
            "heads": s.heads, "batch": s.batch, "seqlen": s.seqlen, "causal": s.causal,
            "impl": self.impl,
            "config": self.config, "status": self.status,
            "median_ms": self.stats.median if self.stats else None,
            "min_ms": self.stats.minimum if self.stats else None,
            "max_ms": self.stats.maximum if self.stats else None,
            "repeats": self.stats.count if self.stats else None,
            "tflops": self.tflops, "ratio_vs_sdpa": self.ratio_vs_sdpa,
            "rel_err": self.rel_err, "note": self.note,
        }


def plan_sweep(dtypes: Sequence[str], head_dims: Sequence[int], causal: Sequence[bool],
               subset: bool, seqlens: Sequence[int] | None = None,
               passes: Sequence[str] = ("fwd",)) -> list[Shape]:
    """The shapes to run, grouped by (pass, dtype, head dim, causal), short sequences first;
    ``seqlens`` keeps only the (batch, seqlen) points of those sequence lengths."""
    points = [(b, n) for b, n in (SUBSET_POINTS if subset else FULL_POINTS)
              if seqlens is None or n in seqlens]
    return [Shape(dt, d, c, b, n, p) for p in passes for dt in dtypes for d in head_dims
            for c in causal for b, n in points]


def with_ratios(results: Sequence[Result]) -> list[Result]:
    """``results`` with ratio_vs_sdpa filled in: TFLOP/s over the baseline's on the shape."""
    base = {r.shape: r.tflops for r in results if r.impl == BASELINE and r.tflops}
    out = []
    for r in results:
        b, t = base.get(r.shape), r.tflops
        out.append(replace(r, ratio_vs_sdpa=t / b if (b and t is not None) else None))
    return out


def measure(impl: Impl, shape: Shape, q: Any, k: Any, v: Any, ref: Reference, *,
            timer: Timer, flush: Callable[[], None], dout: Any = None,
            grad_ref: GradReference | None = None) -> Result:
    """Check ``impl`` on the inputs against ``ref`` (its output lands on NaN-poisoned
    memory; for fwd+bwd, its gradients of ``dout`` against ``grad_ref`` too), then time it
    (forward, or forward and backward)."""
    import torch

    try:
        prepared = impl.prepare(q, k, v, shape.causal)
    except Unavailable as exc:
        return Result(shape, impl.name, "unavailable", note=str(exc))
    except Exception as exc:  # a failure of one implementation must not end the sweep
        return Result(shape, impl.name, "error", note=_short(exc))

    def fwd_bwd() -> tuple[Any, ...]:
        return torch.autograd.grad(prepared.fn(), (q, k, v), dout)

    timed = fwd_bwd if shape.backward else prepared.fn
    try:
        with prepared.context():
            poison_next_output(q)
            out = prepared.fn()
            timer.sync()
            err = relative_error(out, ref)
            if shape.backward and grad_ref is not None and err <= REL_ERR_TOLERANCE:
                poison_next_output(q)
                err = max(err, grad_error(torch.autograd.grad(out, (q, k, v), dout),
                                          grad_ref))
            del out
            if not err <= REL_ERR_TOLERANCE:  # also catches NaN
                return Result(shape, impl.name, "wrong", prepared.config, rel_err=err,
                              note=f"relative error {err:.3g} > {REL_ERR_TOLERANCE}")
            times = timer.time(timed, flush)
    except Exception as exc:
        return Result(shape, impl.name, "error", prepared.config, note=_short(exc))
    return Result(shape, impl.name, "ok", prepared.config, Stats.of(times), rel_err=err)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def run_sweep(shapes: Sequence[Shape], impls: Sequence[Impl], *, timer: Timer,
              deadline: Deadline, seed: int,
              on_result: Callable[[list[Result]], None]) -> list[Result]:
    """Measure every impl on every shape until the deadline; skipped shapes are recorded.

    Inputs are fresh standard normals per shape (from ``seed``), on ``timer.device``.
    """
    import torch

    device = torch.device(timer.device)
    flush = timer.flusher()
    gen = torch.Generator(device=device).manual_seed(seed)
    results: list[Result] = []
    for i, shape in enumerate(shapes):
        if deadline.expired():
            results += [Result(s, im.name, "skipped", note="time budget spent")
                        for s in shapes[i:] for im in impls]
            break
        dtype = torch.float16 if shape.dtype == "fp16" else torch.bfloat16
        size = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
        q, k, v = (torch.randn(size, dtype=dtype, device=device, generator=gen)
                   for _ in range(3))
        ref = reference(q, k, v, shape.causal)
        dout, grad_ref = None, None
        if shape.backward:
            dout = torch.randn(size, dtype=dtype, device=device, generator=gen)
            grad_ref = grad_reference(q, k, v, dout, shape.causal)
            for t in (q, k, v):
                t.requires_grad_(True)
        for impl in impls:
            results.append(measure(impl, shape, q, k, v, ref, timer=timer, flush=flush,
                                   dout=dout, grad_ref=grad_ref))
            on_result(with_ratios(results))
        del q, k, v, ref, dout, grad_ref
    return with_ratios(results)


# --- reporting ----------------------------------------------------------------------------


def print_table(results: Sequence[Result], impl_names: Sequence[str], gpu: str) -> None:
    """One row per shape: TFLOP/s of each implementation, and flashtune's ratio to SDPA."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"attention, TFLOP/s ({gpu})")
    for col in ("pass", "dtype", "D", "mask", "B", "N"):
        table.add_column(col)
    for name in impl_names:
        table.add_column(name, justify="right")
    ratio_cols = [n for n in impl_names if n.startswith("flashtune")]
    for name in ratio_cols:
        table.add_column(f"{name}/sdpa", justify="right")
    by_shape: dict[Shape, dict[str, Result]] = {}
    for r in results:
        by_shape.setdefault(r.shape, {})[r.impl] = r
    for shape, row in by_shape.items():
        cells = [shape.passes, shape.dtype, str(shape.head_dim),
                 "causal" if shape.causal else "full",
                 str(shape.batch), str(shape.seqlen)]
        for name in impl_names:
            found = row.get(name)
            t = found.tflops if found else None
            cells.append(f"{t:.1f}" if t is not None else (found.status if found else "-"))
        for name in ratio_cols:
            ratio = row[name].ratio_vs_sdpa if name in row else None
            cells.append(f"{ratio:.2f}" if ratio is not None else "-")
        table.add_row(*cells)
    Console(width=200).print(table)


def plot(results: Sequence[Result], path: Path, title: str) -> None:
    """TFLOP/s against sequence length, one panel per (dtype, head dim, mask)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.tflops is not None]
    panels = sorted({(r.shape.passes, r.shape.dtype, r.shape.head_dim, r.shape.causal)
                     for r in ok})
    if not panels:
        return
    cols = min(len(panels), 4)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.6 * rows), squeeze=False)
    for ax, (ps, dt, d, c) in zip(axes.flat, panels, strict=False):
        for impl in dict.fromkeys(r.impl for r in ok):
            pts = sorted((r.shape.seqlen, r.tflops) for r in ok if r.impl == impl and (
                r.shape.passes, r.shape.dtype, r.shape.head_dim, r.shape.causal) == (ps, dt, d, c))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{ps} {dt} d{d} {'causal' if c else 'non-causal'}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- command line -------------------------------------------------------------------------


def _csv_list(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        return [kind(x) for x in text.replace(" ", ",").split(",") if x]
    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--subset", action="store_true",
                   help=f"quick subset: (batch, seqlen) in {SUBSET_POINTS}")
    p.add_argument("--dtypes", type=_csv_list(str), default=list(DTYPES),
                   help="comma list of fp16,bf16 (default both)")
    p.add_argument("--head-dims", type=_csv_list(int), default=list(HEAD_DIMS),
                   help="comma list of head dims dividing 2048 (default 64,128)")
    p.add_argument("--causal", choices=("both", "causal", "full"), default="both")
    p.add_argument("--passes", choices=("fwd", "fwdbwd", "both"), default="fwd",
                   help="forward only (default), forward + backward, or both")
    p.add_argument("--seqlens", type=_csv_list(int), default=None,
                   help=f"only these sequence lengths of {[n for _, n in FULL_POINTS]}")
    p.add_argument("--impls", type=_csv_list(str), default=list(IMPLS),
                   help=f"comma list of {','.join(IMPLS)} (default all)")
    p.add_argument("--out", type=Path, default=Path(".bench/attention"),
                   help="output directory (default .bench/attention)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop starting new shapes after this many seconds")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan-only", action="store_true",
                   help="write the planned sweep (status 'planned') and exit; needs no GPU")
    args = p.parse_args(argv)
    for dt in args.dtypes:
        if dt not in DTYPES:
            p.error(f"--dtypes: {dt!r} is not one of {DTYPES}")
    for name in args.impls:
        if name not in IMPLS:
            p.error(f"--impls: {name!r} is not one of {list(IMPLS)}")
    for d in args.head_dims:
        if d < 8 or HIDDEN % d:
            p.error(f"--head-dims: {d} must be >= 8 and divide the hidden size {HIDDEN}")
    for n in args.seqlens or ():
        if n not in [m for _, m in FULL_POINTS]:
            p.error(f"--seqlens: {n} is not a point of the sweep {[m for _, m in FULL_POINTS]}")
    if args.warmup < 1 or args.repeats < 1:
        p.error("--warmup and --repeats must be >= 1")
    if args.time_budget is not None and args.time_budget <= 0:
        p.error("--time-budget must be > 0 seconds")
    return args


class _Terminated(Exception):
    pass


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    add_benchmarks_to_path()
    causal = {"both": [False, True], "causal": [True], "full": [False]}[args.causal]
    passes = list(PASSES) if args.passes == "both" else [args.passes]
    shapes = plan_sweep(args.dtypes, args.head_dims, causal, args.subset, args.seqlens,
                        passes)
    impls = [IMPLS[name] for name in args.impls]
    env = environment_info(probe_gpu=not args.plan_only)
    env["command"] = " ".join(["python", *sys.argv]) if argv is None else " ".join(argv)
    csv_path, gpu = args.out / "attention.csv", str(env.get("gpu") or "no GPU")

    def save(results: Sequence[Result]) -> None:
        rows = [{"date_utc": env["date_utc"], **r.row(gpu)} for r in results]
        write_csv(csv_path, CSV_FIELDS, rows)

    if args.plan_only:
        save([Result(s, im.name, "planned") for s in shapes for im in impls])
        write_json(args.out / "attention_env.json", env)
        print(f"planned {len(shapes)} shapes x {len(impls)} implementations -> {csv_path}")
        return 0

    import torch

    if not torch.cuda.is_available():
        print(f"error: benchmarks/attention.py needs a CUDA GPU, and torch "
              f"{torch.__version__} sees none (torch.cuda.is_available() is False). Run it on "
              "a machine with an NVIDIA GPU, or pass --plan-only to list the sweep.",
              file=sys.stderr)
        return 2
    write_json(args.out / "attention_env.json", env)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    results: list[Result] = []

    def keep(so_far: list[Result]) -> None:
        results[:] = so_far
        save(so_far)

    status = 0
    try:
        timer = Timer("cuda", warmup=args.warmup, repeats=args.repeats)
        keep(run_sweep(shapes, impls, timer=timer, deadline=Deadline(args.time_budget),
                       seed=args.seed, on_result=keep))
    except (_Terminated, KeyboardInterrupt):
        print("interrupted: reporting what was measured", file=sys.stderr)
        status = 124
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_table(results, args.impls, gpu)
    try:
        plot(results, args.out / "attention.png", f"{gpu}, {env['date_utc']}")
    except ImportError as exc:
        print(f"no plot: {exc} (pip install matplotlib)", file=sys.stderr)
    bad = [r for r in results if r.impl.startswith("flashtune") and r.status in ("wrong",
                                                                                 "error")]
    for r in bad:
        print(f"FAILED {r.impl} {r.shape.label()}: {r.status}: {r.note}", file=sys.stderr)
    print(f"wrote {csv_path}")
    return status or (1 if bad else 0)


if __name__ == "__main__":
    sys.exit(main())
