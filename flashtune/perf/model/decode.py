"""The cost model of split-KV decoding: a PREDICTED time, bounded by memory bandwidth and
by kernel launches (decoding does about g FLOP per byte for GQA group g, far below any
GPU's ridge point, so its arithmetic is never the bound).

``decode_traffic`` counts the bytes a call moves with a given tile and split plan: K and V
(in the cache's type: one byte a value in an e4m3 cache) once per row block (once per
(sequence, kv head) when the tile covers the group's packed rows), Q once per non-empty
split, and, with more than one split, the float32 partial O and LSE written by the decode
kernel and read once by the combine; O (the input type) and the LSE written once.
``predict_decode`` charges that traffic at the GPU's HBM bandwidth
(derated by ``HBM_EFFICIENCY``), plus a fixed cost per launch, and returns it with the
achieved-bandwidth figure it implies. Every time here is a prediction, never a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashtune.codegen.spec import KernelConfig, Problem, ShapeLike
from flashtune.errors import InvalidInput
from flashtune.families.base import timing_window
from flashtune.families.decode.splits import window_keys
from flashtune.perf.model.gpus import GpuSpec, get_gpu

#: Share of the datasheet HBM bandwidth a streaming kernel reaches (a large copy reaches
#: about 90% on Hopper; published decoders 85-90%).
HBM_EFFICIENCY = 0.9
#: Seconds one kernel launch costs on the stream at least (launch latency and the tail of
#: a short grid), charged per kernel of the call.
LAUNCH_S = 4e-6


@dataclass(frozen=True)
class DecodeTraffic:
    """Bytes one decoding call moves, by what moves them."""

    kv: float
    q: float
    partials: float
    out: float

    @property
    def total(self) -> float:
        return self.kv + self.q + self.partials + self.out


@dataclass(frozen=True)
class DecodePrediction:
    """A PREDICTED decoding time and what it rests on."""

    seconds: float
    traffic: DecodeTraffic
    launches: int
    bound: str  # "bandwidth" or "launch"
    gpu: str

    @property
    def gb_per_s(self) -> float:
        """The bandwidth the prediction implies: bytes moved over the predicted time."""
        return self.traffic.total / self.seconds / 1e9


def decode_traffic(problem: Problem, config: KernelConfig, shape: ShapeLike,
                   splits: int, window: tuple[int, int] | None = None) -> DecodeTraffic:
    """Bytes of a decoding call over caches of ``shape.seqlen_k`` keys per sequence with
    ``splits`` splits, each split non-empty (the worst case of Q and partial traffic). A
    window problem reads the key tiles from the one holding the earliest row's first
    visible key (``window``: its (left, right) sizes; None: ``timing_window``, as the tuner
    times it)."""
    if splits < 1:
        raise InvalidInput(f"splits={splits} must be >= 1")
    e, d, dv = problem.dtype.itemsize, problem.head_dim, problem.v_head_dim
    kv_e = problem.dtypes.kv.itemsize  # an e4m3 cache (decode8): one byte a value
    group_rows = shape.heads_q // shape.heads_kv * shape.seqlen_q
    row_blocks = -(-group_rows // config.block_m)
    q_rows = shape.batch * shape.heads_q * shape.seqlen_q
    left = -1
    if problem.window:
        left = (window if window is not None else timing_window(shape))[0]
    keys = window_keys(shape.seqlen_k, shape.seqlen_q, left, config.block_n)
    kv = float(shape.batch * shape.heads_kv * keys * (d + dv) * kv_e * row_blocks)
    # Each split writes and the combine reads a float32 O row (V's width) and an LSE.
    partials = 0.0 if splits == 1 else 2.0 * splits * q_rows * (4 * dv + 4)
    return DecodeTraffic(kv, float(q_rows * d * e * splits), partials,
                         float(q_rows * (dv * e + 4)))


def predict_decode(problem: Problem, config: KernelConfig, shape: ShapeLike, splits: int,
                   gpu: GpuSpec | str, window: tuple[int, int] | None = None
                   ) -> DecodePrediction:
    """PREDICTED time of a decoding call: its traffic at HBM_EFFICIENCY of the GPU's HBM
    bandwidth, or the launches' fixed cost when that is larger (one launch for one split,
    two with the combine)."""
    spec = gpu if isinstance(gpu, GpuSpec) else get_gpu(gpu)
    traffic = decode_traffic(problem, config, shape, splits, window)
    launches = 1 if splits == 1 else 2
    memory_s = traffic.total / (spec.hbm_gbps * 1e9 * HBM_EFFICIENCY)
    launch_s = launches * LAUNCH_S
    bound = "bandwidth" if memory_s >= launch_s else "launch"
    return DecodePrediction(max(memory_s, launch_s), traffic, launches, bound, spec.name)
