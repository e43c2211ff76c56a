"""Performance without a GPU: SASS statistics, occupancy and a cost model.

Pure modules (import only flashtune.codegen and flashtune.errors): ``sass`` (parse SASS,
instruction mix), ``occupancy``, ``gpus`` (datasheet table), ``workload`` (the algorithm's
counts and traffic), ``schedule``, ``costmodel`` (``predict``, ``rank``), ``calibrate``
(``spearman``, ``calibrate``) and ``baselines`` (published FlashAttention-2 figures).
``cfg`` finds a listing's loops (back edges whose target dominates the branch), ``wgmma``
holds the cost model's sm_90a path (its designs and stated assumptions) and
``modelparams`` its free parameters. ``loops`` finds the masked and unmasked main loops of
a kernel in its SASS and ``budget`` reads their instructions per iteration by class against
FlashAttention-2's same-tile figures. ``disasm`` and ``profile`` also use the toolchain
(nvdisasm, NVRTC) and are imported on demand.

Every time this package returns is a PREDICTION, labelled as such; measurements come only
from a GPU.
"""

from flashtune.codegen.spec import Shape
from flashtune.perf.calibrate import Calibration, Trial, calibrate, spearman
from flashtune.perf.costmodel import (
    DEFAULT_PARAMS,
    ModelParams,
    Prediction,
    TrafficCounters,
    predict,
    rank,
)
from flashtune.perf.gpus import GPUS, GpuSpec, get_gpu
from flashtune.perf.occupancy import Occupancy, occupancy, waves
from flashtune.perf.sass import InstructionMix, SassFunction, SassListing, parse_sass

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
