"""Writing results to the tuning database, and reading back what must not be retried (and
a bucket's progress summarised from its rows, for workers in other processes).

Every trial is recorded with the digest of the exact kernel source it measured
(``KernelSource.digest``), so a failure is skipped in later runs only while the kernel
source is unchanged; editing a template makes the config worth trying again.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Sequence

from flashtune.codegen.spec import KernelConfig, Problem, ProblemBucket
from flashtune.db.records import (
    FAILED_STATUSES,
    DeviceRecord,
    Keyed,
    TrialRecord,
    TrialStatus,
    truncate_error,
)
from flashtune.db.store import TuningStore
from flashtune.families import render
from flashtune.tuner.measure.evaluate import SPILL_ERROR_PREFIX, TrialResult
from flashtune.tuner.options import STATIC_REJECTIONS, BucketSummary


@functools.lru_cache(maxsize=4096)
def source_digest(problem: Problem, config: KernelConfig) -> str:
    """Digest of the kernel source of ``config`` (rendering is pure and cheap)."""
    return render(problem, config).digest


class ResultLog:
    """Records one bucket's results on one device; knows the bucket's past failures."""

    def __init__(self, store: TuningStore, device: DeviceRecord, bucket: ProblemBucket,
                 study: str | None) -> None:
        self.store = store
        self.device = device
        self.bucket = bucket
        self.study = study

    def past_outcomes(self) -> dict[str, TrialStatus]:
        """Config key -> the status to reuse, for configs already settled with their current
        source: a failure (never retried), or ``verified_untimed`` (dry runs skip those)."""
        problem = self.bucket.problem
        found = self.store.outcomes(self.device.name, problem.key(), self.bucket.seqlen,
                                    self.bucket.shape_class)
        out: dict[str, TrialStatus] = {}
        for key, by_digest in found.items():
            try:
                config = KernelConfig.from_key(key)
            except ValueError:
                continue  # a config of another kernel family or version
            statuses = by_digest.get(source_digest(problem, config), frozenset())
            failed = sorted(s.value for s in statuses & FAILED_STATUSES)
            if failed:
                out[key] = TrialStatus(failed[0])
            elif TrialStatus.VERIFIED_UNTIMED in statuses:
                out[key] = TrialStatus.VERIFIED_UNTIMED
        return out

    def known_failures(self) -> dict[str, TrialStatus]:
        return {k: s for k, s in self.past_outcomes().items() if s in FAILED_STATUSES}

    def to_record(self, result: TrialResult, predicted_ms: float | None = None) -> TrialRecord:
        """The database row of ``result``; ``predicted_ms`` is the cost model's PREDICTED
        time of the config on the bucket (prediction.py), stored beside the measurement."""
        problem = self.bucket.problem
        ok = result.status is TrialStatus.OK
        return TrialRecord(
            device=self.device.name,
            problem=Keyed.of(problem),
            seqlen=self.bucket.seqlen,
            shape_class=self.bucket.shape_class,
            config=Keyed.of(result.config),
            status=result.status,
            template_digest=source_digest(problem, result.config),
            median_ms=result.median_ms if ok else None,
            min_ms=result.min_ms if ok else None,
            max_ms=result.max_ms if ok else None,
            count=result.count if ok else 0,
            tflops=result.tflops if ok else None,
            error=truncate_error(result.error) if result.error else None,
            predicted_ms=predicted_ms,
            study=self.study,
        )

    def record(self, result: TrialResult, predicted_ms: float | None = None) -> TrialRecord:
        """Store one result (an ``ok`` one becomes the bucket's best if strictly faster)."""
        record = self.to_record(result, predicted_ms)
        self.store.record_trial(record)
        return record

    def crown(self, result: TrialResult, predicted_ms: float | None = None) -> TrialRecord:
        """Store the final, re-measured winner and make it the bucket's best outright.

        The winner is chosen by re-measurement with a tie tolerance, which may prefer a
        config that is not the single fastest raw measurement; it replaces the best.
        """
        record = self.record(result, predicted_ms)
        self.store.set_best(record.uid)
        return record


def summarize_records(summary: BucketSummary, records: Sequence[TrialRecord],
                      static_rejections: int = 0) -> BucketSummary:
    """Fill a summary's counts from database rows (progress of workers in other processes);
    ``static_rejections``: the configs the static rules excluded (counted, never rows)."""
    summary.statuses = Counter(r.status.value for r in records)
    if static_rejections:
        summary.statuses[STATIC_REJECTIONS] = static_rejections
    # configs measured (a finalist re-measured at the end has several records)
    summary.measured = len({r.config.key for r in records if r.status is not TrialStatus.INVALID
                            or (r.error or "").startswith(SPILL_ERROR_PREFIX)})
    timed = [r for r in records if r.tflops is not None]
    if timed:
        best = max(timed, key=lambda r: r.tflops or 0.0)
        summary.best_tflops = best.tflops
        summary.best_config = KernelConfig.from_key(best.config.key)
    return summary


def warm_start_scores(store: TuningStore, device: str, bucket: ProblemBucket
                      ) -> tuple[dict[str, float], str]:
    """Another device's measured results of ``bucket`` as prior scores (config key ->
    -log TFLOP/s, lower is better), and a line that says what was used.

    The bucket's own sequence length when the device has it, else its nearest (in log
    scale) of the same problem: a config's rank carries over between nearby buckets."""
    rows = store.trials(device=device, problem=bucket.problem.key(), status=TrialStatus.OK)
    timed = [r for r in rows if r.tflops is not None and r.tflops > 0]
    same_class = [r for r in timed if r.shape_class == bucket.shape_class]
    timed = same_class or timed  # another class's ranks still beat none
    if not timed:
        return {}, (f"warm start from {device}: no timed results of {bucket.problem.key()} "
                    "in the database; searching without it")
    lengths = {r.seqlen for r in timed}
    seqlen = min(lengths, key=lambda n: (abs(math.log2(n / bucket.seqlen)), n))
    scores: dict[str, float] = {}
    for r in timed:
        if r.seqlen == seqlen:
            score = -math.log(r.tflops or 1.0)
            scores[r.config.key] = min(score, scores.get(r.config.key, score))
    return scores, (f"warm start from {device}: {len(scores)} measured configs of "
                    f"{bucket.problem.key()}_n{seqlen}")
