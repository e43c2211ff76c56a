"""Options of a tuning run, and what a run reports per bucket."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from flashtune import settings
from flashtune.codegen.spec import KernelConfig, ProblemBucket
from flashtune.errors import TuningError
from flashtune.families.fixed import Fixed
from flashtune.tuner.defaults import DEFAULT_MAX_SPILL_BYTES, DEFAULT_TOLERANCE, SAMPLERS
from flashtune.tuner.measure.base import TimingPlan
from flashtune.tuner.search.prediction import BucketPrediction
from flashtune.tuner.search.study import Heartbeat


@dataclass(frozen=True)
class TuneOptions:
    """How to search each bucket.

    ``trials``: candidates measured per bucket's study, by all its workers and runs together
    (compiled, verified and timed, or failed); proposals rejected before compiling
    (impossible, known to fail, already measured) do not count. Dry runs: candidates
    verified per run.
    ``budget_s``: wall-clock budget of the whole run in seconds (compiles included); the
    trial in progress finishes.
    ``sampler``: the search strategy (``guided``, flashtune's default: see
    search/sampler.py). ``warm_start_from``: a device whose results of the same bucket in
    the database guide the search (instead of the cost model's predictions).
    ``resume``: continue existing studies (without it an existing study with trials is an
    error).
    ``compile_workers``: NVRTC processes (0 compiles inline; default: the
    FLASHTUNE_COMPILE_WORKERS setting); ``depth``: proposals compiled ahead of the device
    (default: compile_workers + 1).
    ``final_top`` candidates (plus the default config) are re-measured ``final_rounds``
    times with ``final_plan`` and the winner chosen with ``tie_tolerance`` (selection.py).
    ``search``/``finalize`` switch the two phases (several workers search; one finalizes).
    ``predicted_seeds``: after the default config, this many best-PREDICTED configs (cost
    model) are measured first. ``prune_predicted``: skip configs predicted more than this
    factor slower than the best prediction (None: prune nothing). ``cost_model_gpu``: the
    GPU of the predictions (default: the device's own when the model's table knows it).
    ``fixed``: knobs of the family's space held at one value (``families.fixed``, ``--fix``);
    the search walks the rest, under a study of its own.
    """

    trials: int = 40
    budget_s: float | None = None
    sampler: str = "guided"
    seed: int | None = 0
    study_prefix: str | None = None
    resume: bool = False
    compile_workers: int = field(default_factory=settings.COMPILE_WORKERS.get)
    depth: int | None = None
    plan: TimingPlan = TimingPlan()
    final_plan: TimingPlan = TimingPlan(warmup=5, repeats=50)
    final_top: int = 3
    final_rounds: int = 3
    tie_tolerance: float = DEFAULT_TOLERANCE
    max_spill_bytes: int = DEFAULT_MAX_SPILL_BYTES
    heartbeat: Heartbeat = Heartbeat()
    search: bool = True
    finalize: bool = True
    predicted_seeds: int = 3
    prune_predicted: float | None = None
    cost_model_gpu: str | None = None
    warm_start_from: str | None = None
    fixed: Fixed = ()

    def __post_init__(self) -> None:
        if self.trials < 0:
            raise TuningError(f"trials={self.trials} must be >= 0")
        if self.budget_s is not None and self.budget_s <= 0:
            raise TuningError(f"time budget {self.budget_s} s must be positive")
        if self.sampler not in SAMPLERS:
            raise TuningError(f"sampler {self.sampler!r} is unknown; expected one of "
                              f"{list(SAMPLERS)}")
        if self.compile_workers < 0 or (self.depth is not None and self.depth < 1):
            raise TuningError("compile_workers must be >= 0 and depth >= 1")
        if self.final_top < 1 or self.final_rounds < 1:
            raise TuningError("final_top and final_rounds must be >= 1")
        if not 0.0 <= self.tie_tolerance < 1.0:
            raise TuningError(f"tie tolerance {self.tie_tolerance} must be in [0, 1), e.g. 0.02 "
                              "for 2 % (checked before the search, not after it)")
        if self.max_spill_bytes < 0:
            raise TuningError(f"max_spill_bytes={self.max_spill_bytes} must be >= 0")
        if self.predicted_seeds < 0:
            raise TuningError(f"predicted_seeds={self.predicted_seeds} must be >= 0")
        if self.prune_predicted is not None and not self.prune_predicted > 1.0:
            raise TuningError(f"--prune-predicted {self.prune_predicted} must be a factor "
                              "above 1 (e.g. 3.0: skip configs predicted 3x slower than the "
                              "best prediction)")

    @property
    def pipeline_depth(self) -> int:
        return self.depth if self.depth is not None else self.compile_workers + 1


#: The status under which a summary counts the configs the static rules excluded.
STATIC_REJECTIONS = "invalid (static)"


@dataclass
class BucketSummary:
    """What tuning one bucket came to (``winner`` is None for dry runs and when nothing
    could be timed)."""

    bucket: ProblemBucket
    study: str | None
    candidates: int
    measured: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    best_tflops: float | None = None
    best_config: KernelConfig | None = None
    winner: KernelConfig | None = None
    winner_tflops: float | None = None
    default: KernelConfig | None = None
    default_tflops: float | None = None
    timed: bool = True
    #: PREDICTED results of the configs that passed (verified or timed), and the model's
    #: label ("cost model <version>, <GPU>"); empty/None without a prediction.
    predicted: list[BucketPrediction] = field(default_factory=list)
    cost_model: str | None = None
    #: Configs skipped by --prune-predicted.
    pruned_by_model: int = 0
    #: What the search was warm-started from (--warm-start-from), said in the output.
    warm_start: str | None = None

    @property
    def speedup(self) -> float | None:
        if self.winner_tflops is None or not self.default_tflops:
            return None
        return self.winner_tflops / self.default_tflops
