"""The cost model's PREDICTIONS for the tuner: which GPU to predict for, and a bucket's
predicted time, aggregated over its representative shapes exactly as measurements are.

A measured trial's ``median_ms`` is the geometric mean of its shapes' medians and its
objective the geometric mean of their TFLOP/s (workload.py); a prediction aggregates the
per-shape PREDICTED times the same way, so predicted and measured figures of a trial are
directly comparable (and rank correlations between them meaningful).

Predictions are made before compiling, from the algorithm's analytic instruction counts
and estimated registers (``flashtune.perf.model.costmodel.predict`` without compiled
resources), so a config's prediction is the same whether it is used to order candidates,
to prune them or recorded next to its measurement.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass

from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.db.records import DeviceRecord
from flashtune.errors import FlashtuneError, InvalidConfig, TuningError
from flashtune.perf.model.costmodel import DEFAULT_PARAMS, ModelParams, model_version, predict
from flashtune.perf.model.gpus import GPUS, GpuSpec, default_gpu_for_arch, get_gpu
from flashtune.tuner.measure.workload import Workload, geomean

log = logging.getLogger("flashtune.tuner")

#: Device names of GPU-less (virtual) devices start with this (runtime.device).
VIRTUAL_PREFIX = "virtual-"


@dataclass(frozen=True)
class BucketPrediction:
    """A PREDICTED (never measured) result of one config on one bucket's shapes."""

    config: KernelConfig
    time_ms: float      # geometric mean over the bucket's shapes, like a trial's median_ms
    tflops: float       # geometric mean TFLOP/s over the shapes, like the objective
    bound: str          # what limits most of the shapes (the first shape's on a tie)
    model_version: str
    gpu: str

    def __post_init__(self) -> None:
        if not (self.time_ms > 0 and self.tflops > 0):
            raise TuningError(f"prediction of {self.config.key()} must be positive, got "
                              f"{self.time_ms} ms and {self.tflops} TFLOP/s")


def _norm(text: str) -> str:
    return re.sub(r"[\s_]+", "-", text.strip().lower())


def gpu_of_device(device: DeviceRecord) -> GpuSpec | None:
    """The cost model's GPU for a real device, by name, when its arch and SM count agree.

    'NVIDIA H100 80GB HBM3' -> H100; 'NVIDIA GeForce RTX 4090' -> RTX4090. A name that
    matches but whose SM count differs (e.g. an H100 PCIe, 114 SMs) is a different
    product the table does not describe: None.
    """
    name = f"-{_norm(device.name)}-"
    for gpu in GPUS.values():
        labels = (gpu.name, *gpu.aliases)
        if not any(f"-{_norm(label)}-" in name for label in labels):
            continue
        if gpu.arch != device.arch or gpu.sm_count != device.sm_count:
            continue
        return gpu
    return None


def resolve_gpu(device: DeviceRecord, override: str | None = None) -> GpuSpec | None:
    """The GPU to predict for: ``override`` (a name of the model's table), else the
    device's own GPU when the table knows it, else for a virtual device (dry run) its
    arch's reference GPU; None when none applies (nothing is predicted)."""
    if override is not None:
        try:
            gpu = get_gpu(override)
        except InvalidConfig as exc:
            raise TuningError(str(exc)) from None
        if gpu.arch != device.arch:
            raise TuningError(f"cost-model GPU {gpu.name} is {gpu.arch} but the device "
                              f"{device.name} is {device.arch}; pass a GPU of {device.arch}")
        return gpu
    if device.name.startswith(VIRTUAL_PREFIX):
        try:
            return default_gpu_for_arch(device.arch)
        except InvalidConfig:
            return None
    return gpu_of_device(device)


class Predictor:
    """Predictions of configs on buckets for one GPU, computed once each."""

    def __init__(self, gpu: GpuSpec, params: ModelParams = DEFAULT_PARAMS) -> None:
        self.gpu = gpu
        self.params = params
        self._memo: dict[tuple[Workload, KernelConfig], BucketPrediction | None] = {}

    def label(self, problem: Problem) -> str:
        """The model's name and version for predictions of ``problem``, and the GPU; for a
        family the model does not describe, says so (its configs get no prediction and are
        searched unranked)."""
        try:
            version = model_version(self.params, problem)
        except FlashtuneError:
            return f"no cost model of the {problem.op!r} family (configs unranked)"
        return f"cost model {version}, {self.gpu.name}"

    def predict(self, workload: Workload, config: KernelConfig) -> BucketPrediction | None:
        """The config's prediction on the workload's shapes; None when the model has none
        (no block of it fits on an SM of the GPU, or the model rejects the config)."""
        key = (workload, config)
        if key not in self._memo:
            self._memo[key] = self._predict(workload, config)
        return self._memo[key]

    def _predict(self, workload: Workload, config: KernelConfig) -> BucketPrediction | None:
        try:
            preds = [predict(workload.problem, config, shape, self.gpu, params=self.params)
                     for shape in workload.shapes]
        except FlashtuneError as exc:
            log.debug("no prediction of %s: %s", config.key(), exc)
            return None
        times = [p.time_ms for p in preds]
        bounds = Counter(p.bound for p in preds)
        top = max(bounds.values())
        bound = next(p.bound for p in preds if bounds[p.bound] == top)
        return BucketPrediction(config, geomean(times), workload.objective(times), bound,
                                preds[0].model_version, self.gpu.name)

    def rank(self, workload: Workload, configs: list[KernelConfig]) -> list[BucketPrediction]:
        """Predictions of the configs that have one, fastest first (ties in input order)."""
        found = [p for p in (self.predict(workload, c) for c in configs) if p is not None]
        return sorted(found, key=lambda p: p.time_ms)

    def hopeless(self, workload: Workload, configs: list[KernelConfig], factor: float,
                 keep: KernelConfig | None = None) -> dict[str, str]:
        """Config key -> reason, for configs predicted more than ``factor`` times slower
        than the best prediction (``keep`` is never among them)."""
        ranked = self.rank(workload, configs)
        if not ranked:
            return {}
        best = ranked[0].time_ms
        return {p.config.key(): (f"pruned by cost model: predicted {p.time_ms:.4g} ms vs best "
                                 f"{best:.4g} ms ({self.label(workload.problem)})")
                for p in ranked if p.time_ms > factor * best and p.config != keep}
