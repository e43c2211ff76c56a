"""Choosing a bucket's winner so that the pick is stable across runs.

The search's raw measurements are single samples of noisy quantities, and the fastest of
many noisy samples is biased towards lucky ones. So the top few candidates (plus the
default config, for the speed-up) are re-measured together, in interleaved rounds with
a rotating order (drifts in clock or temperature hit all alike), each shape's time being the
median over rounds. Among the candidates within ``tolerance`` (2 %) of the best, the pick is
the default config if it is among them, else the simplest: least shared memory, then fewest
warps, fewest stages, smallest tiles, then the config key, a total order that does not
depend on the order in which the search happened to find them.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from flashtune import families
from flashtune.codegen.spec import KernelConfig
from flashtune.db.records import TrialStatus
from flashtune.errors import TuningError
from flashtune.tuner.defaults import DEFAULT_TOLERANCE
from flashtune.tuner.interrupt import checkpoint
from flashtune.tuner.measure.base import Measurer, ShapeTiming, TimingPlan
from flashtune.tuner.measure.evaluate import KERNEL_FAILURES, TrialResult
from flashtune.tuner.measure.workload import Workload


@dataclass(frozen=True)
class Scored:
    """A re-measured contender."""

    result: TrialResult
    is_default: bool

    @property
    def config(self) -> KernelConfig:
        return self.result.config

    @property
    def tflops(self) -> float:
        assert self.result.tflops is not None
        return self.result.tflops


def simplicity(workload: Workload, config: KernelConfig) -> tuple[int, int, int, int, int, str]:
    problem = workload.problem
    return (families.of(problem).smem_bytes(problem, config), config.num_warps,
            config.num_stages, config.block_m, config.block_n, config.key())


def choose(workload: Workload, scored: Sequence[Scored],
           tolerance: float = DEFAULT_TOLERANCE) -> Scored:
    """The winner among ``scored`` (see the module docstring for the rule)."""
    if not scored:
        raise TuningError(f"no timed candidate to choose from in {workload.bucket.key()}")
    if not 0 <= tolerance < 1:
        raise TuningError(f"tie tolerance {tolerance} must be in [0, 1), e.g. 0.02 for 2 %")
    best = max(s.tflops for s in scored)
    tied = [s for s in scored if s.tflops >= best * (1 - tolerance)]
    return min(tied, key=lambda s: (not s.is_default, simplicity(workload, s.config)))


def remeasure(measurer: Measurer, workload: Workload,
              configs: Sequence[KernelConfig], plan: TimingPlan, rounds: int
              ) -> list[TrialResult]:
    """Time ``configs`` again in ``rounds`` interleaved rounds; one result per config.

    A config that fails now (it passed before) comes back as ``runtime_failed``. A Ctrl-C
    under ``interrupt.deferred`` stops it between two timings, with nothing returned.
    """
    if rounds < 1:
        raise TuningError(f"re-measurement needs rounds >= 1, got {rounds}")
    samples: dict[KernelConfig, list[list[ShapeTiming]]] = {c: [] for c in configs}
    failed: dict[KernelConfig, str] = {}
    order = list(configs)
    for r in range(rounds):
        rotated = order[r % len(order):] + order[:r % len(order)] if order else []
        for config in rotated:
            if config in failed:
                continue
            checkpoint()
            try:
                samples[config].append(measurer.time(
                    workload.problem, config, workload.shapes,
                    dataclasses.replace(plan, shape_class=workload.bucket.shape_class)))
            except KERNEL_FAILURES as exc:
                failed[config] = f"failed when re-measured: {type(exc).__name__}: {exc}"
    out: list[TrialResult] = []
    for config in configs:
        if config in failed:
            out.append(TrialResult(config, TrialStatus.RUNTIME_FAILED, error=failed[config]))
            continue
        per_shape = list(zip(*samples[config], strict=True))
        timings = tuple(_combine(list(ts)) for ts in per_shape)
        tflops = workload.objective([t.median_ms for t in timings])
        out.append(TrialResult(config, TrialStatus.OK, timings=timings, tflops=tflops))
    return out


def _combine(timings: list[ShapeTiming]) -> ShapeTiming:
    return ShapeTiming(
        shape=timings[0].shape,
        median_ms=statistics.median(t.median_ms for t in timings),
        min_ms=min(t.min_ms for t in timings),
        max_ms=max(t.max_ms for t in timings),
        count=sum(t.count for t in timings),
    )
