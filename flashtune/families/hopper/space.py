"""The search space of the sm_90a forward: legal values and static rules with reasons.

One consumer warpgroup (4 warps) per 64 query rows, so num_warps is block_m / 16 and not a
knob of its own. block_n is an N that ``wgmma_ss`` issues on the GPU (64, 128, 256); the
stage ring holds num_stages K and V tiles.
"""

from __future__ import annotations

from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.params import Param, ParamSpace
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.families.base import resource_reason

BLOCK_M = (64, 128)
BLOCK_N = (64, 128, 256)
NUM_STAGES = (1, 2, 3)
HEAD_DIMS = (64, 128, 256)

SPACE = ParamSpace((Param("block_m", BLOCK_M), Param("block_n", BLOCK_N),
                    Param("num_stages", NUM_STAGES)))

#: Accumulator registers per thread (S and O in f32, P packed) beyond which ptxas cannot keep
#: the rest of the kernel (addresses, softmax state, descriptors) below 255 registers
#: without spilling (checked with NVRTC for sm_90a over the space).
MAX_ACCUMULATOR_REGISTERS = 192

#: The tiles start on a 1024-byte boundary of the shared window (128B swizzle), found at run
#: time: this much slack is allocated.
ALIGN_SLACK = 1024


def warps(block_m: int) -> int:
    """Warps per block: a warpgroup of 4 per 64 query rows."""
    return block_m // 16


def smem_bytes(problem: Problem, config: KernelConfig, *, warp_specialized: bool = False) -> int:
    """Q, num_stages K and V tiles, a full and an empty mbarrier per stage (and Q's own when
    ``warp_specialized``), alignment slack."""
    row = problem.head_dim * problem.dtype.itemsize
    return (row * (config.block_m + 2 * config.num_stages * config.block_n)
            + 16 * config.num_stages + (8 if warp_specialized else 0) + ALIGN_SLACK)


def accumulator_registers(problem: Problem, config: KernelConfig) -> int:
    """Per thread: S (block_n / 2 f32), O (head_dim / 2 f32) and P (block_n / 4 packed)."""
    return config.block_n // 2 + problem.head_dim // 2 + config.block_n // 4


def static_check(problem: Problem, config: KernelConfig, arch: ArchSpec, *,
                 warp_specialized: bool = False) -> str | None:
    """Why ``config`` cannot run ``problem`` on ``arch``, or None when it may."""
    if config.block_m not in BLOCK_M or config.block_n not in BLOCK_N:
        return (f"block_m={config.block_m}, block_n={config.block_n}: the sm_90a forward "
                f"takes block_m in {BLOCK_M} (warpgroups of 64 rows) and block_n in {BLOCK_N} "
                "(the N of its wgmma)")
    if config.num_warps != warps(config.block_m):
        return (f"num_warps={config.num_warps}: the sm_90a forward runs one warpgroup per 64 "
                f"query rows, {warps(config.block_m)} warps for block_m={config.block_m}")
    if config.num_stages not in NUM_STAGES:
        return f"num_stages={config.num_stages}: expected one of {NUM_STAGES}"
    if problem.head_dim == 256 and config.num_stages == 1:
        # Measured: NVRTC 13 for sm_90a gives these kernels 255 registers and 12 bytes of
        # spills (with two stages the same tile needs 251 and does not spill).
        return ("head_dim 256 with one stage spills registers (255 + 12 bytes of spills with "
                "NVRTC 13 for sm_90a); use two or more stages")
    return resource_reason(smem_bytes(problem, config, warp_specialized=warp_specialized),
                           accumulator_registers(problem, config), arch,
                           MAX_ACCUMULATOR_REGISTERS)
