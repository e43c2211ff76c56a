"""The search space of the sm_90a backward (``bwd90a``): legal values and static rules with
reasons.

One warpgroup (4 warps, 128 threads) per 64 keys of a block: block_n 64 or 128 is one or two
warpgroups; at head dim 256 two per 64 keys, each owning half of the head dim of dK and dV
(``dim_groups``: dK and dV of 64 keys by 256 columns are 256 float32 registers per thread).
A config's num_warps is a warpgroup's 4 (its 16-row slabs of the 64-row query tile, as
KernelConfig counts them) and not a knob; the block's threads are ``threads``.
Query tiles are 64 rows (block_m 64, the M of the dQ wgmma and the N of S^T's); one stage
(Q and dO are loaded by every thread with cp.async before each step: no stage ring yet).
The knob ``dqmode`` chooses how dQ is summed over key tiles: float32 atomics (``atomic``,
the default) or per-block slices summed in a fixed order by the convert kernel (``split``,
deterministic: bitwise equal over block orders).

Rules: head dims 64, 128 and 256 (whole 128-byte swizzle panels, rows of 16-byte chunks that
divide the block's threads); the tiles fit the per-block shared memory; the accumulators stay
within a thread's registers (``accumulator_registers``); and the block's threads at those
registers fit the SM's register file (``register_file_reason``).
"""

from __future__ import annotations

from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.features import mods_of
from flashtune.codegen.params import Param, ParamSpace
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.families.base import resource_reason
from flashtune.families.bwd.space import DQ_ATOMIC, DQ_MODES, DQ_SPLIT, dq_mode, dq_mode_reason

__all__ = ["BLOCK_M", "BLOCK_N", "DETERMINISTIC_SPACE", "DQ_ATOMIC", "DQ_MODES", "DQ_SPLIT",
           "HEAD_DIMS", "SPACE", "WARPS", "accumulator_registers", "dim_groups", "dq_mode",
           "register_file_reason", "smem_bytes", "static_check", "threads"]

BLOCK_M = (64,)
BLOCK_N = (64, 128)
NUM_STAGES = (1,)
HEAD_DIMS = (64, 128, 256)

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


#: Registers a thread needs beside its accumulators (addresses, indices, loop state), counted
#: against the register file.
REGISTER_OVERHEAD = 24

#: A config's num_warps: the 4 warps of one warpgroup.
WARPS = 4


def dim_groups(problem: Problem) -> int:
    """Warpgroups that share 64 keys, each owning head_dim / dim_groups columns of dK and dV:
    2 over head dim 128, and at 128 with declared score modifications (their functor and
    dscore stores take the registers of half of dK and dV), else 1
    (HopperBwdTraits::kDimGroups)."""
    modified = bool(mods_of(problem.features))
    return 2 if problem.head_dim > 128 or (modified and problem.head_dim == 128) else 1


def threads(problem: Problem, config: KernelConfig) -> int:
    """Threads per block: a warpgroup (128) per 64 keys and head-dim share."""
    return 128 * (config.block_n // 64) * dim_groups(problem)


def smem_bytes(problem: Problem, config: KernelConfig) -> int:
    """K and V (block_n rows), Q and dO (block_m rows), the dS tile (block_m x block_n), the
    LSE and D rows (float32) and the alignment slack; equals HopperBwdTraits::kSmemBytes."""
    row = problem.head_dim * problem.dtype.itemsize
    return (row * (2 * config.block_n + 2 * config.block_m)
            + config.block_m * config.block_n * problem.dtype.itemsize
            + 2 * config.block_m * 4 + ALIGN_SLACK)


def accumulator_registers(problem: Problem, config: KernelConfig) -> int:
    """Per thread: dK and dV (head_dim / dim_groups / 2 float32 each), S^T and dP^T
    (block_m / 2 each), their packed A fragments (block_m / 4 each) and the dQ columns of one
    wgmma, half of them per thread: the warpgroup's head_dim / warpgroups, or 64 at a time
    where the head dim is split (HopperBwdTraits::kDqChunk)."""
    warpgroups = threads(problem, config) // 128
    dq_cols = 64 if dim_groups(problem) > 1 else problem.head_dim // warpgroups
    return (problem.head_dim // dim_groups(problem) + config.block_m + config.block_m // 2
            + dq_cols // 2)


def register_file_reason(problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
    """Why the block cannot hold its accumulators in the SM's register file (a thread holds
    them plus REGISTER_OVERHEAD for addresses and indices, up to the per-thread maximum), or
    None."""
    block = threads(problem, config)
    per_thread = min(accumulator_registers(problem, config) + REGISTER_OVERHEAD,
                     arch.max_regs_per_thread)
    if block * per_thread > arch.regs_per_sm:
        return (f"block_n={config.block_n} at head dim {problem.head_dim}: {block} threads x "
                f"{per_thread} registers = {block * per_thread} exceed the "
                f"{arch.regs_per_sm} registers of an {arch.name} SM; expected block_n 64")
    return None


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
    return (register_file_reason(problem, config, arch)
            or resource_reason(smem_bytes(problem, config),
                               accumulator_registers(problem, config), arch,
                               MAX_ACCUMULATOR_REGISTERS))
