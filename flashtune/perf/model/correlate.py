"""How well the cost model's PREDICTED times order configs the way measured ones do.

Reads the tuning database: per (device, problem, seqlen bucket), the ``ok`` trials that
carry both a measured ``median_ms`` and a ``predicted_ms``. A config measured several
times (the search, then the final re-measurements) counts once, with the median of its
measured medians and its latest prediction. Buckets with at least ``MIN_CONFIGS`` configs
get Spearman's rank correlation; the overall figure is the mean of the buckets' rho
weighted by their number of configs (times of different buckets are not comparable, so
they are never pooled into one ranking).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass

from flashtune.db.records import TrialStatus
from flashtune.db.store import TuningStore
from flashtune.perf.model.calibrate import spearman

MIN_CONFIGS = 3


@dataclass(frozen=True)
class BucketCorrelation:
    device: str
    problem: str
    seqlen: int
    n: int
    rho: float  # NaN when either side is constant


@dataclass(frozen=True)
class CorrelationReport:
    buckets: tuple[BucketCorrelation, ...]
    measured: int           # ok (timed) trials in the selection
    with_prediction: int    # of which carry a prediction

    @property
    def overall(self) -> float | None:
        """Mean rho over the buckets weighted by n (buckets with NaN rho left out)."""
        usable = [b for b in self.buckets if not math.isnan(b.rho)]
        if not usable:
            return None
        return sum(b.rho * b.n for b in usable) / sum(b.n for b in usable)


def correlate(store: TuningStore, device: str | None = None) -> CorrelationReport:
    """Rank correlations of predicted vs measured times in ``store`` (see the module)."""
    trials = store.trials(device=device, status=TrialStatus.OK)
    groups: dict[tuple[str, str, int], dict[str, tuple[list[float], float]]] = defaultdict(dict)
    with_prediction = 0
    for t in trials:
        if t.median_ms is None or t.predicted_ms is None:
            continue
        with_prediction += 1
        configs = groups[(t.device, t.problem.key, t.seqlen)]
        measured = configs[t.config.key][0] if t.config.key in configs else []
        configs[t.config.key] = ([*measured, t.median_ms], t.predicted_ms)
    out = []
    for (dev, problem, seqlen), configs in sorted(groups.items()):
        if len(configs) < MIN_CONFIGS:
            continue
        predicted = [p for _, p in configs.values()]
        measured = [statistics.median(m) for m, _ in configs.values()]
        out.append(BucketCorrelation(dev, problem, seqlen, len(configs),
                                     spearman(predicted, measured)))
    return CorrelationReport(tuple(out), len(trials), with_prediction)
