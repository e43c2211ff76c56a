"""flashtune's default strategy as an Optuna sampler (``--sampler guided``).

``GuidedSampler`` is a ``BaseSampler``: the study stays the one search loop (its storage,
resume, workers and dashboard), and the sampler only decides the parameters of the trial
it is asked for, with ``guided.GuidedSearch`` over the legal points of a ``SearchSpace``:

- completed trials are measurements (the log of the objective, its sign set by the study's
  direction, so lower is better for the model);
- pruned trials of legal points are failures (compile, runtime, wrong result, known from
  the database): data the model counts as bad as the worst measurement. Trials pruned by
  the cost model (``model_pruned``) are only never proposed again;
- running trials (this worker's compile-ahead queue, other workers) are pending: not
  proposed again while they run.

The trials are read incrementally, so a decision costs O(new trials) plus the model.
A prior (lower is better per point: a cost model's predicted time, another device's
measured time) guides the initial design and is an input of the model; see guided.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from flashtune.errors import TuningError
from flashtune.tuner.defaults import SAMPLERS
from flashtune.tuner.search.guided import GuidedSearch
from flashtune.tuner.search.space import Candidates, SearchSpace
from flashtune.tuner.search.study import (
    COST_ATTR,
    DUPLICATE_ATTR,
    MODEL_PRUNED_ATTR,
    TrialScan,
)

#: A prior score per point, by value indices (lower is better); missing points are unknown.
Prior = Mapping[tuple[int, ...], float]

C = TypeVar("C")


class SpaceSampler(optuna.samplers.BaseSampler):
    """A sampler that decides whole points of ``space``: every choice is sampled together
    (relative sampling); a parameter asked outside it gets a seeded random value."""

    def __init__(self, space: SearchSpace, seed: int | None) -> None:
        self.space = space
        self._fallback = optuna.samplers.RandomSampler(seed=seed)

    def reseed_rng(self) -> None:
        self._fallback.reseed_rng()

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial
                                    ) -> dict[str, BaseDistribution]:
        return dict(self.space.distributions())

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        return self._fallback.sample_independent(study, trial, param_name, param_distribution)


class GuidedSampler(SpaceSampler):
    """See the module docstring. ``n_init`` overrides the initial design's size."""

    def __init__(self, space: SearchSpace, *, seed: int | None = None,
                 prior: Prior | None = None, n_init: int | None = None) -> None:
        super().__init__(space, seed)
        legal = space.legal
        rows = np.array(legal, dtype=np.int64).reshape(len(legal), len(space.names))
        scores = None
        if prior is not None:
            scores = np.array([prior.get(p, math.nan) for p in legal], dtype=np.float64)
        self.search = GuidedSearch(space.cardinalities, rows, seed=seed, prior=scores,
                                   n_init=n_init)
        self._scan = TrialScan()
        self._values: dict[int, float] = {}  # row -> objective (NaN: failed)
        self._costs: dict[int, float] = {}  # row -> seconds its measurement took
        self._blocked: set[int] = set()  # rows never to propose again (model-pruned)
        self._study_id: int | None = None

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if not search_space:
            return {}
        if self._study_id != study._study_id:  # one sampler, one study
            self._study_id = study._study_id
            self._scan, self._values, self._blocked = TrialScan(), {}, set()
            self._costs = {}
        pending = self._read(study, trial.number)
        row = self.search.suggest(self._losses(study.direction), pending | self._blocked,
                                  self._costs)
        if row is None:
            return {}  # every legal point is taken: the independent (random) fallback
        choices = self.space.choices
        return {name: int(v) for name, v in zip(self.space.names, self.search.rows[row],
                                                strict=True) if name in choices}

    # ------------------------------------------------------------------ observations

    def _row(self, trial: FrozenTrial) -> int | None:
        try:
            indices = self.space.raw_indices(trial.params)
        except (KeyError, TypeError, ValueError):
            return None  # a trial of another encoding (an older study): not ours to read
        return self.search.row_of(indices)

    def _read(self, study: optuna.Study, current: int) -> set[int]:
        """Fold newly finished trials in; the rows of the unfinished ones (pending)."""
        finished, unfinished = self._scan.update(study)
        for t in finished:
            row = self._row(t)
            if row is None or row in self._values:
                continue
            cost = _cost(t)
            if cost is not None:
                self._costs[row] = cost
            if t.state is TrialState.COMPLETE and t.value is not None:
                self._values[row] = float(t.value)
            elif t.state is TrialState.PRUNED:
                if MODEL_PRUNED_ATTR in t.user_attrs:
                    self._blocked.add(row)
                else:
                    self._values[row] = math.nan
        return {row for t in unfinished if t.number != current and t.state is TrialState.RUNNING
                for row in [self._row(t)] if row is not None}

    def _losses(self, direction: StudyDirection) -> dict[int, float]:
        """Objectives as losses (lower is better): log scale when all are positive."""
        values = self._values
        finite = [v for v in values.values() if math.isfinite(v)]
        sign = -1.0 if direction is StudyDirection.MAXIMIZE else 1.0
        if finite and min(finite) > 0:
            return {r: sign * math.log(v) if math.isfinite(v) else math.nan
                    for r, v in values.items()}
        return {r: sign * v for r, v in values.items()}


def prior_of(candidates: Candidates[C], scores: Mapping[str, float]) -> Prior:
    """A prior given per config key (lower is better) as the sampler takes it."""
    out: dict[tuple[int, ...], float] = {}
    for config in candidates.configs:
        score = scores.get(candidates.key(config))
        if score is not None and math.isfinite(score):
            out[candidates.search_space.indices(candidates.domain.point(config))] = score
    return out


def make_sampler(kind: str, seed: int | None, space: SearchSpace,
                 prior: Prior | None = None) -> optuna.samplers.BaseSampler:
    """The sampler for ``--sampler`` on ``space``. ``grid`` is handled by the search (see
    proposers.py); ``prior`` (lower is better per point) guides ``guided`` only."""
    if kind not in SAMPLERS:
        raise TuningError(f"sampler {kind!r} is unknown; expected one of {list(SAMPLERS)}")
    if kind == "guided":
        return GuidedSampler(space, seed=seed, prior=prior)
    startup = max(4, min(10, len(space.legal) // 4))
    if kind == "tpe":
        # multivariate: the knobs interact (tile sizes vs warps vs stages); constant_liar:
        # trials still compiling or measuring (ours or other workers') repel new proposals.
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True,
                                          n_startup_trials=startup)
    if kind == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup)
    return optuna.samplers.RandomSampler(seed=seed)


def _cost(trial: FrozenTrial) -> float | None:
    """Seconds measuring ``trial`` took: what the measurement recorded, else its wall-clock
    duration; None for a trial that measured nothing (a duplicate, a pruned proposal)."""
    if DUPLICATE_ATTR in trial.user_attrs or MODEL_PRUNED_ATTR in trial.user_attrs:
        return None
    recorded = trial.user_attrs.get(COST_ATTR)
    if isinstance(recorded, int | float) and recorded > 0:
        return float(recorded)
    if trial.duration is not None and trial.duration.total_seconds() > 0:
        return trial.duration.total_seconds()
    return None
