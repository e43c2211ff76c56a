"""The search space of the forward kernel: legal values and static constraints.

``search_space`` is the full default space; ``static_check`` says, for one arch, why a
config can never work (or None); ``candidates`` is the space minus those. Every rule that
removes a config returns a reason a person can read.
"""

from __future__ import annotations

import itertools

from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.errors import InvalidConfig

BLOCK_M = (64, 128)
BLOCK_N = (32, 64, 128)
NUM_WARPS = (4, 8)
NUM_STAGES = (1, 2, 3)

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


def search_space(problem: Problem) -> list[KernelConfig]:
    """Every structurally legal config of the default space, in a stable order."""
    out: list[KernelConfig] = []
    for m, n, w, s in itertools.product(BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES):
        try:
            out.append(KernelConfig(block_m=m, block_n=n, num_warps=w, num_stages=s))
        except InvalidConfig:
            continue
    return out


def static_check(problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
    """Why ``config`` cannot run ``problem`` on ``arch``, or None when it may."""
    smem = smem_bytes(problem, config)
    if smem > arch.max_smem_per_block:
        return (f"shared memory {smem} B exceeds the {arch.name} per-block limit "
                f"{arch.max_smem_per_block} B")
    regs = accumulator_registers(problem, config)
    if regs > MAX_ACCUMULATOR_REGISTERS:
        return (f"accumulators need {regs} registers per thread, over the "
                f"{MAX_ACCUMULATOR_REGISTERS} that leave room below {arch.max_regs_per_thread}")
    return None


def candidates(problem: Problem, arch: ArchSpec) -> list[KernelConfig]:
    """The search space minus every config that static_check rules out for ``arch``."""
    return [c for c in search_space(problem) if static_check(problem, c, arch) is None]
