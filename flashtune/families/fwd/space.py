"""The search space of the forward kernel: legal values and static constraints.

``SPACE`` declares the tunables; ``static_check`` says, for one arch, why a config can never
work (or None). Every rule that removes a config returns a reason a person can read.
"""

from __future__ import annotations

from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.params import Param, ParamSpace
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.families.base import resource_reason

BLOCK_M = (64, 128)
BLOCK_N = (32, 64, 128)
NUM_WARPS = (4, 8)
NUM_STAGES = (1, 2, 3)

SPACE = ParamSpace((Param("block_m", BLOCK_M), Param("block_n", BLOCK_N),
                    Param("num_warps", NUM_WARPS), Param("num_stages", NUM_STAGES)))

#: Shared-memory rows are padded by this many 16-bit elements (16 bytes), which makes the
#: eight 16-byte row addresses of an ldmatrix phase fall in distinct banks.
SMEM_ROW_PAD = 8

#: A config whose accumulators alone (O and S fragments) need more 32-bit registers per
#: thread than this cannot avoid spilling within the 255-register limit.
MAX_ACCUMULATOR_REGISTERS = 192


def smem_bytes(problem: Problem, config: KernelConfig) -> int:
    """Dynamic shared memory of one block: the Q tile plus num_stages K and V tiles."""
    row = (problem.padded_head_dim + SMEM_ROW_PAD) * problem.dtype.itemsize
    return row * (config.block_m + 2 * config.num_stages * config.block_n)


def mma_head_dim(problem: Problem) -> int:
    """Head dim the tensor cores work on: the real one rounded up to the k16 step.

    Shared-memory rows are sized by the compiled (padded) head dim, but the kernel computes
    only up to this many columns (the rest of a padded row is never read).
    """
    return -(-problem.head_dim // 16) * 16


def accumulator_registers(problem: Problem, config: KernelConfig) -> int:
    """32-bit registers per thread held by the O and S accumulator fragments."""
    return config.rows_per_warp * (mma_head_dim(problem) + config.block_n) // 32


def static_check(problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
    """Why ``config`` cannot run ``problem`` on ``arch``, or None when it may."""
    return resource_reason(smem_bytes(problem, config), accumulator_registers(problem, config),
                           arch, MAX_ACCUMULATOR_REGISTERS)
