"""The decode kernel's search space, static rules and default configs.

block_m: packed query rows (group x seqlen_q) per block; a group whose rows fit one block
reads each K/V element once. block_n: keys per tile; num_warps split the block's rows in
m16 slabs (KernelConfig requires block_m to be a multiple of 16 x num_warps);
num_stages: K/V tiles in flight; splits: the number of splits of each sequence's keys
(0, the default, leaves it to FlashAttention-2's heuristic at run time; a tuned bucket may
fix it); splitsize: keys per split of the bucket's sequences, chosen on the device
(``splits.SplitTable``). An explicit ``num_splits`` of the caller wins over all.

``covering_config``: a launch whose packed rows (group x query rows) exceed block_m runs a
tile raised to cover them in one row block (more warps, the same rows per warp), so each
K/V element is read once per (sequence, kv head).
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
#: The split-size knob: keys per split for the sequences of the bucket (0: none), the
#: bucket's entry of the split table the kernel reads on the device (``splits.SplitTable``).
SPLIT_SIZE = "splitsize"
SPLIT_SIZE_VALUES = (0, 256, 1024, 4096, 16384)

SPACE = ParamSpace((Param("block_m", (16, 32, 64, 128)), Param("block_n", (32, 64, 128)),
                    Param("num_warps", (1, 2, 4, 8)), Param("num_stages", (1, 2, 3)),
                    Param(SPLITS, SPLIT_VALUES), Param(SPLIT_SIZE, SPLIT_SIZE_VALUES)))

#: Shared-memory rows are padded by 8 elements (16 bytes): the eight rows of an ldmatrix
#: phase then fall in distinct banks.
SMEM_ROW_PAD = 8
#: The block's flag word (16 bytes) after the tiles.
_FLAGS_BYTES = 16

#: Defaults in order of preference, each for head dims up to its bound; the first that
#: serves the head dim and passes the static rules on an arch wins. 64 packed rows on 4
#: warps (FlashAttention-2's split-KV tile: a group of up to 64 query rows reads each K/V
#: element once), key tiles as large as the accumulators allow without spilling, two K/V
#: buffers; then smaller tiles for archs with less shared memory. Registers are NVRTC 13's
#: for sm_80, sm_86 and sm_90, fp16 and bf16, plain, causal, with window + softcap + ALiBi
#: and with a block mask (tests/decode/test_decode_defaults.py compiles them: no spills).
DEFAULTS: tuple[tuple[int, KernelConfig, str], ...] = (
    (64, KernelConfig(64, 128, 4, 2), "64 packed rows on 4 warps, 128-key tiles in two "
                                      "buffers (83 KB: 2 blocks per SM on sm_80/sm_90; "
                                      "168-240 registers, no spills)"),
    (96, KernelConfig(64, 64, 4, 2), "64 packed rows on 4 warps, 64-key tiles in two "
                                     "buffers (65 KB, 164-168 registers, no spills; 32-key "
                                     "tiles spill up to 56 B here)"),
    # 64-key tiles spill at head dim 128: 32 B with a block mask on sm_80/sm_86, 60 B for
    # the plain kernel on sm_90 (ptxas stops at 168 registers); one 64-key buffer still
    # spills 44 B with a block mask on sm_80/sm_86.
    (128, KernelConfig(64, 32, 4, 2), "64 packed rows on 4 warps, 32-key tiles in two "
                                      "buffers (52 KB, 166-168 registers: 3 blocks per SM "
                                      "on sm_80/sm_90, 1 in sm_86's 100 KB; no spills, "
                                      "where 64-key tiles spill up to 60 B)"),
    (256, KernelConfig(64, 32, 4, 2), "64 packed rows on 4 warps, 32-key tiles in two "
                                      "buffers (101 KB, 244-250 registers: the accumulators "
                                      "of large head dims, no spills)"),
    (256, KernelConfig(64, 32, 4, 1), "64 packed rows on 4 warps, one 32-key buffer: fits "
                                      "100 KB of shared memory at head dim 256"),
    (256, KernelConfig(16, 32, 1, 1), "the smallest tile: one warp, one 32-key buffer"),
    # Q/K of 512 or 576 beside V's column chunk of at most 256: O's accumulators are head
    # dim 256's, Q's and K's rows twice as wide in shared memory. Measured with NVRTC 13
    # (plain and with window + softcap + ALiBi, no spills): 512/256 takes 244-254 registers;
    # 576's longer Q K^T spills on 4 warps x 32 keys and runs 2 warps x 16 keys instead.
    (512, KernelConfig(64, 32, 4, 2), "64 packed rows on 4 warps, 32-key tiles in two "
                                      "buffers (Q/K of 512: 167 KB, sm_90)"),
    (512, KernelConfig(64, 32, 4, 1), "64 packed rows on 4 warps, one 32-key buffer (Q/K of "
                                      "512: 117 KB, sm_80)"),
    (512, KernelConfig(32, 32, 2, 1), "32 packed rows on 2 warps, one 32-key buffer: Q/K of "
                                      "512 in 100 KB of shared memory"),
    (576, KernelConfig(32, 16, 2, 1), "32 packed rows on 2 warps, one 16-key buffer: Q/K of "
                                      "576 without spills (65 KB)"),
)


def smem_bytes(problem: Problem, config: KernelConfig) -> int:
    """Q tile and num_stages K tiles (rows of Q/K's padded head dim), num_stages V tiles
    (rows of V's), and the flag word."""
    row = (problem.padded_head_dim + SMEM_ROW_PAD) * problem.dtype.itemsize
    v_row = (problem.padded_v_head_dim + SMEM_ROW_PAD) * problem.dtype.itemsize
    return (row * (config.block_m + config.num_stages * config.block_n)
            + v_row * config.num_stages * config.block_n + _FLAGS_BYTES)


def config_splits(config: KernelConfig) -> int:
    """The config's split count, 0 for the heuristic."""
    value = config.extra(SPLITS, 0)
    return value if isinstance(value, int) else -1


def config_split_size(config: KernelConfig) -> int:
    """The config's split size (keys per split), 0 when it has none."""
    value = config.extra(SPLIT_SIZE, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def static_check(problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
    """Why ``config`` cannot run ``problem`` on ``arch``, or None."""
    unknown = sorted({name for name, _ in config.extras} - {SPLITS, SPLIT_SIZE})
    if unknown:
        return f"the decode kernel has no knob {unknown} (it has {SPLITS}, {SPLIT_SIZE})"
    knobs = {name for name, _ in config.extras}
    if SPLITS in knobs and config_splits(config) not in SPLIT_VALUES[1:]:
        return (f"{SPLITS}={config.extra(SPLITS, 0)!r} is not a split count of "
                f"{list(SPLIT_VALUES[1:])} (leave the knob out for the heuristic)")
    if SPLIT_SIZE in knobs and config_split_size(config) not in SPLIT_SIZE_VALUES[1:]:
        return (f"{SPLIT_SIZE}={config.extra(SPLIT_SIZE, 0)!r} is not a split size of "
                f"{list(SPLIT_SIZE_VALUES[1:])} (leave the knob out for none)")
    if config_splits(config) and config_split_size(config):
        return (f"{SPLITS}={config_splits(config)} and {SPLIT_SIZE}="
                f"{config_split_size(config)} both fix the splits; keep one of them")
    return resource_reason(smem_bytes(problem, config), accumulator_registers(problem, config),
                           arch, MAX_ACCUMULATOR_REGISTERS)


def default_entry(problem: Problem, arch: ArchSpec) -> tuple[KernelConfig, str]:
    """The first default that serves ``problem`` on ``arch``, and why it is the default."""
    for bound, config, reason in DEFAULTS:
        if problem.padded_head_dim <= bound and static_check(problem, config, arch) is None:
            return config, reason
    raise InvalidConfig(f"no default decode config fits {problem.key()} on {arch.name}")


#: The most packed rows one block covers (KernelConfig's largest block_m).
MAX_COVER_ROWS = 256
#: Keys per tile x padded head dim a 16-warp covering tile holds at most (registers).
_WIDE_BLOCK_KEYS = 2048


def covering_config(problem: Problem, config: KernelConfig, rows: int, arch: ArchSpec
                    ) -> KernelConfig:
    """The tile that runs ``rows`` packed rows (group x query rows) of ``problem`` in one
    row block on ``arch``: ``config`` when its block_m covers them; else block_m raised to
    the next power of two >= rows with the same rows per warp (more warps), the widest key
    tile (up to config's, narrower with 16 warps: 128 registers per thread) and the most
    stages (up to config's) that pass the static rules. ``config`` itself (row blocks that
    each read K/V) when no such tile fits ``arch`` or rows exceed MAX_COVER_ROWS."""
    if rows <= config.block_m or rows > MAX_COVER_ROWS:
        return config
    block_m = 1 << (rows - 1).bit_length()
    block_m = max(block_m, 16)
    warp_rows = config.block_m // config.num_warps
    warps = max(1, block_m // warp_rows)
    while warps > 16:
        warps //= 2
    # 16 warps leave 128 registers per thread: the key tile shrinks with the head dim so
    # that the S and O accumulators fit without spilling (32 keys at head dim 64, 16 at 128;
    # none at 256: those rows stay in several row blocks).
    widest = config.block_n if warps <= 8 else min(config.block_n,
                                                   _WIDE_BLOCK_KEYS // problem.padded_head_dim)
    tiles = [(n, st) for n in (128, 64, 32, 16) for st in (config.num_stages, 2, 1)
             if 16 <= n <= widest and st <= config.num_stages]
    values = config.to_dict()
    for block_n, stages in dict.fromkeys(tiles):
        candidate = KernelConfig.from_dict({**values, "block_m": block_m, "num_warps": warps,
                                            "block_n": block_n, "num_stages": stages})
        if static_check(problem, candidate, arch) is None:
            return candidate
    return config
