"""Measured memory behaviour for the cost model, from the CPU emulator's launch counters.

The kernel runs in the emulator on a small sample shape (at most 256 query and key rows, one
head, batch 1, fresh random inputs); its cp.async global bytes, relative to what the algorithm
needs on that shape (Q once, K and V once per query block they visit), scale the algorithm's
figure for the predicted shape, and its shared-memory wavefronts per ideal wavefront become
the bank-conflict factor. O and the LSE are written with plain stores, which the emulator
does not count: the cost model keeps their analytic bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from flashtune.codegen.spec import KernelConfig, Problem, Shape, ShapeLike
from flashtune.errors import InvalidInput
from flashtune.families import of, render
from flashtune.families.base import timing_window
from flashtune.perf.model.algorithm import Window, block_tiles
from flashtune.perf.model.costmodel import TrafficCounters
from flashtune.runtime.backends.emulator import EmulatorBackend, EmulatorCounters, LaunchOptions

#: Largest sequence length of the sample shape (the emulator runs about 1 M mma per second).
SAMPLE_SEQLEN = 256


def algorithm_read_bytes(problem: Problem, config: KernelConfig, shape: ShapeLike,
                         window: Window | None = None) -> int:
    """Global bytes the forward kernel must read: Q once (the rows of blocks that see some
    key), and the K and V rows of every tile each query block visits (a partial last tile
    counts its rows only). ``window``: a
    window problem's sizes (None: ``timing_window``, what the sample runs with)."""
    if problem.window and window is None:
        window = timing_window(shape)
    e = problem.dtype.itemsize
    blocks = block_tiles(problem, config, shape, window)
    # A block whose rows see no key writes its empty rows without loading Q.
    q_rows = sum(min(shape.seqlen_q, (m + 1) * config.block_m) - m * config.block_m
                 for m, b in enumerate(blocks) if b.count)
    kv_rows = sum(b.key_rows(config.block_n, shape.seqlen_k) for b in blocks)
    return ((q_rows * problem.head_dim + kv_rows * (problem.head_dim + problem.v_head_dim))
            * e * shape.batch * shape.heads_q)


def sample_shape(shape: ShapeLike) -> Shape:
    """The emulated shape: batch 1, one head, at most SAMPLE_SEQLEN rows each side."""
    return Shape(1, 1, 1, min(shape.seqlen_q, SAMPLE_SEQLEN),
                 min(shape.seqlen_k, SAMPLE_SEQLEN))


@dataclass(frozen=True)
class EmulatedTraffic:
    """Counters of one emulated launch on ``sample`` and the cost-model inputs they give for
    the predicted shape."""

    sample: Shape
    counters: EmulatorCounters
    read_ratio: float  # measured / algorithm's read bytes on the sample
    traffic: TrafficCounters

    def __post_init__(self) -> None:
        if not self.read_ratio > 0:
            raise InvalidInput(f"EmulatedTraffic.read_ratio={self.read_ratio} must be > 0")

    def to_dict(self) -> dict[str, object]:
        return {"sample_shape": asdict(self.sample), "read_ratio": self.read_ratio,
                "global_read_bytes": self.traffic.global_read_bytes,
                "smem_bank_conflict_factor": self.traffic.smem_bank_conflict_factor,
                "counters": self.counters.to_dict()}


def _run_sample(problem: Problem, config: KernelConfig, sample: Shape) -> EmulatorCounters:
    from flashtune.runtime.launch import prepare  # imports torch: keep `flashtune.perf` light

    kernel = EmulatorBackend(options=LaunchOptions(counters=True)).load(render(problem, config))
    inputs = of(problem).timing_inputs(problem, sample, "cpu")  # the timed window
    prepare(kernel, sample, "cpu", inputs=inputs, poison=True).run()
    counters = kernel.last_counters
    assert counters is not None  # LaunchOptions(counters=True)
    return counters


def measure_traffic(problem: Problem, config: KernelConfig, shape: ShapeLike
                    ) -> EmulatedTraffic:
    """Run ``problem`` x ``config`` in the emulator on the sample of ``shape`` and turn its
    counters into the cost model's TrafficCounters for ``shape``."""
    sample = sample_shape(shape)
    counters = _run_sample(problem, config, sample)
    expected = algorithm_read_bytes(problem, config, sample)
    if expected == 0 or counters.cp_async_bytes == 0:
        raise InvalidInput(f"the emulated kernel read {counters.cp_async_bytes} bytes by "
                           f"cp.async on {sample} (the algorithm needs {expected}); counters "
                           "cannot scale to the predicted shape")
    ratio = counters.cp_async_bytes / expected
    read = round(algorithm_read_bytes(problem, config, shape) * ratio)
    traffic = TrafficCounters(global_read_bytes=read,
                              smem_bank_conflict_factor=counters.smem_bank_conflict_factor)
    return EmulatedTraffic(sample, counters, ratio, traffic)
