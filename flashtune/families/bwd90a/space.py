"""The search space of the sm_90a backward (``bwd90a``): legal values and static rules with
reasons.

One warpgroup (4 warps, 128 threads) per 64 keys of a block: block_n 64 or 128 is one or two
warpgroups. A config's num_warps is a warpgroup's 4 (its 16-row slabs of the 64-row query
tile, as KernelConfig counts them) and not a knob; the block's threads are ``threads``.
Query tiles are 64 rows (block_m 64, the M of the dQ wgmma and the N of S^T's); one stage
(Q and dO are loaded by every thread with cp.async before each step: no stage ring yet).
The knob ``dqmode`` chooses how dQ is summed over key tiles: float32 atomics (``atomic``,
the default) or per-block slices summed in a fixed order by the convert kernel (``split``,
deterministic: bitwise equal over block orders).

Rules: head dims 64 and 128 (whole 128-byte swizzle panels; 256 would hold dK and dV, 256
float32 registers per thread, beside S^T and dP^T); the tiles fit the per-block shared
memory; and the accumulators stay within a thread's registers (``accumulator_registers``).
"""

from __future__ import annotations

from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.params import Param, ParamSpace
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.families.base import resource_reason
from flashtune.families.bwd.space import DQ_ATOMIC, DQ_MODES, DQ_SPLIT, dq_mode, dq_mode_reason

__all__ = ["BLOCK_M", "BLOCK_N", "DETERMINISTIC_SPACE", "DQ_ATOMIC", "DQ_MODES", "DQ_SPLIT",
           "HEAD_DIMS", "SPACE",
           "WARPS", "accumulator_registers", "dq_mode", "smem_bytes", "static_check", "threads"]

BLOCK_M = (64,)
BLOCK_N = (64, 128)
NUM_STAGES = (1,)
HEAD_DIMS = (64, 128)

SPACE = ParamSpace((Param("block_m", BLOCK_M), Param("block_n", BLOCK_N),
                    Param("num_stages", NUM_STAGES), Param("dqmode", DQ_MODES)))
#: The deterministic family's space (``bwd90adet``): the split mode only.
DETERMINISTIC_SPACE = ParamSpace((*SPACE.params[:3], Param("dqmode", (DQ_SPLIT,))))

#: The tiles start on a 1024-byte boundary of the shared window (128B swizzle), found at run
#: time: this much slack is allocated.
ALIGN_SLACK = 1024

#: The most accumulator registers per thread (``accumulator_registers``) that compile without
#: spills, measured with NVRTC 13 for sm_90a (``compile_source``, bf16 causal, both dQ modes):
#: 256 (head dim 128, block_n 128) compiles clean at 255 registers; 288 (head dim 128,
#: block_n 64: one warpgroup computes all 128 dQ columns) spills 100 to 116 bytes.
MAX_ACCUMULATOR_REGISTERS = 256


#: A config's num_warps: the 4 warps of one warpgroup.
WARPS = 4


def threads(config: KernelConfig) -> int:
    """Threads per block: a warpgroup (128) per 64 keys."""
    return 128 * (config.block_n // 64)


def smem_bytes(problem: Problem, config: KernelConfig) -> int:
    """K and V (block_n rows), Q and dO (block_m rows), the dS tile (block_m x block_n), the
    LSE and D rows (float32) and the alignment slack; equals HopperBwdTraits::kSmemBytes."""
    row = problem.head_dim * problem.dtype.itemsize
    return (row * (2 * config.block_n + 2 * config.block_m)
            + config.block_m * config.block_n * problem.dtype.itemsize
            + 2 * config.block_m * 4 + ALIGN_SLACK)


def accumulator_registers(problem: Problem, config: KernelConfig) -> int:
    """Per thread: dK and dV (head_dim / 2 float32 each), S^T and dP^T (block_m / 2 each),
    their packed A fragments (block_m / 4 each) and the warpgroup's dQ columns (head_dim /
    warpgroups, half of them per thread)."""
    dq_cols = problem.head_dim // (config.block_n // 64)
    return problem.head_dim + config.block_m + config.block_m // 2 + dq_cols // 2


def static_check(problem: Problem, config: KernelConfig, arch: ArchSpec, *,
                 deterministic: bool = False) -> str | None:
    """Why ``config`` cannot run ``problem`` on ``arch``, or None when it may (knobs the
    family does not declare are refused before: ``KernelFamily.static_check``)."""
    why = dq_mode_reason(config, deterministic)
    if why is not None:
        return why
    if config.block_m not in BLOCK_M or config.block_n not in BLOCK_N:
        return (f"block_m={config.block_m}, block_n={config.block_n}: the sm_90a backward "
                f"takes block_m in {BLOCK_M} (the M of its dQ wgmma) and block_n in {BLOCK_N} "
                "(one warpgroup per 64 keys)")
    if config.num_warps != WARPS:
        return (f"num_warps={config.num_warps}: a config of the sm_90a backward names one "
                f"warpgroup's {WARPS} warps (the block runs one warpgroup per 64 keys)")
    if config.num_stages not in NUM_STAGES:
        return (f"num_stages={config.num_stages}: the sm_90a backward loads Q and dO once per "
                f"step (no stage ring); expected one of {NUM_STAGES}")
    return resource_reason(smem_bytes(problem, config), accumulator_registers(problem, config),
                           arch, MAX_ACCUMULATOR_REGISTERS)
