"""The architecture-specific part of a cost-model prediction, as one strategy object, and
the portable strategy (mma.sync).

The model's per-tile structure (costmodel.py) is the same on every path; what a kernel's
instruction set changes is here, behind ``ModelPath``: the analytic instruction mix
without SASS, the threads of a block, the registers estimated without compiled resources,
how a sub-partition's warps share a tile's tensor and non-tensor time, and the version and
assumptions a prediction carries. ``paths.model_path`` chooses one per prediction;
``wgmma.WgmmaPath`` is the sm_90a strategy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from flashtune.codegen.arch import SUBPARTITIONS_PER_SM
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.families.registers import accumulator_registers
from flashtune.perf.model.algorithm import TileMix, analytic_tile_mix
from flashtune.perf.model.gpus import GpuSpec
from flashtune.perf.model.occupancy import Occupancy
from flashtune.perf.model.params import MODEL_NAME, ModelParams

#: Registers the kernel needs beyond its O and S accumulators (Q/K/V fragments,
#: addresses, softmax state): used only when no compiled resource usage is given.
REGISTER_OVERHEAD_ESTIMATE = 64


def tensor_cycles(mma_sync_flops: float, wgmma_flops: float, mma_sync_cycles: float,
                  tensor_flops_per_clk_sm: float, subpartitions: int,
                  efficiency: float) -> float:
    """One warp's tensor-core cycles: mma.sync FLOPs at the mma.sync rate (one m16n8k16 per
    ``mma_sync_cycles``), its wgmma share at the datasheet rate per sub-partition."""
    m16n8k16 = 2 * 16 * 8 * 16
    return (mma_sync_flops / m16n8k16 * mma_sync_cycles
            + wgmma_flops / (tensor_flops_per_clk_sm / subpartitions)) / efficiency


@dataclass(frozen=True)
class TileRound:
    """How one sub-partition's warps share a K/V tile: the warps on it, one warp's cycles
    per tile after overlap, and the round of all of them."""

    warps_per_partition: int
    warp: float
    round: float


class ModelPath(Protocol):
    """One architecture's part of a prediction (the module docstring)."""

    @property
    def name(self) -> str:
        """The path's label in a prediction ("mma.sync", "wgmma")."""
        ...

    @property
    def model_name(self) -> str:
        """The model's name in the version a prediction on this path carries."""
        ...

    def analytic_mix(self, problem: Problem, config: KernelConfig) -> TileMix:
        """Per-warp, per-K/V-tile counts from the algorithm (no SASS)."""
        ...

    def block_threads(self, config: KernelConfig) -> int:
        """Threads of one block of ``config``."""
        ...

    def estimated_registers(self, problem: Problem, config: KernelConfig,
                            gpu: GpuSpec) -> int:
        """Registers per thread when no compiled resources are given."""
        ...

    def tile_round(self, tensor: float, other: float, occ: Occupancy,
                   config: KernelConfig, params: ModelParams) -> TileRound:
        """How the resident warps of a sub-partition share one tile's ``tensor`` and
        ``other`` cycles (per warp)."""
        ...

    def operand_smem_bytes(self, problem: Problem, config: KernelConfig) -> float:
        """Shared-memory bytes one block's tensor-core instructions read per K/V tile
        themselves (not through ldmatrix, which the mix's ``ldsm_bytes`` counts)."""
        ...

    def assumptions(self, params: ModelParams) -> tuple[str, ...]:
        """The path's stated assumptions (empty: none beyond the fitted model's)."""
        ...


@dataclass(frozen=True)
class MmaSyncPath:
    """The portable path: warp-wide mma.sync at the GPU's mma.sync rate, fitted to
    FlashAttention-2's published table (costmodel.py)."""

    name: str = "mma.sync"
    model_name: str = MODEL_NAME

    def analytic_mix(self, problem: Problem, config: KernelConfig) -> TileMix:
        return analytic_tile_mix(problem, config)

    def block_threads(self, config: KernelConfig) -> int:
        return config.threads

    def estimated_registers(self, problem: Problem, config: KernelConfig,
                            gpu: GpuSpec) -> int:
        return min(gpu.arch_spec.max_regs_per_thread,
                   accumulator_registers(problem, config) + REGISTER_OVERHEAD_ESTIMATE)

    def tile_round(self, tensor: float, other: float, occ: Occupancy,
                   config: KernelConfig, params: ModelParams) -> TileRound:
        # Only other warps on the same sub-partition can hide a warp's non-tensor work.
        warps_per_partition = math.ceil(occ.warps_per_sm / SUBPARTITIONS_PER_SM)
        hidden = params.overlap * min(1.0, warps_per_partition - 1.0)
        warp = tensor + (1.0 - hidden) * other
        return TileRound(warps_per_partition, warp, warps_per_partition * warp)

    def operand_smem_bytes(self, problem: Problem, config: KernelConfig) -> float:
        # mma.sync takes its operands from registers, loaded by ldmatrix.
        return 0.0

    def assumptions(self, params: ModelParams) -> tuple[str, ...]:
        return ()


MMA_SYNC = MmaSyncPath()


def versioned(params: ModelParams, model_name: str) -> str:
    """The version of a prediction by ``model_name`` with ``params``: the name and the
    digest of the parameter values."""
    return params.version.replace(MODEL_NAME, model_name, 1)
