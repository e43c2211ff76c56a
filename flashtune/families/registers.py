"""The accumulator-register rule of the mma.sync attention kernels (the forward and split-KV
decoding): the O and S fragments a warp holds across its main loop, and the most of them a
thread can hold without spilling.

Both kernels give each warp m16 slabs of query rows, keep S = Q K^T of one key tile and the
O accumulator in float32 registers, and work on the head dim rounded up to the k16 step, so
one rule serves both (``resource_reason`` applies it).
"""

from __future__ import annotations

from flashtune.codegen.spec import KernelConfig, Problem

#: A config whose held fragments (O and S accumulators, and Q or a second S tile where the
#: forward's knobs keep them) need more 32-bit registers per thread than this cannot avoid
#: spilling within the 255-register limit: the rest of the kernel's working set (B
#: operands, P, softmax state, addresses) needs about a quarter of the registers.
MAX_ACCUMULATOR_REGISTERS = 192


def mma_head_dim(problem: Problem) -> int:
    """Head dim the tensor cores work on: the real one rounded up to the k16 step.

    Shared-memory rows are sized by the compiled (padded) head dim, but the kernels compute
    only up to this many columns (the rest of a padded row is never read).
    """
    return -(-problem.head_dim // 16) * 16


def mma_v_head_dim(problem: Problem) -> int:
    """V's (and O's) head dim as the tensor cores work on it, rounded up like Q/K's."""
    return -(-problem.v_head_dim // 16) * 16


def accumulator_registers(problem: Problem, config: KernelConfig) -> int:
    """32-bit registers per thread held by the O and S accumulator fragments (O is V's head
    dim wide, rounded up to the k16 step like Q/K's)."""
    return config.rows_per_warp * (mma_v_head_dim(problem) + config.block_n) // 32
