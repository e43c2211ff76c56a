"""The measurer interface: compile, verify and time one config for a problem.

The tuner drives everything through this small interface, so the same search runs against
a GPU (``flashtune.tuner.measure.cuda``), against NVRTC plus the CPU emulator for dry runs
(``flashtune.tuner.measure.dry``, untimed), and against synthetic measurers in tests.

Compilation runs in a process pool while the device measures another candidate, so the
compiler is a separate, picklable callable that must be importable in a fresh process.
Failures are returned as outcomes with a status, never raised: a raising measurer is a bug
of the measurer, and the tuner records it as ``runtime_failed`` with the traceback text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.spec import KernelConfig, Problem, Shape
from flashtune.db.records import DeviceRecord, TrialStatus
from flashtune.errors import TuningError

#: The trial attribute of what measuring a trial cost in seconds (compile included), where
#: the measurement knows it better than the trial's wall-clock duration (a recorded
#: measurement's simulated clock).
COST_ATTR = "cost_s"

_COMPILE_STATUSES = (TrialStatus.OK, TrialStatus.COMPILE_FAILED, TrialStatus.INVALID)
_VERIFY_STATUSES = (TrialStatus.OK, TrialStatus.WRONG_RESULT, TrialStatus.RUNTIME_FAILED)


def _check_outcome(step: str, status: TrialStatus, allowed: tuple[TrialStatus, ...],
                   error: str | None) -> None:
    """A step's outcome is one of its statuses, and a failure carries its error text."""
    if status not in allowed:
        raise TuningError(f"{step} status {status!r} is not one of "
                          f"{[s.value for s in allowed]}")
    if status is not TrialStatus.OK and not error:
        raise TuningError(f"a {status.value} {step} outcome needs its error text")


@dataclass(frozen=True)
class CompileOutcome:
    """Result of compiling one config: status, resources read back, or the error text."""

    status: TrialStatus
    registers: int | None = None
    spill_bytes: int | None = None
    smem_bytes: int | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        _check_outcome("compile", self.status, _COMPILE_STATUSES, self.error)


@dataclass(frozen=True)
class VerifyOutcome:
    """Result of running one config on fresh random inputs against a reference."""

    status: TrialStatus
    max_abs_error: float | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        _check_outcome("verify", self.status, _VERIFY_STATUSES, self.error)


@dataclass(frozen=True)
class ShapeTiming:
    """Timings of one shape in milliseconds over ``count`` timed runs."""

    shape: Shape
    median_ms: float
    min_ms: float
    max_ms: float
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 < self.min_ms <= self.median_ms <= self.max_ms:
            raise TuningError(f"timing of {self.shape.key()} is inconsistent: need count >= 1 "
                              f"and 0 < min <= median <= max, got {self.count}, {self.min_ms}, "
                              f"{self.median_ms}, {self.max_ms}")


@dataclass(frozen=True)
class TimingPlan:
    """How to time: warm-up launches, timed repeats, whether to flush L2 before each, and
    the shape class of the bucket the inputs are laid out for (``ProblemBucket.shape_class``:
    ``KernelFamily.timing_inputs``; set per bucket by the tuner)."""

    warmup: int = 3
    repeats: int = 20
    flush_l2: bool = True
    shape_class: str = ""

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.repeats < 1:
            raise TuningError(f"timing plan needs warmup >= 0 and repeats >= 1, got "
                              f"{self.warmup}, {self.repeats}")


class Compiler(Protocol):
    """Compiles a config for the measurer's arch. Must be picklable (runs in a process pool)."""

    def __call__(self, problem: Problem, config: KernelConfig) -> CompileOutcome: ...


class Measurer(Protocol):
    """Compile, verify and time configs on one device (real, emulated or synthetic).

    ``timed`` is False for measurers whose timings mean nothing (the emulator): their
    results are recorded as ``verified_untimed`` and never used as performance.
    """

    @property
    def device(self) -> DeviceRecord:
        """The device as the database identifies it."""
        ...

    @property
    def arch(self) -> ArchSpec: ...

    @property
    def timed(self) -> bool: ...

    @property
    def compiler(self) -> Compiler: ...

    def verify(self, problem: Problem, config: KernelConfig, shape: Shape) -> VerifyOutcome:
        """Run ``config`` once on fresh random inputs of ``shape`` and compare."""
        ...

    def time(self, problem: Problem, config: KernelConfig, shapes: Sequence[Shape],
             plan: TimingPlan) -> list[ShapeTiming]:
        """Time ``config`` on each shape (only called when ``timed``)."""
        ...
