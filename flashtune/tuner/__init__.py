"""The tuner: an Optuna search per (device, problem bucket, template digest).

``tune(...)`` is the Python form of ``flashtune tune``; see flashtune.tuner.api. Names are
imported on first use, so ``import flashtune.tuner`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "tune": "flashtune.tuner.api",
    "Tuner": "flashtune.tuner.api",
    "TuneOptions": "flashtune.tuner.options",
    "BucketSummary": "flashtune.tuner.options",
    "TimingPlan": "flashtune.tuner.measure",
    "MeasurementBackend": "flashtune.tuner.measure",
    "BatchHeads": "flashtune.tuner.workload",
    "gpu_backend": "flashtune.tuner.backends",
    "dry_run_backend": "flashtune.tuner.backends",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flashtune.tuner' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
