"""What one forward call asks of the GPU, from the algorithm alone: FLOPs, the K/V tiles each
query block visits, the instructions one warp issues per K/V tile, and memory traffic.

The per-tile instruction counts follow flashtune's forward kernel (templates/flash_fwd.cuh,
FlashAttention-2's structure): per K/V tile each warp re-reads its Q rows and the whole K
and V tiles from shared memory with ldmatrix.x4, runs Q K^T and P V as m16n8k16 MMAs over
the head dim rounded up to 16, exponentiates every score once (MUFU.EX2), keeps a running
row max (reduced across the 4 lanes of a row with 2 shuffles) and defers the row-sum
reduction to the end. They agree with the SASS of the compiled kernel's main loop (see
tests/perf), which the cost model uses instead when it is given.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from flashtune.codegen.spec import KernelConfig, Problem, Shape, ShapeLike
from flashtune.errors import InvalidInput
from flashtune.families.registers import mma_head_dim, mma_v_head_dim
from flashtune.perf.sass.parse import InstructionMix


def check_shape(shape: ShapeLike) -> None:
    """Validate any ShapeLike (raises InvalidInput)."""
    Shape(shape.batch, shape.heads_q, shape.heads_kv, shape.seqlen_q, shape.seqlen_k)


#: A sliding window's (left, right) key counts; -1 is unbounded on that side.
Window = tuple[int, int]


@dataclass(frozen=True)
class BlockTiles:
    """The key tiles one query block walks, [low, high), and how many of them run with a
    mask (the first step always does: its tile can be partial)."""

    low: int
    high: int
    masked: int

    @property
    def count(self) -> int:
        return self.high - self.low

    def key_rows(self, block_n: int, seqlen_k: int) -> int:
        """Rows of K (and of V) the block loads: its tiles, the last one cut at Nk."""
        return max(0, min(self.high * block_n, seqlen_k) - self.low * block_n)


def block_tiles(problem: Problem, config: KernelConfig, shape: ShapeLike,
                window: Window | None = None) -> list[BlockTiles]:
    """Per query block (blockIdx.x), the key tiles the forward kernel walks and masks, as
    templates/flash_fwd.cuh computes them: the causal diagonal and a window aligned to the
    bottom-right corner (row i sees key j iff i + Nk - Nq - left <= j <= i + Nk - Nq +
    right); a window problem skips the tiles left of every row's window and masks those
    crossing either edge. ``window``: a window problem's sizes (None: unbounded, which the
    kernel walks as full attention)."""
    nq, nk = shape.seqlen_q, shape.seqlen_k
    bm, bn = config.block_m, config.block_n
    local = problem.window
    left, right = window if window is not None else (-1, -1)
    left = nk if left < 0 or left > nk else left      # variant_args.cuh's left()
    right = nq if right < 0 or right > nq else right  # and right()
    out = []
    for m_block in range(math.ceil(nq / bm)):
        m0, m_end = m_block * bm, min(nq, (m_block + 1) * bm)
        n_end, n_full, n_begin, n_full_begin = nk, nk, 0, 0
        if problem.causal or local:
            reach = right if local else 0
            n_end = min(nk, m_end + nk - nq + reach)
            n_full = min(nk, m0 + 1 + nk - nq + reach)
        if local:
            n_begin = max(0, m0 + nk - nq - left)
            n_full_begin = max(0, m_end - 1 + nk - nq - left)
        if n_end <= n_begin:
            out.append(BlockTiles(0, 0, 0))
            continue
        high = math.ceil(n_end / bn)
        low = n_begin // bn if local else 0
        first_masked = 0 if n_full <= 0 else n_full // bn
        if local:  # after the first step: right-edge tiles, whole ones, left-edge ones
            left_masked_end = math.ceil(n_full_begin / bn)
            masked = 1 + sum(1 for t in range(low, high - 1)
                             if t >= first_masked or t < left_masked_end)
        else:
            masked = max(1, high - first_masked)
        out.append(BlockTiles(low, high, masked))
    return out


def tiles_per_query_block(problem: Problem, config: KernelConfig,
                          shape: ShapeLike, window: Window | None = None) -> list[int]:
    """How many K/V tiles each query block (blockIdx.x) visits (``block_tiles``)."""
    return [b.count for b in block_tiles(problem, config, shape, window)]


@dataclass(frozen=True)
class TileMix:
    """Instructions one warp issues per K/V tile, by the pipe that executes them."""

    mma_flops: float   # tensor-core FLOPs, mma.sync and this warp's share of wgmma
    mufu: float        # special-function unit (exp2, rcp)
    fp32: float        # FP32 pipe: FFMA/FADD/FMUL/FMNMX/FSEL and conversions
    shfl: float        # warp shuffles
    local: float       # LDL/STL (spills, indexed arrays)
    issue_only: float  # everything else: one issue slot each (integer, loads, control)
    ldsm_bytes: float  # shared-memory bytes read by ldmatrix
    source: str        # "analytic" or "sass"
    wgmma_flops: float = 0.0  # the part of mma_flops issued as wgmma (datasheet rate)

    def to_dict(self) -> dict[str, object]:
        return {k: (round(v, 2) if isinstance(v, float) else v)
                for k, v in asdict(self).items()}


def analytic_tile_mix(problem: Problem, config: KernelConfig) -> TileMix:
    """Per-warp, per-K/V-tile instruction counts of the forward kernel from its structure
    (Q K^T over Q/K's head dim, P V and the O rescale over V's)."""
    d, dv = mma_head_dim(problem), mma_v_head_dim(problem)
    n = config.block_n
    slabs = config.rows_per_warp // 16          # m16 tiles per warp
    elems = config.rows_per_warp * n / 32      # scores held per thread
    mmas = slabs * (n // 8) * (d // 16) + slabs * (dv // 8) * (n // 16)
    ldsm = n * (d + dv) / 256 + slabs * d / 16  # K and V tiles (x4), the warp's Q rows
    ldgsts = n * (d + dv) * 2 / 16 / config.threads  # 16-byte cp.async per thread
    rows = 2 * slabs                            # rows a thread holds a share of
    fp32 = (3 * elems            # scale-and-subtract, running max, running sum
            + elems / 2          # pack probabilities to 16-bit pairs
            + slabs * dv / 2     # rescale the O accumulators
            + 6 * rows)          # row statistics
    integer = 2 * (ldsm + ldgsts) + 60          # addressing and loop control
    return TileMix(
        mma_flops=mmas * 2.0 * 16 * 8 * 16,
        mufu=elems + rows,
        fp32=fp32,
        shfl=2 * rows,
        local=0.0,
        issue_only=ldsm + ldgsts + 2 + integer,
        ldsm_bytes=ldsm * 512.0,
        source="analytic",
    )


def sass_tile_mix(loop_mix: InstructionMix, analytic: TileMix) -> tuple[TileMix, float]:
    """Per-tile counts from the main loop's SASS, and how many K/V tiles one pass of the
    loop body covers (its MMA FLOPs over one tile's; 1 unless the loop was unrolled)."""
    if loop_mix.mma_flops <= 0:
        raise InvalidInput("the loop holds no MMA; it is not the kernel's main loop")
    per = loop_mix.mma_flops / analytic.mma_flops
    unroll = max(1.0, round(per)) if abs(per - round(per)) < 0.05 else per
    c = loop_mix.by_category
    mix = TileMix(
        mma_flops=loop_mix.mma_flops / unroll,
        mufu=c["mufu"] / unroll,
        fp32=(c["fp32"] + c["convert"]) / unroll,
        shfl=c["shfl"] / unroll,
        local=(c["ldl"] + c["stl"]) / unroll,
        issue_only=loop_mix.issue_only / unroll,
        ldsm_bytes=loop_mix.ldsm_bytes / unroll,
        source="sass",
        wgmma_flops=loop_mix.wgmma_flops / unroll,
    )
    return mix, unroll


@dataclass(frozen=True)
class Traffic:
    """Bytes moved by one call: at DRAM (unique data) and at L2 (every global request)."""

    dram_bytes: float
    l2_bytes: float
    source: str

    def to_dict(self) -> dict[str, object]:
        return {"dram_bytes": self.dram_bytes, "l2_bytes": self.l2_bytes,
                "source": self.source}


def analytic_traffic(problem: Problem, config: KernelConfig, shape: ShapeLike,
                     *, l2_bytes: int, resident_blocks: int,
                     window: Window | None = None) -> Traffic:
    """The algorithm's traffic: Q read once, O (and the LSE) written once, K and V read
    once per query block.

    At L2 every request counts. At DRAM K and V count once per kv head while the K/V of the
    heads in flight (about ``resident_blocks`` query blocks at a time, in launch order)
    fit in half the L2; beyond that the re-reads of later query blocks miss, in proportion.
    ``window``: a window problem's sizes (``block_tiles``).
    """
    e = problem.dtype.itemsize
    kv_row = (problem.head_dim + problem.v_head_dim) * e  # a key's K and V rows
    q_rows = shape.batch * shape.heads_q * shape.seqlen_q
    kv_bytes_per_head = shape.seqlen_k * kv_row
    q_o = q_rows * kv_row + q_rows * 4  # Q in, O (V's width) and the LSE out
    tiles = block_tiles(problem, config, shape, window)
    kv_requests = (sum(b.key_rows(config.block_n, shape.seqlen_k) for b in tiles)
                   * kv_row * shape.batch * shape.heads_q)
    group = shape.heads_q // shape.heads_kv
    unique_kv = shape.batch * shape.heads_kv * kv_bytes_per_head
    heads_in_flight = max(1.0, resident_blocks / (len(tiles) * group))
    working_set = heads_in_flight * kv_bytes_per_head
    miss = min(1.0, max(0.0, working_set / (l2_bytes / 2) - 1.0))
    dram_kv = unique_kv + miss * max(0.0, kv_requests - unique_kv)
    return Traffic(dram_bytes=q_o + dram_kv, l2_bytes=q_o + kv_requests, source="analytic")
