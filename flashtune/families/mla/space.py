"""The MLA decode kernel's search space, static rules and default configs.

block_m: packed query rows (heads x query rows) per block; every row block reads the
split's latent rows once, so a block that covers all of a sequence's packed rows reads each
latent byte once (the minimum). block_n: keys per latent tile; num_warps: row warps (each
owns block_m / num_warps rows, in m16 slabs); ``colwarps``: warps that split O's 512
columns (and the tile's keys in S = Q L^T), so a block has num_warps x colwarps warps;
num_stages: latent tiles in shared memory (1: one buffer, refilled after each tile; with an
FP8 latent cache, buffers of raw FP8 rows beside one dequantised 16-bit tile);
splits: the number of splits of each sequence's keys (0, the default: FlashAttention-2's
heuristic at run time).
"""

from __future__ import annotations

from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.params import Param, ParamSpace
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.errors import InvalidConfig
from flashtune.families.mla import fp8

#: The latent's first NOPE_DIM values are also V (DeepSeek's kv_lora_rank).
NOPE_DIM = 512
#: The warps over O's columns knob.
COL_WARPS = "colwarps"
COL_WARP_VALUES = (1, 2, 4, 8)
#: The split-count knob: 0 is the run-time heuristic (the default), else a fixed count.
SPLITS = "splits"
SPLIT_VALUES = (0, 1, 2, 4, 8, 16, 32, 64, 128)

SPACE = ParamSpace((Param("block_m", (16, 32, 64)), Param("block_n", (16, 32, 64)),
                    Param("num_warps", (1, 2, 4)), Param("num_stages", (1, 2, 3)),
                    Param(COL_WARPS, COL_WARP_VALUES), Param(SPLITS, SPLIT_VALUES)))

#: Latent and Q rows are padded by 8 elements (16 bytes): ldmatrix phases hit distinct banks.
ROW_PAD = 8
#: Registers per SM (every arch the family serves): a block's threads share them.
_REGS_PER_SM = 65536
#: Registers per thread beyond the accumulators: B fragments, addresses, softmax state, and
#: per further m16 tile of a warp its Q/P fragments and their addresses (calibrated with
#: NVRTC: two m16 tiles with 144 accumulator registers reach 255 registers and spill on
#: sm_80 causal; with 136 they take 208; one m16 tile with 136 takes 232).
_WORKING_REGISTERS = 48
_WORKING_PER_M_TILE = 64
#: The most threads a block has (the register file must hold them all at 128 each).
MAX_THREADS = 512

#: Defaults in order of preference; the first that passes the static rules on an arch wins.
DEFAULTS: tuple[tuple[KernelConfig, str], ...] = (
    (KernelConfig(64, 32, 4, 2, extras=((COL_WARPS, 2),)),
     "64 packed rows (16 heads x 4 query rows, or 64 heads x 1: one latent read per "
     "split) on 4 x 2 warps (256 O columns, 136 accumulator registers per thread), "
     "32-key latent tiles in two buffers (160 KB)"),
    (KernelConfig(64, 32, 4, 1, extras=((COL_WARPS, 2),)),
     "64 packed rows on 4 x 2 warps as above, one buffer: an FP8 latent cache's raw rows "
     "beside the dequantised tile fit sm_80's 163 KB (147,984 B)"),
    (KernelConfig(32, 32, 2, 1, extras=((COL_WARPS, 4),)),
     "32 packed rows on 2 x 4 warps (128 O columns each), one 32-key latent buffer: "
     "fits 99 KB of shared memory (sm_86, sm_89)"),
    (KernelConfig(16, 16, 1, 1, extras=((COL_WARPS, 2),)),
     "the smallest tile: 16 packed rows, 2 warps over O's columns, one 16-key buffer"),
)


def latent_dim(problem: Problem) -> int:
    """Values per latent row: NOPE_DIM plus the problem's RoPE dims (its head_dim)."""
    return NOPE_DIM + problem.head_dim


def col_warps(config: KernelConfig) -> int:
    """Warps over O's columns (1 without the knob)."""
    value = config.extra(COL_WARPS, 1)
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def config_splits(config: KernelConfig) -> int:
    """The config's split count, 0 for the heuristic."""
    value = config.extra(SPLITS, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def threads(config: KernelConfig) -> int:
    """Threads of one block: 32 x num_warps x colwarps."""
    return config.threads * max(col_warps(config), 1)


def fp8_cache(problem: Problem) -> bool:
    """Whether the problem's latent cache holds FlashMLA's FP8 rows (K/V type e4m3)."""
    return problem.dtypes.fp8


def smem_bytes(problem: Problem, config: KernelConfig) -> int:
    """Q tile, num_stages latent tiles (padded rows; with an FP8 cache one tile and
    num_stages buffers of raw 656-byte rows), S (float32), P, two float32 words per row
    (rescale factor, 1 / sum) and the 16-byte flag word (templates/mla_decode.cuh)."""
    e = problem.dtype.itemsize
    row = (latent_dim(problem) + ROW_PAD) * e
    m, n = config.block_m, config.block_n
    tiles, raw = ((1, config.num_stages * n * fp8.ROW_BYTES) if fp8_cache(problem)
                  else (config.num_stages, 0))
    return (row * (m + tiles * n) + raw + m * (n + 4) * 4 + m * (n + 8) * e + 8 * m + 16)


def accumulator_registers(config: KernelConfig) -> int:
    """32-bit registers per thread held by a warp's O slice and S slice."""
    cw = max(col_warps(config), 1)
    return config.rows_per_warp * (NOPE_DIM // cw + config.block_n // cw) // 32


def static_check(problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
    """Why ``config`` cannot run ``problem`` on ``arch``, or None."""
    unknown = sorted({name for name, _ in config.extras} - {COL_WARPS, SPLITS})
    if unknown:
        return f"the MLA kernel has no knob {unknown} (it has {COL_WARPS}, {SPLITS})"
    cw = col_warps(config)
    if cw not in COL_WARP_VALUES:
        return f"{COL_WARPS}={config.extra(COL_WARPS, 1)!r} is not one of {list(COL_WARP_VALUES)}"
    if SPLITS in {name for name, _ in config.extras} and config_splits(config) not in \
            SPLIT_VALUES[1:]:
        return (f"{SPLITS}={config.extra(SPLITS, 0)!r} is not a split count of "
                f"{list(SPLIT_VALUES[1:])} (leave the knob out for the heuristic)")
    if config.block_n % (8 * cw):
        return (f"block_n={config.block_n} keys cannot be split in n8 tiles over "
                f"{COL_WARPS}={cw}; expected a multiple of {8 * cw}")
    count = threads(config)
    if count > MAX_THREADS:
        return f"{count} threads per block exceed {MAX_THREADS} (registers)"
    if count < config.block_m:
        return (f"{count} threads cannot give each of block_m={config.block_m} rows a softmax "
                f"thread; expected num_warps x {COL_WARPS} >= {-(-config.block_m // 32)}")
    smem = smem_bytes(problem, config)
    if smem > arch.max_smem_per_block:
        return (f"shared memory {smem} B exceeds the {arch.name} per-block limit "
                f"{arch.max_smem_per_block} B")
    working = _WORKING_REGISTERS + _WORKING_PER_M_TILE * (config.rows_per_warp // 16 - 1)
    budget = min(arch.max_regs_per_thread, _REGS_PER_SM // count) - working
    acc = accumulator_registers(config)
    if acc > budget:
        return (f"accumulators need {acc} registers per thread, over the {budget} that "
                f"{count} threads leave beside {working} working registers (raise "
                f"{COL_WARPS} or num_warps, or lower block_m)")
    return None


def default_entry(problem: Problem, arch: ArchSpec) -> tuple[KernelConfig, str]:
    """The first default that passes the static rules on ``arch``, and why it is the
    default."""
    for config, reason in DEFAULTS:
        if static_check(problem, config, arch) is None:
            return config, reason
    raise InvalidConfig(f"no default MLA config fits {problem.key()} on {arch.name}")
