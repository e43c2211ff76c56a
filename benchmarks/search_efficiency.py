"""How fast do search strategies find the best config? Replayed on real GPU landscapes.

    python benchmarks/search_efficiency.py [DIR] [--repeats 25] [--jobs N] [--out DIR]
                                           [--strategies flashtune,random,...] [--quick]

Every landscape in DIR (default: ../shared/landscapes next to the repository where it
exists, else the two shipped with flashtune, flashtune/tuner/landscapes) is a
brute-forced search space of one kernel on one GPU (see its README). Each strategy runs
``--repeats`` seeded times through flashtune's own search loop (``flashtune.tuner.replay``:
an in-memory Optuna study, the proposal screening, the pipeline) against the recorded
compile and run times on a simulated clock, up to 10 % of the brute-force time. Reported
per landscape, strategy and budget (1, 2, 5, 10 % of the brute-force time): the mean (with
its standard error over the runs) and the 10th percentile of best found / optimum, and an
aggregate score (the mean of best found / optimum over the budget curve from 0.5 % to 10 %
in steps of 0.5 %). A run stops early once it has found the optimum (nothing after it can
change its curve).

Strategies: ``flashtune`` (the default of ``flashtune tune``: the guided sampler),
``random``, ``tpe`` (Optuna's TPE with default settings: since Optuna 5 these are
multivariate with a constant liar), ``nsga2`` (Optuna's genetic sampler with default
settings), and, opt-in, ``tpe-multivariate`` (flashtune's previous default, spelled out:
the same sampler as ``tpe`` under Optuna 5) and ``gp`` (Optuna's Gaussian-process sampler;
each decision takes seconds).

Besides, on each landscape: ``flashtune`` warm-started from every other device's landscape
of the same kernel (transfer), and ``flashtune`` with a deliberately noisy prior ranking
(the true log objective plus Gaussian noise of the same spread: what a cost model's
prediction is replaced by, so its gain is not circular). Writes ``search_efficiency.csv``,
``search_transfer.csv`` and ``search_efficiency.png`` to ``--out``; ``--quick`` is a seconds
long run for CI (one landscape, two strategies, three repeats, budgets up to 2 %).

All timings are replayed measurements of real GPUs (recorded in the landscape files); the
CPU time of this script is only the search's own cost, reported per evaluation.
"""

from __future__ import annotations

import os

# One BLAS thread per process: the model's small matrices gain nothing from threads, and
# oversubscribed threads on a shared machine make them many times slower.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import csv  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import optuna  # noqa: E402
from _common import add_benchmarks_to_path  # noqa: E402

add_benchmarks_to_path()

from flashtune.tuner.landscape import PACKAGED_DIR, Landscape  # noqa: E402
from flashtune.tuner.replay import SamplerFactory, replay, warm_start_prior  # noqa: E402
from flashtune.tuner.search.sampler import GuidedSampler, Prior  # noqa: E402
from flashtune.tuner.search.space import SearchSpace  # noqa: E402

_SHARED_DIR = Path(__file__).resolve().parents[2] / "shared" / "landscapes"
DEFAULT_DIR = _SHARED_DIR if _SHARED_DIR.is_dir() else PACKAGED_DIR
BUDGETS = (0.01, 0.02, 0.05, 0.10)
CURVE = tuple(k / 200 for k in range(1, 21))  # 0.5 % .. 10 %
NOISY_SEED = 1_000_003


def _tpe(space: SearchSpace, seed: int | None, prior: Prior | None
         ) -> optuna.samplers.BaseSampler:
    return optuna.samplers.TPESampler(seed=seed)


def _tpe_multivariate(space: SearchSpace, seed: int | None, prior: Prior | None
                      ) -> optuna.samplers.BaseSampler:
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True,
                                      n_startup_trials=10)


def _random(space: SearchSpace, seed: int | None, prior: Prior | None
            ) -> optuna.samplers.BaseSampler:
    return optuna.samplers.RandomSampler(seed=seed)


def _nsga2(space: SearchSpace, seed: int | None, prior: Prior | None
           ) -> optuna.samplers.BaseSampler:
    return optuna.samplers.NSGAIISampler(seed=seed)


def _gp(space: SearchSpace, seed: int | None, prior: Prior | None
        ) -> optuna.samplers.BaseSampler:
    return optuna.samplers.GPSampler(seed=seed)


def _flashtune(space: SearchSpace, seed: int | None, prior: Prior | None
               ) -> optuna.samplers.BaseSampler:
    return GuidedSampler(space, seed=seed, prior=prior)


STRATEGIES: dict[str, SamplerFactory] = {
    "flashtune": _flashtune, "random": _random, "tpe": _tpe,
    "tpe-multivariate": _tpe_multivariate, "nsga2": _nsga2, "gp": _gp,
}
DEFAULT_STRATEGIES = ("flashtune", "random", "tpe", "nsga2")


_LOADED: dict[str, Landscape] = {}


def landscape_at(path: str) -> Landscape:
    """Each landscape is read once per process."""
    if path not in _LOADED:
        _LOADED[path] = Landscape.load(path)
    return _LOADED[path]


@dataclass(frozen=True)
class Task:
    """One seeded run: a strategy on a landscape, with an optional prior."""

    landscape: str      # path
    strategy: str
    seed: int
    prior: str = ""     # "", "noisy", or "warm:<path of the source landscape>"
    max_budget: float = BUDGETS[-1]

    @property
    def label(self) -> str:
        if self.prior == "noisy":
            return f"{self.strategy}+noisy-prior"
        if self.prior.startswith("warm:"):
            return f"{self.strategy}+warm({landscape_at(self.prior[5:]).device})"
        return self.strategy


@dataclass(frozen=True)
class RunResult:
    task: Task
    curve: tuple[float, ...]    # best found / optimum at each CURVE budget
    budgets: tuple[float, ...]  # ... at each BUDGETS budget
    evaluations: int
    cpu_s: float


def noisy_prior(landscape: Landscape, seed: int) -> tuple[Prior, float]:
    """The true log objective (sign: lower is better) plus Gaussian noise of the same
    standard deviation, per legal point; failed points get the median plus noise. Returns
    the prior and its Spearman rank correlation with the truth (over successful points)."""
    rng = np.random.default_rng(seed)
    sign = 1.0 if landscape.minimize else -1.0
    legal = landscape.space.legal
    truth = np.array([math.log(r.objective) * sign if r.objective else math.nan
                      for r in (landscape.records[tuple(landscape.space.point_at(i).values())]
                                for i in legal)])
    ok = np.isfinite(truth)
    spread = float(np.std(truth[ok]))
    base = np.where(ok, truth, float(np.median(truth[ok])))
    scores = base + rng.normal(0.0, spread, len(base))
    rank = lambda a: np.argsort(np.argsort(a))  # noqa: E731
    rho = float(np.corrcoef(rank(scores[ok]), rank(truth[ok]))[0, 1])
    return dict(zip(legal, (float(s) for s in scores), strict=True)), rho


def run(task: Task) -> RunResult:
    landscape = landscape_at(task.landscape)
    prior: Prior | None = None
    if task.prior == "noisy":
        prior, _ = noisy_prior(landscape, NOISY_SEED + task.seed)
    elif task.prior.startswith("warm:"):
        prior, _ = warm_start_prior(landscape, landscape_at(task.prior[5:]))
    total = landscape.brute_force_s
    start = time.process_time()
    summary = replay(landscape, sampler=STRATEGIES[task.strategy], seed=task.seed,
                     budget_s=task.max_budget * total, prior=prior,
                     stop_at=landscape.optimum)
    cpu = time.process_time() - start
    curve = [b for b in CURVE if b <= task.max_budget + 1e-12]
    return RunResult(task, tuple(summary.quality_at(b * total) for b in curve),
                     tuple(summary.quality_at(b * total) for b in BUDGETS),
                     len(summary.trace), cpu)


def _init_worker() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def run_all(tasks: Sequence[Task], jobs: int, progress: Callable[[int, int], None]
            ) -> list[RunResult]:
    _init_worker()
    if jobs <= 1:
        out = []
        for i, t in enumerate(tasks):
            out.append(run(t))
            progress(i + 1, len(tasks))
        return out
    ctx = multiprocessing.get_context("forkserver")
    with ctx.Pool(jobs, initializer=_init_worker) as pool:
        out = []
        for i, r in enumerate(pool.imap_unordered(run, tasks, chunksize=1)):
            out.append(r)
            progress(i + 1, len(tasks))
        return out


# ---------------------------------------------------------------------------- reporting

@dataclass(frozen=True)
class Row:
    landscape: str
    strategy: str
    means: tuple[float, ...]
    p10s: tuple[float, ...]
    sems: tuple[float, ...]  # standard error of each mean (the seeds' spread / sqrt(runs))
    score: float
    runs: int
    cpu_ms_per_eval: float


def summarise(results: Sequence[RunResult], budgets: Sequence[float]) -> list[Row]:
    groups: dict[tuple[str, str], list[RunResult]] = defaultdict(list)
    for r in results:
        groups[(landscape_at(r.task.landscape).path.name.split(".")[0],
                r.task.label)].append(r)
    rows = []
    for (name, label), rs in sorted(groups.items()):
        b = np.array([r.budgets[: len(budgets)] for r in rs])
        c = np.array([r.curve for r in rs])
        evals = sum(r.evaluations for r in rs)
        sems = b.std(0, ddof=1) / math.sqrt(len(rs)) if len(rs) > 1 else np.full(b.shape[1], np.nan)
        rows.append(Row(name, label, tuple(b.mean(0)), tuple(np.percentile(b, 10, axis=0)),
                        tuple(sems), float(c.mean()), len(rs),
                        1e3 * sum(r.cpu_s for r in rs) / max(evals, 1)))
    return rows


def write_csv(rows: Sequence[Row], budgets: Sequence[float], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["landscape", "strategy", "budget_pct", "mean", "p10", "runs",
                    "score", "cpu_ms_per_eval", "mean_se"])
        for r in rows:
            for b, m, p, se in zip(budgets, r.means, r.p10s, r.sems, strict=True):
                w.writerow([r.landscape, r.strategy, f"{100 * b:g}", f"{m:.4f}", f"{p:.4f}",
                            r.runs, f"{r.score:.4f}", f"{r.cpu_ms_per_eval:.2f}", f"{se:.4f}"])


def write_transfer(rows: Sequence[Row], budgets: Sequence[float], path: Path) -> list[str]:
    base = {r.landscape: r for r in rows if r.strategy == "flashtune"}
    lines = []
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["target", "prior", "budget_pct", "mean", "mean_without", "gain_mean",
                    "p10", "p10_without", "gain_p10"])
        for r in rows:
            if "+" not in r.strategy or r.landscape not in base:
                continue
            b = base[r.landscape]
            gains = []
            for i, budget in enumerate(budgets):
                w.writerow([r.landscape, r.strategy.split("+", 1)[1], f"{100 * budget:g}",
                            f"{r.means[i]:.4f}", f"{b.means[i]:.4f}",
                            f"{r.means[i] - b.means[i]:+.4f}", f"{r.p10s[i]:.4f}",
                            f"{b.p10s[i]:.4f}", f"{r.p10s[i] - b.p10s[i]:+.4f}"])
                gains.append(f"{r.means[i] - b.means[i]:+.3f}/{r.p10s[i] - b.p10s[i]:+.3f}")
            lines.append(f"{r.landscape:22s} {r.strategy.split('+', 1)[1]:14s} "
                         + "  ".join(gains))
    return lines


def write_png(results: Sequence[RunResult], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups: dict[str, dict[str, list[tuple[float, ...]]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        name = landscape_at(r.task.landscape).path.name.split(".")[0]
        groups[name][r.task.label].append(r.curve)
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.8), squeeze=False)
    for ax, (name, by_label) in zip(axes[0], sorted(groups.items()), strict=True):
        for label, curves in sorted(by_label.items()):
            c = np.array(curves)
            x = [100 * b for b in CURVE[: c.shape[1]]]
            line, = ax.plot(x, c.mean(0), label=label, lw=2 if label == "flashtune" else 1)
            ax.plot(x, np.percentile(c, 10, axis=0), ls=":", color=line.get_color(), lw=1)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("budget (% of brute-force time)")
        ax.set_ylim(0.4, 1.01)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("best found / optimum (mean; dotted: p10)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _difference(ours: Row, other: Row, i: int) -> str:
    """The differences of budget ``i``: the mean's with its standard error (independent
    runs), and the 10th percentile's."""
    se = math.hypot(ours.sems[i], other.sems[i])
    noise = f"+- {se:.3f} s.e." if math.isfinite(se) else "(one run: no s.e.)"
    return (f"mean {ours.means[i] - other.means[i]:+.3f} {noise}, "
            f"p10 {ours.p10s[i] - other.p10s[i]:+.3f}")


def verdicts(rows: Sequence[Row], budgets: Sequence[float]) -> list[str]:
    """Does flashtune's default beat random and default TPE at every budget, in mean and
    10th percentile? Where it does not, the mean's difference with its standard error (so a
    miss within the seeds' noise reads as one). And the distance to the stretch goal."""
    by = {(r.landscape, r.strategy): r for r in rows}
    out = []
    for name in sorted({r.landscape for r in rows}):
        ours = by.get((name, "flashtune"))
        if ours is None:
            continue
        for rival in ("random", "tpe"):
            other = by.get((name, rival))
            if other is None:
                continue
            lost = [f"{100 * b:g}% ({_difference(ours, other, i)})" for i, b in enumerate(budgets)
                    if ours.means[i] <= other.means[i] or ours.p10s[i] <= other.p10s[i]]
            out.append(f"{name}: flashtune vs {rival}: "
                       + ("beats it at every budget (mean and p10)" if not lost
                          else f"does not beat it at {', '.join(lost)}"))
    ours_rows = [r for r in rows if r.strategy == "flashtune"]
    if ours_rows and len(budgets) >= 3:
        i2, i5 = budgets.index(0.02), budgets.index(0.05)
        m2 = float(np.mean([r.means[i2] for r in ours_rows]))
        m5 = float(np.mean([r.means[i5] for r in ours_rows]))
        p5 = min(r.p10s[i5] for r in ours_rows)
        out.append(f"stretch goal: mean at 2% {m2:.3f} (goal 0.95), mean at 5% {m5:.3f} "
                   f"(goal 0.98), lowest p10 at 5% {p5:.3f} (goal 0.90)")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", nargs="?", type=Path, default=DEFAULT_DIR,
                        help="landscape files (*.json.gz, *.json); default: %(default)s")
    parser.add_argument("--repeats", type=int, default=25,
                        help="seeded runs per landscape and strategy (seeds 0 to N-1); "
                             "default: %(default)s")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="worker processes; default: the CPU count (%(default)s)")
    parser.add_argument("--out", type=Path, default=Path("search-efficiency"),
                        help="folder for the CSVs and the PNG; default: %(default)s")
    parser.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                        help=f"comma-separated, from {', '.join(STRATEGIES)}; "
                             "default: %(default)s")
    parser.add_argument("--no-transfer", action="store_true",
                        help="skip the warm-start and noisy-prior runs")
    parser.add_argument("--quick", action="store_true",
                        help="seconds: one landscape, flashtune and random, 3 repeats, <= 2%%")
    args = parser.parse_args(argv)
    paths = sorted(args.directory.glob("*.json.gz")) + sorted(args.directory.glob("*.json"))
    if not paths:
        print(f"no landscapes (*.json.gz) in {args.directory}", file=sys.stderr)
        return 2
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        print(f"unknown strategies {unknown}; expected some of {list(STRATEGIES)}",
              file=sys.stderr)
        return 2
    budgets: tuple[float, ...] = BUDGETS
    repeats = args.repeats
    transfer = not args.no_transfer
    if args.quick:
        paths = [min(paths, key=lambda p: p.stat().st_size)]
        strategies, repeats, budgets, transfer = ["flashtune", "random"], 3, BUDGETS[:2], False
        args.jobs = 1  # a pool's start-up would cost more than these runs
    if repeats < 1:
        print(f"--repeats must be at least 1, got {repeats}", file=sys.stderr)
        return 2
    max_budget = budgets[-1]
    landscapes = [landscape_at(str(p)) for p in paths]
    tasks = [Task(str(L.path), s, seed, max_budget=max_budget)
             for L in landscapes for s in strategies for seed in range(repeats)]
    if transfer and "flashtune" in strategies:
        for L in landscapes:
            tasks += [Task(str(L.path), "flashtune", seed, "noisy", max_budget)
                      for seed in range(repeats)]
            for source in landscapes:
                if source is not L and source.kernel == L.kernel \
                        and source.space.names == L.space.names:
                    tasks += [Task(str(L.path), "flashtune", seed, f"warm:{source.path}",
                                   max_budget) for seed in range(repeats)]
    # the slow runs first, so that the pool's last tasks are short ones
    tasks.sort(key=lambda t: (t.strategy not in ("tpe", "tpe-multivariate", "gp"),
                              -os.path.getsize(t.landscape)))
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{len(landscapes)} landscape(s), {len(tasks)} runs on {args.jobs} process(es); "
          f"budgets {[f'{100 * b:g}%' for b in budgets]} of the brute-force time")
    for L in landscapes:
        extra = ""
        if transfer:
            extra = f", noisy prior rank correlation {noisy_prior(L, NOISY_SEED)[1]:.2f}"
        print(f"  {L.path.name}: {len(L.space.legal)} configs, brute force "
              f"{L.brute_force_s / 3600:.2f} h{extra}")
    start = time.perf_counter()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last[0] > 15 or done == total:
            last[0] = now
            print(f"  {done}/{total} runs, {now - start:.0f} s", flush=True)

    results = run_all(tasks, args.jobs, progress)
    rows = summarise(results, budgets)
    write_csv(rows, budgets, args.out / "search_efficiency.csv")
    header = "  ".join(f"{100 * b:>4g}% mean/p10" for b in budgets)
    print(f"\n{'landscape':22s} {'strategy':26s} {header}   score  ms/eval")
    for r in rows:
        cells = "  ".join(f"{m:.3f}/{p:.3f}    " for m, p in zip(r.means, r.p10s, strict=True))
        print(f"{r.landscape:22s} {r.strategy:26s} {cells}  {r.score:.3f}  "
              f"{r.cpu_ms_per_eval:6.2f}")
    if transfer:
        print("\ngain over flashtune without prior (mean/p10) at "
              + ", ".join(f"{100 * b:g}%" for b in budgets))
        for line in write_transfer(rows, budgets, args.out / "search_transfer.csv"):
            print(line)
    if write_png(results, args.out / "search_efficiency.png"):
        print(f"\nwrote {args.out / 'search_efficiency.png'}")
    print()
    for line in verdicts(rows, budgets):
        print(line)
    print(f"\n{time.perf_counter() - start:.0f} s wall, {args.out / 'search_efficiency.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
