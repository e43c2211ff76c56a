"""The guided search: which untried legal point to measure next, from what was measured.

The decision is made over a finite set of legal candidates (the search space filtered by
its legality rule; a sample of it when the space is too large to list), so no proposal is
ever spent on an impossible point or on one already measured:

1. A short initial design: without a prior, ``UNGUIDED_INIT`` points at random (the model
   explores from there: more blind points only spend a small budget); with a prior ranking
   (a cost model's prediction, another device's results), about one point per parameter
   that has a choice, half of them the prior's best.
2. Then a Gaussian process (surrogate.py) over the measurements (log of the objective,
   failures counted as bad as the worst measurement) ranks the untried candidates by
   expected improvement over the best so far, averaged with the expected improvement of the
   same model at its prior's relevances (relevances fitted from a few points can write a
   parameter value off everywhere after one bad measurement; the hedge keeps every
   direction in view), divided by their predicted measuring time
   (a second GP on the log of what each measurement took: compile, framework and runs). A
   budget is time, and cheap configs buy more evaluations; without that division the
   search spends its budget on slow compiles it could have skipped.
3. Up to ``SEQUENTIAL`` measurements each decision sees every result before it; beyond,
   one fitted model yields a batch (one more pick per ``BATCH_STEP`` further
   measurements), each pick damping the candidates correlated with it so that a batch
   spreads out. Hyperparameters are re-fitted as the sample grows by a quarter.
4. Candidates are all untried legal points when there are at most ``MAX_CANDIDATES``;
   else every untried neighbour (one parameter one step away) of the best measured points
   plus a random sample of the rest.

Nothing here knows what a parameter means: points are rows of value indices.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from flashtune.tuner.search.surrogate import (
    Encoding,
    FloatArray,
    GaussianProcess,
    IntArray,
    correlation,
    expected_improvement,
)

#: Observations kept in the model: the best half and a random sample of the rest.
MAX_TRAIN = 200
#: Candidates scored per decision when the untried set is larger.
MAX_CANDIDATES = 2000
#: Decisions stay one pick per fitted model up to this many measurements; beyond, a batch
#: grows by one pick per BATCH_STEP further measurements.
SEQUENTIAL = 100
BATCH_STEP = 25
#: Expected improvement is divided by the predicted measuring time to this power.
COST_POWER = 1.0
#: Measured points whose neighbours are always candidates.
TOP_NEIGHBOURHOODS = 5

# The hedge of step 2, measured against the same design without it (best found / optimum,
# mean / 10th percentile; convolution A6000 seeds 0-99, the others 0-49):
#   convolution A6000 at 1 %: 0.815 / 0.763 (without: 0.827 / 0.718; Optuna's TPE 0.790 /
#     0.759); convolution A100 at 1 %: 0.799 / 0.633 (0.804 / 0.624), at 2 %: 0.924 / 0.863
#     (0.890 / 0.700); convolution MI250X at 1 %: 0.933 / 0.675 (0.827 / 0.473).
# Relevances shrunk half way to the prior instead: 0.824 / 0.729 on A6000 at 1 %.
#
# Measured against the hedged design and not kept (A6000 seeds 0-99 at 1 %: 0.815 / 0.763;
# A100 seeds 0-49: 0.799 / 0.633 at 1 %, 0.924 / 0.863 at 2 %):
# - a linear trend along each ordered parameter added to the kernel (a run can spend 45
#   measurements on one value of a four-valued knob: the stationary kernel does not
#   extrapolate a trend): weight 1 on A6000 0.841 / 0.711, A100 at 2 % 0.913 / 0.825,
#   MI250X at 1 % 0.905 / 0.674 (hedged: 0.933 / 0.675); weight 0.25 with switches too
#   0.840 / 0.735 (A100 at 2 %: 0.894 / 0.735); the weight fitted 0.821 / 0.713 (A100 at
#   2 %: 0.870 / 0.641); the trend in the hedge's model only 0.831 / 0.722 (A100 at 2 %:
#   0.920 / 0.843). Twice as many A6000 runs leave the trap, but the tail grows.
# - after 10 measurements without improvement, every third pick only among candidates whose
#   correlation with the best point is below 0.3: 0.818 / 0.767; below 0.1: 0.826 / 0.763;
#   every second pick 0.820 / 0.734 (within the noise of 100 seeds, about 0.01).
# - a spread initial design (each of the 3 points the farthest from those before it, among
#   1000 random candidates): 0.824 / 0.763, A100 at 2 % 0.912 / 0.824; among 50: 0.809 /
#   0.734, A100 at 2 % 0.887 / 0.684.
# - coverage decisions: once the best had not improved for 5 measurements, every third
#   decision picked the best expected improvement per second among the candidates holding
#   the parameter value measured least often against its share of the legal points (when
#   below half its due; a trapped convolution A6000 run measures use_shmem=0 in 4-16 of 120
#   points, the optimum's value). Seeds 0-15: A6000 0.866 / 0.767 at 1 %, 0.905 / 0.775 at
#   2 %, 0.969 / 0.923 at 5 %; A100 0.879 / 0.699 at 2 %, 0.967 / 0.875 at 5 %; MI250X
#   0.946 / 0.770 at 2 %. The trap at 2 % stays, and the forced picks cost the other
#   landscapes their budget (A100 and MI250X at 2 % and 5 % well below the design's).
#
# Alternatives measured against the design without the hedge, none kept. Convolution A6000,
# seeds 0-99, best found / optimum at 1 % of the brute-force time, mean / 10th percentile
# (that design: 0.827 / 0.718; at 2 %: 0.909 / 0.778; Optuna's TPE: 0.790 / 0.759, at 2 %:
# 0.836 / 0.768):
# - Thompson sampling (a joint posterior draw over the 400 candidates of lowest mean - 2 sd,
#   its improvement per predicted second): 0.779 / 0.730; alternating with expected
#   improvement: 0.812 / 0.734; a GP-Hedge portfolio (EI, PI, LCB, Thompson): 0.824 / 0.723.
# - the product kernel alone (no additive part): 0.822 / 0.764, but 0.886 / 0.778 at 2 %,
#   and with the benchmark's 25 seeds 0.772 against TPE's 0.775 in the 10th percentile at
#   2 %. Pairs of parameters as the additive part: 0.819 / 0.734. Both models, the pick
#   by the larger expected improvement: 0.832 / 0.732 (2 %: 0.905 / 0.778); alternating
#   between them: 0.813 / 0.729 (2 %: 0.897 / 0.778). The prior of the product's share
#   centred at 0.88 instead of 0.5: 0.816 / 0.730.
# - a tighter prior on the relevances (log-normal variance 1 instead of 4): 0.815 / 0.734;
#   a random pick in 10 % of the decisions: 0.831 / 0.734; the cost to the power 0.5:
#   0.817 / 0.709; failures out of the regression, with a feasibility model: 0.816 / 0.661.
# - the targets warped: normal scores of their ranks 0.826 / 0.734 (but A100, seeds 0-49:
#   0.753 instead of 0.804 at 1 %, 0.873 instead of 0.890 at 2 %); Yeo-Johnson 0.821 /
#   0.728 (A100 at 1 %: 0.770); clipped at the 80th percentile 0.808 / 0.671; the log of
#   the distance above the best 0.813 / 0.670.
# - failures counted at the median (with normal scores): 0.831 / 0.739, at the 75th
#   percentile 0.830 / 0.767 (but A100 at 2 %: 0.817), left out 0.836 / 0.732.


#: Initial random points without a prior. Measured on the landscapes (25 seeds each):
#: 3 instead of one per parameter (9-10 there) raised the mean at 2 % of the brute-force
#: time from 0.890 to 0.919 (conv A100) and from 0.868 to 0.919 (conv A6000).
UNGUIDED_INIT = 3


def default_init(inputs: int, guided: bool) -> int:
    """Size of the initial design: with a prior, enough to see each parameter vary and
    little of a budget; without one, UNGUIDED_INIT (at most the parameters plus one)."""
    if not guided:
        return min(UNGUIDED_INIT, inputs + 1)
    return int(min(10, max(5, inputs + 1)))


class GuidedSearch:
    """The decision procedure of the module docstring over ``candidates`` (rows of value
    indices, one column per parameter, ``cardinalities`` values each)."""

    def __init__(self, cardinalities: Sequence[int], candidates: IntArray, *, seed: int | None,
                 prior: FloatArray | None = None, n_init: int | None = None) -> None:
        if candidates.ndim != 2 or candidates.shape[1] != len(cardinalities):
            raise ValueError(f"candidates must be rows of {len(cardinalities)} indices")
        self.cards = tuple(int(c) for c in cardinalities)
        self.rows = candidates
        self.rng = np.random.default_rng(seed)
        self.index = {tuple(int(v) for v in r): i for i, r in enumerate(candidates)}
        self.prior = _prior_ranks(prior, len(candidates)) if prior is not None else None
        self.n_init = (default_init(sum(c > 1 for c in self.cards), prior is not None)
                       if n_init is None else n_init)
        self.sequential = SEQUENTIAL
        self.cost_power = COST_POWER
        # the models see the parameters that vary (a constant tells them nothing)
        varying = [j for j, c in enumerate(self.cards) if c > 1]
        self._model_rows = candidates[:, varying]
        encoding = Encoding.of([self.cards[j] for j in varying])
        self.cost_gp = GaussianProcess(encoding)
        self.gp = GaussianProcess(encoding, extra=1 if self.prior is not None else 0)
        self._fitted_at = 0
        self._queue: list[int] = []
        self._queue_basis = 0
        self._batch = 0
        self._init_order = self._initial_design()

    # ------------------------------------------------------------------ public

    def row_of(self, indices: Sequence[int]) -> int | None:
        """The candidate row of a point given by value indices (None: not a candidate)."""
        return self.index.get(tuple(int(v) for v in indices))

    def suggest(self, observed: Mapping[int, float], pending: set[int],
                costs: Mapping[int, float] | None = None) -> int | None:
        """The next candidate row to measure. ``observed``: row -> loss (lower is better;
        NaN for a failure); ``pending``: rows being measured. None when every candidate
        is observed or pending."""
        taken = set(observed) | pending
        if len(taken) >= len(self.rows):
            return None
        n = len(observed)
        if n < self.n_init or not any(np.isfinite(v) for v in observed.values()):
            return self._initial(taken)
        # a batch is spent over as many decisions as it has picks (see the module docstring)
        while self._queue and n < self._queue_basis + self._batch:
            row = self._queue.pop(0)
            if row not in taken:
                return row
        self._queue = self._decide(observed, taken, costs or {})
        self._queue_basis, self._batch = n, len(self._queue)
        return self._queue.pop(0) if self._queue else self._random(taken)

    # ------------------------------------------------------------------ initial design

    def _initial_design(self) -> list[int]:
        order = [int(i) for i in self.rng.permutation(len(self.rows))]
        if self.prior is None:
            return order
        best = [int(i) for i in np.argsort(self.prior, kind="stable")[: (self.n_init + 1) // 2]]
        return best + [i for i in order if i not in set(best)]

    def _initial(self, taken: set[int]) -> int:
        for row in self._init_order:
            if row not in taken:
                return row
        return self._random(taken)

    def _random(self, taken: set[int]) -> int:
        free = np.setdiff1d(np.arange(len(self.rows)), np.fromiter(taken, int, len(taken)))
        return int(self.rng.choice(free))

    # ------------------------------------------------------------------ the model

    def _decide(self, observed: Mapping[int, float], taken: set[int],
                costs: Mapping[int, float]) -> list[int]:
        rows = np.fromiter(observed.keys(), dtype=np.int64, count=len(observed))
        y = np.fromiter(observed.values(), dtype=np.float64, count=len(observed))
        failed = ~np.isfinite(y)
        y[failed] = float(y[~failed].max())
        keep = self._training_subset(y)
        n = len(observed)
        refit = n < 20 or n >= 1.25 * self._fitted_at
        if refit:
            self._fitted_at = n
        self.gp.fit(self._model_rows[rows[keep]], self._extra(rows[keep]), y[keep],
                    optimise=refit)
        cand = self._candidates(rows, y, taken)
        if len(cand) == 0:
            return []
        acq, codes = self._hedged_improvement(cand)
        if len(costs) >= self.n_init:
            acq = acq / self._predicted_cost(costs, cand, refit)
        picks: list[int] = []
        for _ in range(min(self.batch_size(n), len(cand))):
            best = int(np.argmax(acq))
            picks.append(int(cand[best]))
            acq = acq * (1.0 - correlation(codes, best))
            acq[best] = -np.inf
        return picks

    def _hedged_improvement(self, cand: IntArray) -> tuple[FloatArray, FloatArray]:
        """Expected improvement of each candidate, averaged over the fitted model and the
        same model at the prior's relevances (step 2 of the module docstring), and the
        fitted model's codes (for the batch's damping)."""
        extra = self._extra(cand)
        mean, sd, codes = self.gp.predict(self._model_rows[cand], extra)
        acq = expected_improvement(mean, sd, self.gp.y_best)
        hedge = self.gp.at_prior_relevances()
        mean, sd, _ = hedge.predict(self._model_rows[cand], extra)
        return 0.5 * (acq + expected_improvement(mean, sd, hedge.y_best)), codes

    def _predicted_cost(self, costs: Mapping[int, float], cand: IntArray, refit: bool
                        ) -> FloatArray:
        """Each candidate's predicted measuring time relative to the typical one (a GP on
        log seconds): expected improvement per second is what a time budget buys."""
        rows = np.fromiter(costs.keys(), dtype=np.int64, count=len(costs))
        seconds = np.fromiter(costs.values(), dtype=np.float64, count=len(costs))
        y = np.log(np.maximum(seconds, 1e-6))
        keep = (np.arange(len(rows)) if len(rows) <= MAX_TRAIN
                else self.rng.choice(len(rows), MAX_TRAIN, replace=False))
        self.cost_gp.fit(self._model_rows[rows[keep]], None, y[keep], optimise=refit)
        mean, _, _ = self.cost_gp.predict(self._model_rows[cand], None)
        relative: FloatArray = np.exp(self.cost_power * mean * self.cost_gp.y_std)
        return relative

    def batch_size(self, n: int) -> int:
        """Picks per fitted model after ``n`` measurements."""
        return 1 + max(0, n - self.sequential) // BATCH_STEP

    def _extra(self, rows: IntArray) -> FloatArray | None:
        return None if self.prior is None else self.prior[rows][:, None]

    def _training_subset(self, y: FloatArray) -> IntArray:
        n = len(y)
        if n <= MAX_TRAIN:
            return np.arange(n)
        order = np.argsort(y, kind="stable")
        best = order[: MAX_TRAIN // 2]
        rest = self.rng.choice(order[MAX_TRAIN // 2:], MAX_TRAIN - len(best), replace=False)
        return np.concatenate([best, rest])

    def _candidates(self, rows: IntArray, y: FloatArray, taken: set[int]) -> IntArray:
        free = np.ones(len(self.rows), dtype=bool)
        free[np.fromiter(taken, int, len(taken))] = False
        cand = np.flatnonzero(free)
        if len(cand) <= MAX_CANDIDATES:
            return cand
        near = {r for top in rows[np.argsort(y, kind="stable")[:TOP_NEIGHBOURHOODS]]
                for r in self._neighbours(int(top)) if free[r]}
        sample = self.rng.choice(cand, MAX_CANDIDATES, replace=False)
        return np.unique(np.concatenate([sample, np.fromiter(near, int, len(near))]))

    def _neighbours(self, row: int) -> list[int]:
        point = self.rows[row]
        out = []
        for j, step in itertools.product(range(len(self.cards)), (-1, 1)):
            v = int(point[j]) + step
            if 0 <= v < self.cards[j]:
                moved = point.copy()
                moved[j] = v
                found = self.row_of(moved)
                if found is not None:
                    out.append(found)
        return out


def _prior_ranks(prior: FloatArray, n: int) -> FloatArray:
    """Prior scores (lower is better; NaN unknown) as ranks in [0, 1]; unknown -> 1."""
    if prior.shape != (n,):
        raise ValueError(f"the prior must score each of the {n} candidates")
    known = np.isfinite(prior)
    ranks = np.ones(n)
    if known.sum() > 1:
        order = np.argsort(prior[known], kind="stable")
        r = np.empty(len(order))
        r[order] = np.arange(len(order)) / (len(order) - 1)
        ranks[known] = r
    elif known.any():
        ranks[known] = 0.0
    return ranks
