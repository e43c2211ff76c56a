"""``replay()``: the tuner's search loop run against a recorded landscape.

The same pieces as a tuning run on a GPU: an Optuna study (in memory), ``OptunaSearch``
screening each proposal (impossible points pruned for free, re-proposals answered from the
study, the budget in configs), the pipeline, and a sampler. Only the measurement differs:
``RecordedMeasurer`` answers from the landscape and advances a simulated clock, which is
what a time budget counts here. The result is the run's trace: after each evaluation the
simulated time spent and the best objective so far, from which the benchmark reads the
quality reached at any budget.

A warm start is another landscape of the same kernel (another device): its recorded
objectives are the sampler's prior (see search/sampler.py).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import optuna

from flashtune.db.records import TrialStatus
from flashtune.errors import TuningError
from flashtune.tuner.landscape import Landscape
from flashtune.tuner.measure.recorded import Config, RecordedMeasurer, RecordedResult
from flashtune.tuner.pipeline import Limits, run_pipeline
from flashtune.tuner.search.proposers import OptunaSearch, Proposal
from flashtune.tuner.search.sampler import Prior, make_sampler
from flashtune.tuner.search.space import Candidates, PointDomain, SearchSpace
from flashtune.tuner.search.study import quiet_optuna

optuna.logging.set_verbosity(optuna.logging.WARNING)

#: Builds a run's sampler: (space, seed, prior) -> sampler.
SamplerFactory = Callable[[SearchSpace, "int | None", "Prior | None"],
                          optuna.samplers.BaseSampler]


@dataclass(frozen=True)
class TracePoint:
    """The state of a replayed run after one evaluation."""

    clock_s: float
    config: Config
    status: TrialStatus
    objective: float | None
    best: float | None  # best objective so far (None until one succeeded)


@dataclass
class ReplaySummary:
    """What a replayed run came to."""

    landscape: Landscape
    sampler: str
    budget_s: float | None
    trials: int | None
    warm_start: str | None = None
    trace: list[TracePoint] = field(default_factory=list)
    #: CPU seconds of each proposal (the strategy's own decision plus the loop's screening)
    proposal_s: list[float] = field(default_factory=list)
    #: whether those seconds were charged to the simulated clock
    charged_proposals: bool = False

    @property
    def clock_s(self) -> float:
        return self.trace[-1].clock_s if self.trace else 0.0

    @property
    def best(self) -> float | None:
        return self.trace[-1].best if self.trace else None

    @property
    def best_config(self) -> Config | None:
        best = self.best
        return next((p.config for p in self.trace if p.objective == best), None)

    def quality_at(self, budget_s: float) -> float:
        """Best found / optimum among the evaluations finished within ``budget_s``."""
        best = None
        for p in self.trace:
            if p.clock_s > budget_s:
                break
            best = p.best
        return self.landscape.quality(best)

    @property
    def failures(self) -> int:
        return sum(p.status.failed for p in self.trace)


class ReplayObserver:
    """Receives progress (the command's live display implements it)."""

    def started(self, summary: ReplaySummary) -> None: ...

    def evaluated(self, summary: ReplaySummary, point: TracePoint) -> None: ...


def warm_start_prior(landscape: Landscape, source: Landscape) -> tuple[Prior, str]:
    """``source``'s recorded objectives as a prior on ``landscape`` (lower is better),
    and a line saying what was used."""
    if source.space.names != landscape.space.names:
        raise TuningError(f"cannot warm-start {landscape.path.name} from {source.path.name}: "
                          f"parameters {list(source.space.names)} differ from "
                          f"{list(landscape.space.names)}")
    sign = 1.0 if source.minimize else -1.0
    scores: dict[Config, float] = {c: sign * math.log(r.objective)
                                   for c, r in source.records.items()
                                   if r.objective is not None and r.objective > 0}
    prior: dict[tuple[int, ...], float] = {}
    for indices in landscape.space.legal:
        config = tuple(landscape.space.point_at(indices).values())
        if config in scores:
            prior[indices] = scores[config]
    note = (f"warm start from {source.device}: {len(scores)} recorded results of "
            f"{source.kernel} ({source.path.name})")
    return prior, note


class _TimedProposer:
    """The search with each proposal's CPU time recorded in ``summary.proposal_s`` and,
    when ``charge``, added to the simulated clock: a strategy whose decisions take
    seconds then pays for them as a real tuning run does (the GPU idles meanwhile)."""

    def __init__(self, search: OptunaSearch[Config], measurement: RecordedMeasurer,
                 summary: ReplaySummary, charge: bool) -> None:
        self._search = search
        self._measurement = measurement
        self._summary = summary
        self._charge = charge

    def propose(self) -> Proposal[Config] | None:
        # process time, not wall time: other processes on a shared machine do not count
        start = time.process_time()
        proposal = self._search.propose()
        spent = time.process_time() - start
        self._summary.proposal_s.append(spent)
        if self._charge:
            self._measurement.clock_s += spent
        return proposal

    def tell(self, proposal: Proposal[Config], result: RecordedResult) -> None:
        self._search.tell(proposal, result)

    def abandon(self, proposal: Proposal[Config]) -> None:
        self._search.abandon(proposal)


def replay(landscape: Landscape, *, sampler: str | SamplerFactory = "guided",
           seed: int | None = 0, budget_s: float | None = None, trials: int | None = None,
           prior: Prior | None = None, warm_start: str | None = None,
           stop_at: float | None = None, observer: ReplayObserver | None = None,
           charge_proposals: bool = False) -> ReplaySummary:
    """Run the search on ``landscape`` until ``budget_s`` simulated seconds or ``trials``
    distinct configs are spent (or the space is exhausted, or a result at least as good as
    ``stop_at`` is found). ``sampler``: a ``--sampler`` name or a factory; ``warm_start``
    labels the prior in the summary. Each proposal's CPU time is recorded
    (``proposal_s``); ``charge_proposals`` also adds it to the simulated clock."""
    if budget_s is None and trials is None:
        raise TuningError("a replay needs a budget: a time (--budget 5% or 10m) or --trials")
    space = landscape.space
    factory: SamplerFactory
    if isinstance(sampler, str):
        kind = sampler
        factory = lambda s, sd, p: make_sampler(kind, sd, s, p)  # noqa: E731
    else:
        factory = sampler
    name = sampler if isinstance(sampler, str) else getattr(sampler, "__name__", "custom")
    with quiet_optuna():
        study = optuna.create_study(
            direction="minimize" if landscape.minimize else "maximize",
            sampler=factory(space, seed, prior))
    candidates = Candidates(PointDomain(space))
    search = OptunaSearch(study, candidates, contextlib.nullcontext(), known_failed={},
                          grid=sampler == "grid", seed=seed, budget=trials,
                          record_values=False)
    measurement = RecordedMeasurer(landscape.records, landscape.path.name)
    summary = ReplaySummary(landscape, name, budget_s, trials, warm_start,
                            charged_proposals=charge_proposals)
    observer = observer or ReplayObserver()
    better: Callable[[float, float], bool] = ((lambda a, b: a < b) if landscape.minimize
                                              else (lambda a, b: a > b))
    done = False

    def on_result(proposal: Proposal[Config], result: RecordedResult) -> None:
        nonlocal done
        best = summary.best
        if result.objective is not None and (best is None or better(result.objective, best)):
            best = result.objective
        point = TracePoint(result.clock_s, result.config, result.status, result.objective,
                           best)
        summary.trace.append(point)
        observer.evaluated(summary, point)
        done = stop_at is not None and best is not None and not better(stop_at, best)

    limits = _ReplayLimits(trials if trials is not None else len(space.legal),
                           budget_s, measurement.now, lambda: done)
    observer.started(summary)
    try:
        run_pipeline(measurement, _TimedProposer(search, measurement, summary,
                                                 charge_proposals),
                     limits, depth=1, on_result=on_result)
    finally:
        search.close()
    return summary


@dataclass(frozen=True)
class _ReplayLimits(Limits):
    """Limits on the simulated clock that also stop once ``stop()`` says so."""

    stop: Callable[[], bool] = lambda: False

    def expired(self) -> bool:
        return self.stop() or super().expired()
