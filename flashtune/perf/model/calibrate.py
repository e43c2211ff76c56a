"""Checking and fitting the cost model against measurements.

``spearman`` says how well PREDICTED times order configs the way measured ones do (what a
tuner's pre-ranking needs); ``calibrate`` fits the model's free parameters by least
squares on log time, so a few GPU measurements correct the datasheet-based defaults.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from flashtune.codegen.spec import KernelConfig, Problem, ShapeLike
from flashtune.errors import InvalidInput
from flashtune.perf.model.costmodel import (
    DEFAULT_PARAMS,
    ModelParams,
    ResourcesLike,
    TrafficCounters,
    predict,
)
from flashtune.perf.model.gpus import GpuSpec
from flashtune.perf.sass.parse import InstructionMix, SassFunction

#: Parameters calibrate() fits by default, with the range each may take.
FIT_BOUNDS: dict[str, tuple[float, float]] = {
    "overlap": (0.0, 0.95),
    "exposed_latency_ns": (0.0, 5000.0),
    "tensor_efficiency": (0.2, 2.0),
    "bandwidth_efficiency": (0.3, 1.0),
    "launch_overhead_us": (0.0, 50.0),
    "local_access_cycles": (0.0, 1000.0),
}
DEFAULT_FIT: tuple[str, ...] = ("overlap", "exposed_latency_ns", "tensor_efficiency")


def spearman(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Spearman rank correlation of two equally long sequences (ties get mean ranks).

    Returns NaN when either side is constant (no order to compare).
    """
    if len(predicted) != len(measured):
        raise InvalidInput(f"spearman: {len(predicted)} predictions but {len(measured)} "
                           "measurements; pass one of each per config")
    if len(predicted) < 2:
        raise InvalidInput("spearman: need at least 2 pairs")
    values = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    if not all(np.all(np.isfinite(v)) for v in values):
        raise InvalidInput("spearman: every value must be finite")
    if any(np.all(v == v[0]) for v in values):
        return math.nan
    from scipy.stats import spearmanr  # scipy.stats takes ~0.5 s to import: only when used

    return float(spearmanr(*values).statistic)


@dataclass(frozen=True)
class Trial:
    """One measured call: what predict() needs, and the measured time."""

    problem: Problem
    config: KernelConfig
    shape: ShapeLike
    gpu: GpuSpec | str
    measured_ms: float
    resources: ResourcesLike | None = None
    sass: SassFunction | InstructionMix | None = None
    counters: TrafficCounters | None = None
    local_per_tile: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.measured_ms) and self.measured_ms > 0):
            raise InvalidInput(f"Trial.measured_ms={self.measured_ms!r} must be a positive "
                               "finite time")

    def predict_ms(self, params: ModelParams) -> float:
        return predict(self.problem, self.config, self.shape, self.gpu,
                       resources=self.resources, sass=self.sass, counters=self.counters,
                       params=params, local_per_tile=self.local_per_tile).time_ms


@dataclass(frozen=True)
class Calibration:
    """Fitted parameters and the fit's quality (log-time residuals, before and after)."""

    params: ModelParams
    fitted: tuple[str, ...]
    trials: int
    rms_log_error_before: float
    rms_log_error_after: float
    max_ratio_after: float  # worst max(pred/meas, meas/pred)

    def to_dict(self) -> dict[str, object]:
        return {"params": self.params.to_dict(), "fitted": list(self.fitted),
                "trials": self.trials, "rms_log_error_before": self.rms_log_error_before,
                "rms_log_error_after": self.rms_log_error_after,
                "max_ratio_after": self.max_ratio_after, "model_version": self.params.version}


def log_residuals(trials: Sequence[Trial], params: ModelParams) -> np.ndarray:
    """log(predicted / measured) per trial."""
    return np.array([math.log(t.predict_ms(params) / t.measured_ms) for t in trials])


def calibrate(trials: Sequence[Trial], *, start: ModelParams = DEFAULT_PARAMS,
              fit: Sequence[str] = DEFAULT_FIT) -> Calibration:
    """Fit the parameters named in ``fit`` (others keep ``start``'s values) minimising the
    squared log error of predicted vs measured time.

    Needs at least as many trials as fitted parameters; raises InvalidInput otherwise.
    """
    names = tuple(fit)
    unknown = [n for n in names if n not in FIT_BOUNDS]
    if unknown or not names:
        raise InvalidInput(f"calibrate: cannot fit {unknown or 'nothing'}; choose from "
                           f"{sorted(FIT_BOUNDS)}")
    if len(trials) < len(names):
        raise InvalidInput(f"calibrate: {len(trials)} trial(s) cannot determine "
                           f"{len(names)} parameters; measure more configs or fit fewer")
    lower = np.array([FIT_BOUNDS[n][0] for n in names])
    upper = np.array([FIT_BOUNDS[n][1] for n in names])
    span = upper - lower

    def params_at(x: np.ndarray) -> ModelParams:
        values = {n: float(lower[i] + span[i] * x[i]) for i, n in enumerate(names)}
        if "overlap" in values:  # ModelParams wants overlap < 1
            values["overlap"] = min(values["overlap"], 0.999)
        return replace(start, **values)

    x0 = np.array([min(max((getattr(start, n) - lower[i]) / span[i], 0.0), 1.0)
                   for i, n in enumerate(names)])
    before = log_residuals(trials, start)
    # The model is piecewise smooth (a max of pipes): finite differences with a coarse
    # step (1% of each parameter's range) keep the fit from stalling on a kink.
    from scipy.optimize import least_squares  # imported when used, as spearmanr

    result = least_squares(lambda x: log_residuals(trials, params_at(x)), x0,
                           bounds=(0.0, 1.0), diff_step=1e-2, xtol=1e-6, ftol=1e-8)
    fitted = params_at(result.x)
    after = log_residuals(trials, fitted)
    return Calibration(
        params=fitted, fitted=names, trials=len(trials),
        rms_log_error_before=float(np.sqrt(np.mean(before ** 2))),
        rms_log_error_after=float(np.sqrt(np.mean(after ** 2))),
        max_ratio_after=float(np.exp(np.max(np.abs(after)))),
    )
