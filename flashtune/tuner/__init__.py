"""The tuner: an Optuna search per (device, problem bucket, template digest).

``tune(...)`` is the Python form of ``flashtune tune``; see flashtune.tuner.driver. The driver
(api, options, pipeline, workers, records) lives here; ``search`` decides what to measure
and which config wins, ``measure`` measures. Names are imported on first use, so
``import flashtune.tuner`` stays cheap.
"""

from __future__ import annotations

from flashtune._lazy import lazy_exports

_EXPORTS = {
    "tune": "flashtune.tuner.driver",
    "Tuner": "flashtune.tuner.driver",
    "TuneOptions": "flashtune.tuner.options",
    "BucketSummary": "flashtune.tuner.options",
    "TimingPlan": "flashtune.tuner.measure.base",
    "Measurer": "flashtune.tuner.measure.base",
    "BatchHeads": "flashtune.tuner.measure.workload",
    "make_measurer": "flashtune.tuner.measure.factory",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
