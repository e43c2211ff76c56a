"""The decode kernel's search space, static rules and default configs.

block_m: packed query rows (group x seqlen_q) per block; a group whose rows fit one block
reads each K/V element once. block_n: keys per tile; num_warps split the block's rows in
m16 slabs (KernelConfig requires block_m to be a multiple of 16 x num_warps);
num_stages: K/V tiles in flight; splits: the number of splits of each sequence's keys
(0, the default, leaves it to FlashAttention-2's heuristic at run time; a tuned bucket may
fix it). An explicit ``num_splits`` of the caller wins over both.
"""

from __future__ import annotations

from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.params import Param, ParamSpace
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.errors import InvalidConfig
from flashtune.families.base import resource_reason
from flashtune.families.registers import MAX_ACCUMULATOR_REGISTERS, accumulator_registers

#: The split-count knob: 0 is the run-time heuristic (the default), else a fixed count.
SPLITS = "splits"
SPLIT_VALUES = (0, 1, 2, 4, 8, 16, 32, 64, 128)

SPACE = ParamSpace((Param("block_m", (16, 32, 64, 128)), Param("block_n", (32, 64, 128)),
                    Param("num_warps", (1, 2, 4, 8)), Param("num_stages", (1, 2, 3)),
                    Param(SPLITS, SPLIT_VALUES)))

#: Shared-memory rows are padded by 8 elements (16 bytes): the eight rows of an ldmatrix
#: phase then fall in distinct banks.
SMEM_ROW_PAD = 8
#: The block's flag word (16 bytes) after the tiles.
_FLAGS_BYTES = 16

#: Defaults in order of preference, each for head dims up to its bound; the first that
#: serves the head dim and passes the static rules on an arch wins. 64 packed rows on 4
#: warps (FlashAttention-2's split-KV tile: a group of up to 64 query rows reads each K/V
#: element once), key tiles as large as the accumulators and shared memory allow, two K/V
#: buffers; then smaller tiles for archs with less shared memory.
DEFAULTS: tuple[tuple[int, KernelConfig, str], ...] = (
    (64, KernelConfig(64, 128, 4, 2), "64 packed rows on 4 warps, 128-key tiles in two "
                                      "buffers (83 KB: 2 blocks per SM on sm_80/sm_90)"),
    (128, KernelConfig(64, 64, 4, 2), "64 packed rows on 4 warps, 64-key tiles in two "
                                      "buffers (87 KB: 2 blocks per SM on sm_80/sm_90)"),
    (256, KernelConfig(64, 32, 4, 2), "64 packed rows on 4 warps, 32-key tiles in two "
                                      "buffers (the accumulators of large head dims)"),
    (256, KernelConfig(64, 32, 4, 1), "64 packed rows on 4 warps, one 32-key buffer: fits "
                                      "100 KB of shared memory at head dim 256"),
    (256, KernelConfig(16, 32, 1, 1), "the smallest tile: one warp, one 32-key buffer"),
)


def smem_bytes(problem: Problem, config: KernelConfig) -> int:
    """Q tile, num_stages K and V tiles (padded rows), and the flag word."""
    row = (problem.padded_head_dim + SMEM_ROW_PAD) * problem.dtype.itemsize
    return row * (config.block_m + 2 * config.num_stages * config.block_n) + _FLAGS_BYTES


def config_splits(config: KernelConfig) -> int:
    """The config's split count, 0 for the heuristic."""
    value = config.extra(SPLITS, 0)
    return value if isinstance(value, int) else -1


def static_check(problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
    """Why ``config`` cannot run ``problem`` on ``arch``, or None."""
    if config_splits(config) not in SPLIT_VALUES[1:] and config.extras:
        return (f"{SPLITS}={config.extra(SPLITS, 0)!r} is not a split count of "
                f"{list(SPLIT_VALUES[1:])} (leave the knob out for the heuristic)")
    return resource_reason(smem_bytes(problem, config), accumulator_registers(problem, config),
                           arch, MAX_ACCUMULATOR_REGISTERS)


def default_entry(problem: Problem, arch: ArchSpec) -> tuple[KernelConfig, str]:
    """The first default that serves ``problem`` on ``arch``, and why it is the default."""
    for bound, config, reason in DEFAULTS:
        if problem.padded_head_dim <= bound and static_check(problem, config, arch) is None:
            return config, reason
    raise InvalidConfig(f"no default decode config fits {problem.key()} on {arch.name}")
