"""One candidate from compile outcome to result: resource check -> verify -> time.

The order is the contract: nothing is timed before it is verified, and a measurer that is
not ``timed`` never yields a timing (its results are ``verified_untimed``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from flashtune.codegen.spec import KernelConfig
from flashtune.db.records import TrialStatus, truncate_error
from flashtune.errors import CompileError, DeviceError, EmulatorError, OutOfResources, TuningError
from flashtune.tuner.defaults import DEFAULT_MAX_SPILL_BYTES
from flashtune.tuner.measure.base import CompileOutcome, Measurer, ShapeTiming, TimingPlan
from flashtune.tuner.measure.workload import Workload, geomean

log = logging.getLogger("flashtune.tuner")

#: How the error text of a spill rejection starts; it tells those ``invalid`` trials (compiled,
#: never run) from the statically pruned ones (never compiled) when counting progress.
SPILL_ERROR_PREFIX = "register spills"

#: Failures a measurer may raise for a kernel (as opposed to bugs in the measurer itself).
KERNEL_FAILURES = (CompileError, DeviceError, EmulatorError, OutOfResources)


@dataclass(frozen=True)
class TrialResult:
    """What one candidate came to. Only ``ok`` results carry timings and an objective."""

    config: KernelConfig
    status: TrialStatus
    timings: tuple[ShapeTiming, ...] = ()
    tflops: float | None = None
    registers: int | None = None
    spill_bytes: int | None = None
    max_abs_error: float | None = None
    error: str | None = None
    #: GB/s (the shapes' least bytes over their median times), beside the time: the
    #: measure of a memory-bound op such as decoding.
    gb_per_s: float | None = None

    def __post_init__(self) -> None:
        timed = bool(self.timings) or self.tflops is not None
        if (self.status is TrialStatus.OK) != timed or (timed and self.tflops is None):
            raise TuningError(f"result of {self.config.key()} with status {self.status.value} "
                              "must carry timings and TFLOP/s exactly when it is 'ok'")

    @property
    def median_ms(self) -> float | None:
        """Geometric mean of the shapes' medians: orders configs exactly like the objective."""
        return geomean([t.median_ms for t in self.timings]) if self.timings else None

    @property
    def min_ms(self) -> float | None:
        return geomean([t.min_ms for t in self.timings]) if self.timings else None

    @property
    def objective(self) -> float | None:
        """What the search maximises: TFLOP/s (None unless ``ok``)."""
        return self.tflops

    def attrs(self) -> dict[str, float | int | str]:
        """What a study records about the trial besides its status and objective."""
        out: dict[str, float | int | str] = {}
        if self.error:
            out["error"] = self.error[:2000]
        if self.registers is not None:
            out["registers"] = self.registers
        if self.spill_bytes is not None:
            out["spill_bytes"] = self.spill_bytes
        if self.median_ms is not None:
            out["median_ms"] = self.median_ms
        if self.gb_per_s is not None:
            out["gb_per_s"] = self.gb_per_s
        return out

    @property
    def max_ms(self) -> float | None:
        return geomean([t.max_ms for t in self.timings]) if self.timings else None

    @property
    def count(self) -> int:
        return min(t.count for t in self.timings) if self.timings else 0


def evaluate(measurer: Measurer, workload: Workload, config: KernelConfig,
             compiled: CompileOutcome, plan: TimingPlan,
             max_spill_bytes: int = DEFAULT_MAX_SPILL_BYTES) -> TrialResult:
    """Turn a compiled candidate into a result (see the module docstring for the order)."""
    regs, spilled = compiled.registers, compiled.spill_bytes
    if compiled.status is not TrialStatus.OK:
        return TrialResult(config, compiled.status, error=compiled.error, registers=regs,
                           spill_bytes=spilled)
    spills = compiled.spill_bytes or 0
    if spills > max_spill_bytes:
        # Recorded as ``invalid``, the status of a config ruled out by a limit before it
        # runs (as static pruning does for shared memory and threads), rather than a status
        # of its own: it is never timed, never a best, and like every ``invalid`` config it
        # is settled for this kernel source, since its spills are a property of the compiled
        # source. A further status would need a schema migration and a bundle format change
        # for no different handling. One consequence: a later run with a higher
        # --max-spill-bytes skips these configs while their kernel source is unchanged.
        return TrialResult(
            config, TrialStatus.INVALID, error=(
                f"{SPILL_ERROR_PREFIX} of {spills} B per thread exceed the limit of "
                f"{max_spill_bytes} B (raise --max-spill-bytes to allow them)"),
            registers=regs, spill_bytes=spilled)
    problem = workload.problem
    try:
        verdict = measurer.verify(problem, config, workload.verify_shape)
    except KERNEL_FAILURES as exc:
        return TrialResult(config, TrialStatus.RUNTIME_FAILED,
                           error=truncate_error(f"{type(exc).__name__}: {exc}"),
                           registers=regs, spill_bytes=spilled)
    if verdict.status is not TrialStatus.OK:
        return TrialResult(config, verdict.status, max_abs_error=verdict.max_abs_error,
                           error=verdict.error, registers=regs, spill_bytes=spilled)
    if not measurer.timed:
        return TrialResult(config, TrialStatus.VERIFIED_UNTIMED,
                           max_abs_error=verdict.max_abs_error, registers=regs, spill_bytes=spilled)
    try:
        timings = measurer.time(problem, config, workload.shapes,
                                dataclasses.replace(plan, shape_class=workload.bucket.shape_class))
    except KERNEL_FAILURES as exc:
        return TrialResult(config, TrialStatus.RUNTIME_FAILED,
                           error=truncate_error(f"{type(exc).__name__}: {exc}"),
                           registers=regs, spill_bytes=spilled)
    if [t.shape for t in timings] != list(workload.shapes):
        raise TuningError(f"measurer timed {[t.shape.key() for t in timings]}, expected "
                          f"{[s.key() for s in workload.shapes]}")
    medians = [t.median_ms for t in timings]
    return TrialResult(config, TrialStatus.OK, timings=tuple(timings),
                       tflops=workload.objective(medians),
                       max_abs_error=verdict.max_abs_error, registers=regs, spill_bytes=spilled,
                       gb_per_s=workload.bandwidth(medians))
