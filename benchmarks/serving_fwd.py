"""The serving forward at full-chip shapes against SDPA's flash and cuDNN backends, in one run.

What ``flashtune.attention`` serves (on compute capability 9.0 the warp-specialised sm_90a
family, after its first-use check) and, on an sm_90a device, the same family's kernel with
ping-pong, with intra-warpgroup overlap (at the widest key tile its registers admit) and
with a 176-row key tile (each checked against float64 with the first-use check, under its
deadline, before it is timed), next to
``sdpa-flash`` and ``sdpa-cudnn`` on the same tensors. Shapes fill the chip: batch 4 with 16
heads at 4k and 8k, batch 16 with 16 heads at 1k; head dims 128, 64, 256; causal and not;
bf16. Most valuable first (d128 at 4k before the rest), so a time budget cuts the least
useful. CUDA events, L2 flushed before each repeat, the median; TFLOP/s as the field counts
them (4 B N^2 H D, halved when causal) and the ratio to each baseline, printed last.

    python benchmarks/serving_fwd.py --out DIR [--time-budget S] [--repeats N]
    python benchmarks/serving_fwd.py --plan-only        # the plan, no GPU

With FLASHTUNE_ARCH_SPECIFIC=0 (gpu_check.sh sets it when a canary failed) the variants are
not run and the serving forward is the portable one; the table says so. Writes
DIR/serving_fwd.csv (rewritten after each measurement). Exit status: 0, 1 if a flashtune
kernel failed its check, 2 no GPU or bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _attention_impls import IMPLS, Prepared, Timer, Unavailable  # noqa: E402
from _common import (  # noqa: E402
    Deadline,
    Stats,
    add_benchmarks_to_path,
    attention_flops,
    write_csv,
)

add_benchmarks_to_path()

#: (batch, heads, seqlen), most valuable first.
SHAPES = ((4, 16, 4096), (16, 16, 1024), (4, 16, 8192))
HEAD_DIMS = (128, 64, 256)
#: Variants of the served sm_90a family's default config: the knobs they set.
VARIANTS: dict[str, dict[str, Any]] = {
    "pingpong": {"pingpong": 1}, "overlap": {"overlap": 1}, "n176": {"block_n": 176}}
BASELINES = ("sdpa-flash", "sdpa-cudnn")
FIELDS = ("batch", "heads", "seqlen", "head_dim", "causal", "impl", "config", "ms",
          "tflops", "status")


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool

    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"b{self.batch} h{self.heads} n{self.seqlen} d{self.head_dim} {mask}"

    def flops(self) -> float:
        return attention_flops(self.batch, self.seqlen, self.seqlen, self.heads,
                               self.head_dim, self.causal)


def cases() -> list[Case]:
    """Every case, most valuable first: d128 before d64 before d256, 4k before 1k and 8k."""
    return [Case(b, h, n, d, c) for d in HEAD_DIMS for b, h, n in SHAPES for c in (True, False)]


def impls() -> list[str]:
    return ["serving", *BASELINES, *VARIANTS]


def _variant(name: str, case: Case) -> tuple[Callable[[], object], str]:
    """A launch of the served family's default config with variant ``name``'s knobs, on its
    own random inputs of the case's shape, after the first-use check of the kernel."""
    import dataclasses

    import torch

    from flashtune import families
    from flashtune.codegen.arch import get_arch
    from flashtune.codegen.spec import DType, Problem, Shape
    from flashtune.runtime import first_use
    from flashtune.runtime.backends import get_backend
    from flashtune.runtime.device import DeviceInfo
    from flashtune.runtime.dispatch import served_problem
    from flashtune.runtime.launch import prepare

    info = DeviceInfo.current()
    plain = Problem(head_dim=case.head_dim, dtype=DType.BF16, causal=case.causal)
    problem = served_problem(plain, info)
    if problem == plain:
        raise Unavailable("no arch-specific family serves here")
    arch = get_arch("sm_90a")
    family = families.of(problem)
    base = family.default_config(problem, arch)
    knobs = dict(VARIANTS[name])
    config = dataclasses.replace(base, block_n=knobs.pop("block_n", base.block_n))
    if knobs:
        config = dataclasses.replace(config, extras=(*config.extras, *knobs.items()))
    reason = family.static_check(problem, config, arch)
    while reason is not None and knobs and config.block_n > 64:  # the widest tile that fits
        config = dataclasses.replace(config, block_n=config.block_n - 16)
        reason = family.static_check(problem, config, arch)
    if reason is not None:
        raise Unavailable(f"{config.key()}: {reason}")
    kernel = get_backend("cuda").load(families.render(problem, config))
    failure = first_use.run_check(kernel, torch.device("cuda"), info.name, timeout_s=30)
    if failure is not None:
        raise RuntimeError(f"{config.key()} failed its check: {failure}")
    shape = Shape(case.batch, case.heads, case.heads, case.seqlen, case.seqlen)
    launch = prepare(kernel, shape, torch.device("cuda"), seed=0)
    return launch.run, config.key()


def _prepare(impl: str, case: Case, tensors: tuple[Any, Any, Any]) -> Prepared:
    """``impl`` bound to the case's tensors (a variant to inputs of its own)."""
    q, k, v = tensors
    if impl in BASELINES:
        return IMPLS[impl].prepare(q, k, v, case.causal)
    if impl == "serving":
        import flashtune

        decision = flashtune.explain(q, k, v, causal=case.causal)
        return Prepared(lambda: flashtune.attention(q, k, v, causal=case.causal),
                        f"{decision.problem.op} {decision.config.key()}")
    fn, config = _variant(impl, case)
    return Prepared(fn, config)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(".bench/serving_fwd"))
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--plan-only", action="store_true", help="print the plan; no GPU")
    args = p.parse_args(argv)
    plan = cases()
    if args.plan_only:
        print(f"serving forward plan: {len(plan)} cases x {', '.join(impls())}")
        for case in plan:
            print(f"  {case.label()}")
        return 0
    import torch

    from flashtune import settings

    if not torch.cuda.is_available():
        print("error: no CUDA GPU", file=sys.stderr)
        return 2
    variants = settings.ARCH_SPECIFIC.get()
    if not variants:
        print("note: FLASHTUNE_ARCH_SPECIFIC=0: the portable forward serves; the sm_90a "
              "variants are not run")
    deadline = Deadline(args.time_budget)
    timer = Timer("cuda", args.warmup, args.repeats)
    flush = timer.flusher()
    rows: list[dict[str, Any]] = []
    failed = False
    for case in plan:
        if deadline.expired():
            print(f"time budget spent: stopped before {case.label()}")
            break
        gen = torch.Generator(device="cuda").manual_seed(0)
        shape = (case.batch, case.seqlen, case.heads, case.head_dim)
        tensors = tuple(torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
                        for _ in range(3))
        for impl in impls():
            if impl in VARIANTS and not variants:
                continue
            row: dict[str, Any] = {"batch": case.batch, "heads": case.heads,
                                   "seqlen": case.seqlen, "head_dim": case.head_dim,
                                   "causal": case.causal, "impl": impl, "config": "",
                                   "ms": "", "tflops": "", "status": "ok"}
            try:
                prepared = _prepare(impl, case, tensors)  # type: ignore[arg-type]
                row["config"] = prepared.config
                with prepared.context():  # e.g. SDPA's backend selection
                    ms = Stats.of(timer.time(prepared.fn, flush)).median
                row["ms"], row["tflops"] = f"{ms:.4f}", f"{case.flops() / ms / 1e9:.1f}"
            except Unavailable as exc:
                row["status"] = f"n/a: {exc}"
            except Exception as exc:  # one failure must not lose the other measurements
                row["status"] = f"FAILED: {type(exc).__name__}: {exc}"[:300]
                failed = failed or not impl.startswith("sdpa")
            rows.append(row)
            write_csv(args.out / "serving_fwd.csv", FIELDS, rows)
            print(f"{case.label():28} {impl:11} {row['tflops'] or '-':>7} TFLOP/s  "
                  f"{row['config']}  {row['status']}", flush=True)
    _table(rows)
    return 1 if failed else 0


def _table(rows: list[dict[str, Any]]) -> None:
    """TFLOP/s per case and implementation, and the ratio to each baseline, last."""
    print("\nserving forward, TFLOP/s (ratio to sdpa-flash / sdpa-cudnn)")
    keyed: dict[tuple[Any, ...], dict[str, float]] = {}
    for r in rows:
        key = (r["batch"], r["heads"], r["seqlen"], r["head_dim"], r["causal"])
        if r["tflops"]:
            keyed.setdefault(key, {})[r["impl"]] = float(r["tflops"])
    for key, got in keyed.items():
        label = Case(*key).label()
        cells = []
        for impl in impls():
            if impl not in got:
                continue
            ratios = "/".join(f"{got[impl] / got[b]:.2f}" if b in got else "-"
                              for b in BASELINES)
            cells.append(f"{impl} {got[impl]:.0f}" + ("" if impl in BASELINES
                                                      else f" ({ratios})"))
        print(f"  {label:28} " + "  ".join(cells))


if __name__ == "__main__":
    sys.exit(main())
