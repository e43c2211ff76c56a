"""What the cost model charges per K/V tile when it has the kernel's SASS: the instructions
each main loop EXECUTES, and which loop each tile of a query block runs in.

- Unmasked tiles run the unmasked loop; the tiles that need a mask (the first tile walked,
  which can be partial, and under a causal mask the tiles across the diagonal) run the
  masked loop, or straight-line steps with the same body plus the mask when the kernel
  unrolls them (no masked loop: charged as the unmasked loop plus one compare and one
  select per score).
- Inside a loop, the block a warp vote guards (the rescale of O when no row maximum of the
  warp changed) runs with a probability: for scores with no trend along the keys, the
  maximum of a row over tiles 1..j lies in tile j with probability 1/j, so a warp of R rows
  rescales at tile j with probability 1 - (1 - 1/j)^R. A query block's loop is charged the
  mean of that over its tiles 2..T (tile 1 is peeled and never rescales).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.perf.model.algorithm import BlockTiles, TileMix, sass_tile_mix
from flashtune.perf.sass.loops import MainLoop, main_loops
from flashtune.perf.sass.parse import InstructionMix, SassFunction


def rescale_probability(tiles: int, rows: int) -> float:
    """Mean over tiles 2..tiles of the chance that some of a warp's ``rows`` rows gets a
    new maximum (scores with no trend along the keys); 0 for a single tile."""
    if tiles <= 1:
        return 0.0
    total = sum(1.0 - (1.0 - 1.0 / j) ** rows for j in range(2, tiles + 1))
    return total / (tiles - 1)


def _scaled(mix: TileMix, factor: float) -> TileMix:
    return TileMix(mix.mma_flops * factor, mix.mufu * factor, mix.fp32 * factor,
                   mix.shfl * factor, mix.local * factor, mix.issue_only * factor,
                   mix.ldsm_bytes * factor, mix.source, mix.wgmma_flops * factor)


def _minus(a: TileMix, b: TileMix) -> TileMix:
    return TileMix(a.mma_flops - b.mma_flops, a.mufu - b.mufu, a.fp32 - b.fp32,
                   a.shfl - b.shfl, a.local - b.local, a.issue_only - b.issue_only,
                   a.ldsm_bytes - b.ldsm_bytes, a.source, a.wgmma_flops - b.wgmma_flops)


def _block_mix(mix: InstructionMix) -> TileMix:
    """The pipes of a block of instructions with no MMA (the skipped rescale)."""
    c = mix.by_category
    return TileMix(0.0, c["mufu"], c["fp32"] + c["convert"], c["shfl"], c["ldl"] + c["stl"],
                   mix.issue_only, mix.ldsm_bytes, "sass")


@dataclass(frozen=True)
class LoopCharge:
    """One main loop's per-tile mix without its vote-guarded blocks, and those blocks."""

    loop: MainLoop
    always: TileMix     # executed on every tile
    rescale: TileMix    # executed when the vote finds a changed row maximum

    def executed(self, p_rescale: float) -> TileMix:
        return _plus(self.always, _scaled(self.rescale, p_rescale))


def _plus(a: TileMix, b: TileMix) -> TileMix:
    return _minus(a, _scaled(b, -1.0))


_ZERO = TileMix(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, "sass")


def _charge(loop: MainLoop, analytic: TileMix) -> LoopCharge:
    static, unroll = sass_tile_mix(loop.mix, analytic)
    rescale = _ZERO
    for block in loop.skipped:
        rescale = _plus(rescale, _scaled(_block_mix(block.mix), 1.0 / unroll))
    return LoopCharge(loop, _minus(static, rescale), rescale)


@dataclass(frozen=True)
class KernelLoops:
    """The charges of a kernel's unmasked and masked loops (the masked one may be absent:
    masked steps unrolled, then charged as the unmasked loop plus the mask)."""

    unmasked: LoopCharge
    masked: LoopCharge | None
    mask_cost: TileMix  # compare + select per score, for unrolled masked steps

    def tile_mix(self, masked: bool, p_rescale: float) -> TileMix:
        if masked and self.masked is not None:
            return self.masked.executed(p_rescale)
        base = self.unmasked.executed(p_rescale)
        return _plus(base, self.mask_cost) if masked else base


def kernel_loops(fn: SassFunction, problem: Problem, config: KernelConfig,
                 analytic: TileMix) -> KernelLoops | None:
    """The loop charges of a compiled forward kernel, or None when its SASS has no main
    loop of one K/V tile's MMAs (then the caller uses one mix for every tile)."""
    found = main_loops(fn)
    primary = found.primary
    if primary is None:
        return None
    scores = config.rows_per_warp * config.block_n / 32  # per thread
    mask = TileMix(0.0, 0.0, scores, 0.0, 0.0, scores, 0.0, "sass")
    unmasked = _charge(primary, analytic)
    masked = _charge(found.masked, analytic) if found.masked is not None else None
    return KernelLoops(unmasked, masked, mask)


def block_tile_mixes(loops: KernelLoops, config: KernelConfig, blocks: list[BlockTiles]
                     ) -> list[tuple[int, TileMix, TileMix]]:
    """Per query block: (masked tiles, masked-tile mix, unmasked-tile mix)."""
    rows = config.rows_per_warp
    out = []
    for block in blocks:
        p = rescale_probability(block.count, rows)
        out.append((block.masked, loops.tile_mix(True, p), loops.tile_mix(False, p)))
    return out


def mean_rescale_probability(config: KernelConfig, tiles: list[int]) -> float:
    """The rescale probability averaged over the tiles of all query blocks."""
    total = sum(tiles)
    if total == 0:
        return 0.0
    return math.fsum(rescale_probability(t, config.rows_per_warp) * t for t in tiles) / total
