"""How fast do search strategies find the best config? Replayed on real GPU landscapes.

    python benchmarks/search_efficiency.py [DIR] [--repeats 25 | --seeds LIST] [--jobs N]
        [--out DIR]
        [--strategies flashtune,random,...] [--only NAMES] [--synthetic]
        [--charge-proposals] [--overhead TRIALS] [--journal PATH] [--quick]

Every landscape in DIR (default: ../shared/landscapes next to the repository where it
exists, else the two shipped with flashtune, flashtune/tuner/landscapes) is a
brute-forced search space of one kernel on one GPU (see its README). Each strategy runs
``--repeats`` seeded times (seeds 0 to N-1, or the ``--seeds`` given) through flashtune's
own search loop (``flashtune.tuner.replay``: an in-memory Optuna study, the proposal
screening, the pipeline) against the recorded
compile and run times on a simulated clock, up to 10 % of the brute-force time. Reported
per landscape, strategy and budget (1, 2, 5, 10 % of the brute-force time): the mean (with
its standard error over the runs) and the 10th percentile of best found / optimum, and an
aggregate score (the mean of best found / optimum over the budget curve from 0.5 % to 10 %
in steps of 0.5 %). A run stops early once it has found the optimum (nothing after it can
change its curve).

Strategies, each run with the same seeds: ``flashtune`` (the default of ``flashtune
tune``: the guided sampler), ``random``, ``tpe`` (Optuna's TPE with default settings: since
Optuna 5 these are multivariate with a constant liar), ``nsga2`` (Optuna's genetic sampler
with default settings), and, opt-in, ``tpe-multivariate`` (flashtune's previous default,
spelled out), ``gp`` (Optuna's GPSampler told each illegal or failed point as an infeasible
trial through its constraints, so its feasibility model learns them; each decision takes
about a second) and ``cmaes`` (Optuna's CMA-ES told each illegal or failed point as the
worst objective seen, a penalty: it has no constraint model; needs the optional extra
``search-bench``). Both run in a private study that settles an illegal proposal at once and
asks again, so the loop only receives legal points (``_peer_samplers.py``). Kernel Tuner's
strategies (``kt-genetic_algorithm``, ``kt-simulated_annealing``, ``kt-dual_annealing``,
``kt-pso``, ``kt-random_sample``, ``kt-bayes_opt``; ``kt-all`` for all six; optional extra
``search-bench``) run through its simulation mode on the landscape converted to its cache
format, with the same seeds and budgets on the same simulated clock (``_kernel_tuner.py``).

Besides, on each landscape: ``flashtune`` warm-started from every other device's landscape
of the same kernel (transfer), and ``flashtune`` with a deliberately noisy prior ranking
(the true log objective plus Gaussian noise of the same spread: what a cost model's
prediction is replaced by, so its gain is not circular). ``--synthetic`` adds two
SYNTHETIC landscapes, the attention forward's own space (d128 bf16, causal and not, 4096
tokens, an H100) as the cost model predicts it with noise (``_synthetic_landscape.py``):
a check of the sampler on a space of that size, not a measurement.

Per cell (landscape, rival, budget) the verdict is ``ahead`` (flashtune's mean and 10th
percentile at or above the rival's), ``within s.e.`` (behind by at most one standard error
of the difference: the mean's from the runs' spread, the 10th percentile's by bootstrap)
or ``behind``. ``--charge-proposals`` adds each proposal's CPU time to the simulated clock
(a strategy that thinks for seconds pays for it, as on a GPU that waits); every run
records it anyway, and the script prints the CPU time per proposal of each strategy and,
by default, flashtune's over 1,000 trials on the largest landscape (``--overhead``).
Writes ``search_efficiency.csv``, ``search_efficiency.md`` (the README's table with the
verdicts), ``search_transfer.csv`` and ``search_efficiency.png`` to ``--out``; with
``--journal PATH`` each finished run is appended to PATH at once and a rerun takes the runs
recorded there (a stopped run resumes where it stopped: ``_run_journal.py``; runs are
matched by the landscapes' file names, so the journals in ``benchmarks/records`` serve any
checkout); ``--quick``
is a seconds long run for CI (one landscape, two strategies, three repeats, budgets up to
2 %).

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
import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402
import optuna  # noqa: E402
from _common import add_benchmarks_to_path  # noqa: E402

add_benchmarks_to_path()

import _kernel_tuner as kt  # noqa: E402
import _run_journal as journal  # noqa: E402
import _synthetic_landscape as synthetic  # noqa: E402
from _peer_samplers import cmaes_sampler, gp_sampler  # noqa: E402

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
    return gp_sampler(space, seed)


def _cmaes(space: SearchSpace, seed: int | None, prior: Prior | None
           ) -> optuna.samplers.BaseSampler:
    return cmaes_sampler(space, seed)


def _flashtune(space: SearchSpace, seed: int | None, prior: Prior | None
               ) -> optuna.samplers.BaseSampler:
    return GuidedSampler(space, seed=seed, prior=prior)


STRATEGIES: dict[str, SamplerFactory] = {
    "flashtune": _flashtune, "random": _random, "tpe": _tpe,
    "tpe-multivariate": _tpe_multivariate, "nsga2": _nsga2, "gp": _gp, "cmaes": _cmaes,
}
DEFAULT_STRATEGIES = ("flashtune", "random", "tpe", "nsga2")
#: Kernel Tuner's strategies (optional: ``_kernel_tuner.py``), e.g. ``kt-genetic_algorithm``.
KT_STRATEGIES = tuple(f"{kt.PREFIX}{s}" for s in kt.STRATEGIES)


_LOADED: dict[str, Landscape] = {}


def landscape_at(path: str) -> Landscape:
    """Each landscape is read (or, for a ``synthetic:`` token, built) once per process."""
    if path not in _LOADED:
        _LOADED[path] = (synthetic.build(path) if path.startswith(synthetic.PREFIX)
                         else Landscape.load(path))
    return _LOADED[path]


def _size(path: str) -> int:
    """A landscape's size on disk (its evaluations' cost order); synthetic ones are small."""
    return 0 if path.startswith(synthetic.PREFIX) else os.path.getsize(path)


@dataclass(frozen=True)
class Task:
    """One seeded run: a strategy on a landscape, with an optional prior."""

    landscape: str      # path
    strategy: str
    seed: int
    prior: str = ""     # "", "noisy", or "warm:<path of the source landscape>"
    max_budget: float = BUDGETS[-1]
    charge: bool = False  # each proposal's CPU time is charged to the simulated clock

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
    proposal_s: tuple[float, ...] = ()  # CPU seconds of each proposal


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

    def rank(a: npt.NDArray[np.float64]) -> npt.NDArray[np.intp]:
        return np.argsort(np.argsort(a))

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
    if task.strategy.startswith(kt.PREFIX):
        summary = kt.run(landscape, kt.cache_for(landscape), task.strategy[len(kt.PREFIX):],
                         task.seed, task.max_budget * total)
    else:
        summary = replay(landscape, sampler=STRATEGIES[task.strategy], seed=task.seed,
                         budget_s=task.max_budget * total, prior=prior,
                         stop_at=landscape.optimum, charge_proposals=task.charge)
    cpu = time.process_time() - start
    curve = [b for b in CURVE if b <= task.max_budget + 1e-12]
    return RunResult(task, tuple(summary.quality_at(b * total) for b in curve),
                     tuple(summary.quality_at(b * total) for b in BUDGETS),
                     len(summary.trace), cpu, tuple(summary.proposal_s))


def _init_worker() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def journal_key(task: Task) -> tuple[object, ...]:
    """``task`` with its landscapes named by file name, not path: a journal recorded in one
    checkout (the records in ``benchmarks/records``) serves the same files anywhere."""
    prior = task.prior
    if prior.startswith("warm:"):
        prior = "warm:" + Path(prior[5:]).name
    return (Path(task.landscape).name, task.strategy, task.seed, prior, task.max_budget,
            task.charge)


def run_all(tasks: Sequence[Task], jobs: int, progress: Callable[[int, int], None],
            log: Path | None = None) -> list[RunResult]:
    """Every task's result; with ``log`` (a journal, ``_run_journal``) the runs recorded
    there are taken as they are and each new one is appended as it finishes."""
    _init_worker()
    recorded = journal.load(log, Task, RunResult) if log else {}
    done = {journal_key(t): r for t, r in recorded.items()}
    out = [dataclasses.replace(done[journal_key(t)], task=t) for t in tasks
           if journal_key(t) in done]
    todo = [t for t in tasks if journal_key(t) not in done]
    if out:
        print(f"  {len(out)} of {len(tasks)} runs read from {log}", flush=True)

    def finished(r: RunResult) -> None:
        out.append(r)
        if log:
            journal.append(log, r)
        progress(len(out), len(tasks))
    if jobs <= 1:
        for t in todo:
            finished(run(t))
        return out
    ctx = multiprocessing.get_context("forkserver")
    with ctx.Pool(jobs, initializer=_init_worker) as pool:
        for r in pool.imap_unordered(run, todo, chunksize=1):
            finished(r)
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
    p10_sems: tuple[float, ...] = ()  # bootstrap standard error of each 10th percentile

    def p10_se(self, i: int) -> float:
        return self.p10_sems[i] if i < len(self.p10_sems) else math.nan


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
                        tuple(sems), float(c.mean()) if c.size else math.nan, len(rs),
                        1e3 * sum(r.cpu_s for r in rs) / max(evals, 1),
                        tuple(_p10_se(b))))
    return rows


def _p10_se(b: np.ndarray, resamples: int = 400) -> np.ndarray:
    """Bootstrap standard error of the 10th percentile of each column (runs x budgets);
    NaN for a single run. Seeded: the same runs give the same figure."""
    if len(b) < 2:
        return np.full(b.shape[1], np.nan)
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(b), (resamples, len(b)))
    p10: np.ndarray = np.percentile(b[picks], 10, axis=1)  # resamples x budgets
    out: np.ndarray = p10.std(0, ddof=1)
    return out


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
    """The differences of budget ``i``: the mean's and the 10th percentile's, each with its
    standard error (independent runs: the two errors added in quadrature)."""
    def noise(a: float, b: float) -> str:
        se = math.hypot(a, b)
        return f"+- {se:.3f} s.e." if math.isfinite(se) else "(one run: no s.e.)"

    return (f"mean {ours.means[i] - other.means[i]:+.3f} {noise(ours.sems[i], other.sems[i])}, "
            f"p10 {ours.p10s[i] - other.p10s[i]:+.3f} "
            f"{noise(ours.p10_se(i), other.p10_se(i))}")


def cell_verdict(ours: Row, other: Row, i: int) -> str:
    """``ahead`` (mean and 10th percentile at or above the other's), ``within s.e.`` (where
    behind, by no more than one standard error of the difference), or ``behind``."""
    dm = ours.means[i] - other.means[i]
    dp = ours.p10s[i] - other.p10s[i]
    if dm >= 0 and dp >= 0:
        return "ahead"
    se_m = math.hypot(ours.sems[i], other.sems[i])
    se_p = math.hypot(ours.p10_se(i), other.p10_se(i))
    if (dm >= 0 or -dm <= se_m) and (dp >= 0 or -dp <= se_p):
        return "within s.e."
    return "behind"


def verdicts(rows: Sequence[Row], budgets: Sequence[float]) -> list[str]:
    """Is flashtune's default at or above every other strategy at every budget, in mean
    and 10th percentile? Where it is not, the differences with their standard errors and
    whether they are within one (a miss within the seeds' noise reads as one). Then a
    count of the cells, and the distance to the goal on the 10th percentile at 5 %."""
    by = {(r.landscape, r.strategy): r for r in rows}
    out = []
    counts: dict[str, int] = defaultdict(int)
    for name in sorted({r.landscape for r in rows}):
        ours = by.get((name, "flashtune"))
        if ours is None:
            continue
        rivals = sorted(r.strategy for r in rows
                        if r.landscape == name and r.strategy != "flashtune"
                        and "+" not in r.strategy)
        for rival in rivals:
            other = by[(name, rival)]
            cells = [cell_verdict(ours, other, i) for i in range(len(budgets))]
            for c in cells:
                counts[c] += 1
            lost = [f"{100 * b:g}% {c} ({_difference(ours, other, i)})"
                    for i, (b, c) in enumerate(zip(budgets, cells, strict=True)) if c != "ahead"]
            out.append(f"{name}: flashtune vs {rival}: "
                       + ("at or above it at every budget (mean and p10)" if not lost
                          else f"not above it at {'; '.join(lost)}"))
    if counts:
        out.append("cells (landscape x rival x budget): "
                   + ", ".join(f"{counts[k]} {k}" for k in ("ahead", "within s.e.", "behind")))
    ours_rows = [r for r in rows if r.strategy == "flashtune"]
    if ours_rows and 0.05 in budgets:
        i5 = budgets.index(0.05)
        worst = min(ours_rows, key=lambda r: r.p10s[i5])
        out.append(f"lowest 10th percentile at 5%: {worst.p10s[i5]:.3f} on {worst.landscape} "
                   "(goal 0.90)")
    return out


def proposal_times(results: Sequence[RunResult]) -> dict[str, tuple[float, float]]:
    """Per strategy label: the mean and the largest CPU seconds of one proposal."""
    times: dict[str, list[float]] = defaultdict(list)
    for r in results:
        times[r.task.label].extend(r.proposal_s)
    return {k: (float(np.mean(v)), float(np.max(v))) for k, v in times.items() if v}


def markdown_table(rows: Sequence[Row], budgets: Sequence[float]) -> list[str]:
    """The README's table: mean / 10th percentile per landscape, strategy and budget, and
    flashtune's verdict against each strategy per budget."""
    by = {(r.landscape, r.strategy): r for r in rows}
    head = " | ".join(f"{100 * b:g} %" for b in budgets)
    out = [f"| landscape | strategy | {head} |", "|---|---|" + "---|" * len(budgets)]
    for name in sorted({r.landscape for r in rows}):
        first = True
        ours = by.get((name, "flashtune"))
        for r in sorted((r for r in rows if r.landscape == name),
                        key=lambda r: (r.strategy != "flashtune", r.strategy)):
            cells = []
            for i in range(len(budgets)):
                cell = f"{r.means[i]:.3f} / {r.p10s[i]:.3f}"
                if ours is not None and r is not ours and "+" not in r.strategy:
                    cell += f" ({cell_verdict(ours, r, i)})"
                cells.append(cell)
            label = name.replace("_", " ") if first else ""
            out.append(f"| {label} | {r.strategy} | " + " | ".join(cells) + " |")
            first = False
    return out


@dataclass(frozen=True)
class Overhead:
    """CPU seconds per proposal of one strategy over a long run."""

    landscape: str
    configs: int
    strategy: str
    proposals: int
    mean_s: float
    p95_s: float
    max_s: float


def overhead(path: str, strategy: str, trials: int, seed: int = 0) -> Overhead:
    """Per-proposal CPU time of ``strategy`` over ``trials`` distinct configs on the
    landscape (no early stop: the decisions late in a long run cost the most)."""
    landscape = landscape_at(path)
    summary = replay(landscape, sampler=STRATEGIES[strategy], seed=seed, trials=trials)
    t = np.array(summary.proposal_s)
    return Overhead(landscape.path.name.split(".")[0], len(landscape.space.legal), strategy,
                    len(t), float(t.mean()), float(np.percentile(t, 95)), float(t.max()))


def seed_list(text: str) -> tuple[int, ...]:
    """``--seeds``: comma-separated seeds and inclusive ranges ("0-16,18-49"), sorted."""
    seeds: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} is not a seed or a range of seeds: expected numbers and "
                "inclusive ranges, comma-separated, e.g. 0-16,18-49") from None
        if low < 0 or high < low:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r}: a range goes up from a seed of 0 or more, e.g. 18-49")
        seeds.update(range(low, high + 1))
    return tuple(sorted(seeds))


def format_seeds(seeds: Sequence[int]) -> str:
    """Sorted seeds as inclusive ranges: (0, 1, 2, 5) -> "0-2, 5"."""
    spans: list[list[int]] = []
    for seed in seeds:
        if spans and seed == spans[-1][1] + 1:
            spans[-1][1] = seed
        else:
            spans.append([seed, seed])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", nargs="?", type=Path, default=DEFAULT_DIR,
                        help="landscape files (*.json.gz, *.json); default: %(default)s")
    runs = parser.add_mutually_exclusive_group()
    runs.add_argument("--repeats", type=int, default=25,
                      help="seeded runs per landscape and strategy (seeds 0 to N-1); "
                           "default: %(default)s")
    runs.add_argument("--seeds", type=seed_list, default=None, metavar="LIST",
                      help="these seeds instead of 0 to N-1: numbers and inclusive ranges, "
                           "comma-separated (0-16,18-49)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="worker processes; default: the CPU count (%(default)s)")
    parser.add_argument("--out", type=Path, default=Path("search-efficiency"),
                        help="folder for the CSVs and the PNG; default: %(default)s")
    parser.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                        help=f"comma-separated, from {', '.join(STRATEGIES)}, and Kernel "
                             f"Tuner's {', '.join(KT_STRATEGIES)} (or kt-all); "
                             "default: %(default)s")
    parser.add_argument("--no-transfer", action="store_true",
                        help="skip the warm-start and noisy-prior runs")
    parser.add_argument("--quick", action="store_true",
                        help="seconds: one landscape, flashtune and random, 3 repeats, <= 2%%")
    parser.add_argument("--only", default="",
                        help="comma-separated parts of landscape names to keep (e.g. "
                             "convolution_A100,dedispersion)")
    parser.add_argument("--synthetic", action="store_true",
                        help="add the SYNTHETIC landscapes of the attention forward (d128 bf16 "
                             "on an H100 as the cost model predicts it, with noise; causal "
                             "and not, 4096 tokens)")
    parser.add_argument("--charge-proposals", action="store_true",
                        help="charge each proposal's CPU time to the simulated clock (a "
                             "strategy's own decisions then cost it budget)")
    parser.add_argument("--journal", type=Path, default=None, metavar="PATH",
                        help="append each finished run to this JSON-lines file and take the "
                             "runs already there instead of running them again (a stopped "
                             "run resumes; seeded runs give the same results)")
    parser.add_argument("--overhead", type=int, default=1000, metavar="TRIALS",
                        help="measure flashtune's CPU time per proposal over this many "
                             "trials on the largest landscape (0: skip); default: "
                             "%(default)s")
    args = parser.parse_args(argv)
    found = sorted(args.directory.glob("*.json.gz")) + sorted(args.directory.glob("*.json"))
    tokens = [str(p) for p in found]
    if args.synthetic:
        tokens += [synthetic.name(causal=False), synthetic.name(causal=True)]
    if args.only:
        keep = [k.strip() for k in args.only.split(",") if k.strip()]
        tokens = [t for t in tokens if any(k in Path(t).name for k in keep)]
    paths = [Path(t) for t in tokens if not t.startswith(synthetic.PREFIX)]
    if not tokens:
        print(f"no landscapes (*.json.gz) in {args.directory}", file=sys.stderr)
        return 2
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    strategies = [k for s in strategies for k in (KT_STRATEGIES if s == "kt-all" else (s,))]
    unknown = [s for s in strategies if s not in STRATEGIES and s not in KT_STRATEGIES]
    if unknown:
        print(f"unknown strategies {unknown}; expected some of "
              f"{list(STRATEGIES) + list(KT_STRATEGIES)}", file=sys.stderr)
        return 2
    if any(s in KT_STRATEGIES for s in strategies) and not kt.available():
        print(kt.INSTALL_HINT, file=sys.stderr)
        return 2
    if "cmaes" in strategies and importlib.util.find_spec("cmaes") is None:
        print("strategy cmaes needs the cmaes package: pip install 'flashtune[search-bench]' "
              "(or leave cmaes out of --strategies)", file=sys.stderr)
        return 2
    budgets: tuple[float, ...] = BUDGETS
    if args.seeds is None and args.repeats < 1:
        print(f"--repeats must be at least 1, got {args.repeats}", file=sys.stderr)
        return 2
    seeds = tuple(range(args.repeats)) if args.seeds is None else args.seeds
    transfer = not args.no_transfer
    if args.quick:
        tokens = [str(min(paths, key=lambda p: p.stat().st_size))]
        strategies, seeds, budgets = ["flashtune", "random"], (0, 1, 2), BUDGETS[:2]
        transfer = False
        args.jobs = 1  # a pool's start-up would cost more than these runs
        args.overhead = 0
    max_budget = budgets[-1]
    charge = args.charge_proposals
    landscapes = [landscape_at(t) for t in tokens]
    tasks = [Task(t, s, seed, max_budget=max_budget, charge=charge)
             for t in tokens for s in strategies for seed in seeds]
    if transfer and "flashtune" in strategies:
        for t, L in zip(tokens, landscapes, strict=True):
            tasks += [Task(t, "flashtune", seed, "noisy", max_budget, charge)
                      for seed in seeds]
            for source in landscapes:
                if source is not L and source.kernel == L.kernel \
                        and source.space.names == L.space.names:
                    tasks += [Task(t, "flashtune", seed, f"warm:{source.path}",
                                   max_budget, charge) for seed in seeds]
    # the slow runs first, so that the pool's last tasks are short ones
    tasks.sort(key=lambda t: (t.strategy not in ("tpe", "tpe-multivariate", "gp"),
                              -_size(t.landscape)))
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{len(landscapes)} landscape(s), {len(tasks)} runs on {args.jobs} process(es); "
          f"budgets {[f'{100 * b:g}%' for b in budgets]} of the brute-force time; seeds "
          f"{format_seeds(seeds)} for every strategy; proposal time "
          f"{'charged to' if charge else 'not charged to'} the simulated clock")
    for L in landscapes:
        extra = ""
        if transfer:
            extra = f", noisy prior rank correlation {noisy_prior(L, NOISY_SEED)[1]:.2f}"
        if L.path.name.startswith("synthetic"):
            extra += " (SYNTHETIC: cost-model predictions with noise, nothing measured)"
        print(f"  {L.path.name}: {len(L.space.legal)} configs, brute force "
              f"{L.brute_force_s / 3600:.2f} h{extra}")
    start = time.perf_counter()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last[0] > 15 or done == total:
            last[0] = now
            print(f"  {done}/{total} runs, {now - start:.0f} s", flush=True)

    results = run_all(tasks, args.jobs, progress, args.journal)
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
    print("\nCPU seconds per proposal (mean / max over every run's proposals):")
    for label, (mean, worst) in sorted(proposal_times(results).items()):
        print(f"  {label:26s} {mean:.4f} / {worst:.3f}")
    markdown = markdown_table(rows, budgets)
    (args.out / "search_efficiency.md").write_text("\n".join(markdown) + "\n")
    print()
    for line in verdicts(rows, budgets):
        print(line)
    if args.overhead > 0:
        largest = max(tokens, key=lambda t: len(landscape_at(t).space.legal))
        o = overhead(largest, "flashtune", args.overhead)
        print(f"\noverhead of flashtune per proposal over {o.proposals} trials on {o.landscape} "
              f"({o.configs} configs): mean {o.mean_s:.3f} s, 95th percentile {o.p95_s:.3f} s, "
              f"max {o.max_s:.3f} s (CPU time)")
    print(f"\n{time.perf_counter() - start:.0f} s wall, {args.out / 'search_efficiency.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
