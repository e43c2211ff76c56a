"""Performance without a GPU, in two rooms: ``sass`` reads compiled code (SASS parsing and
statistics, loops and main loops, instruction classes and budgets, disassembly) and
``model`` is the labelled cost model built on it (predictions, occupancy, parameters,
calibration and correlation, the default-config rule). ``sass`` never imports ``model``.
``profile`` (what ``flashtune profile`` prints) uses both and the toolchain, and is
imported on demand.

Every time this package returns is a PREDICTION, labelled as such; measurements come only
from a GPU.
"""

from flashtune.codegen.spec import Shape
from flashtune.perf.model.calibrate import Calibration, Trial, calibrate, spearman
from flashtune.perf.model.costmodel import (
    DEFAULT_PARAMS,
    ModelParams,
    Prediction,
    TrafficCounters,
    predict,
    rank,
)
from flashtune.perf.model.gpus import GPUS, GpuSpec, get_gpu
from flashtune.perf.model.occupancy import Occupancy, occupancy, waves
from flashtune.perf.sass.parse import InstructionMix, SassFunction, SassListing, parse_sass

__all__ = [
    "DEFAULT_PARAMS",
    "GPUS",
    "Calibration",
    "GpuSpec",
    "InstructionMix",
    "ModelParams",
    "Occupancy",
    "Prediction",
    "SassFunction",
    "SassListing",
    "Shape",
    "TrafficCounters",
    "Trial",
    "calibrate",
    "get_gpu",
    "occupancy",
    "parse_sass",
    "predict",
    "rank",
    "spearman",
    "waves",
]
