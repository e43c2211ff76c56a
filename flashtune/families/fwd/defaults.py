"""Default forward-kernel configs: what the dispatcher runs when nothing is tuned.

One entry per (arch class, compiled head dim, causal); the classes (codegen.arch.ArchClass):

- ``sm80``: A100/A30 and Orin (sm_80, sm_87), 164 KB per SM;
- ``sm86``: consumer Ampere, Ada and Blackwell (sm_86, sm_89, sm_120), 100 KB per SM;
- ``sm90``: H100/H200 and B200 (sm_90, sm_100), 228 KB per SM.

How the entries are chosen: by the rule of ``flashtune.perf.model.default_rule``, which compiles
(NVRTC 13, every arch of the class, fp16 and bf16) and asks the cost model; this table is
its result, checked in so that nothing compiles at import, and ``python
docs/default_configs.py --check`` re-derives it. Among the tiles of the forward space with
the structure knobs (knobs.py) at their defaults, keep those that compile for every arch of
the class in both dtypes, keep the spill rule, keep two resident blocks and eight warps per
SM (eight warps in one block where no tile can keep two), and whose unmasked loop is at
most FlashAttention-2's same-tile count where reference/fa2-sass-facts.md gives one; then
take the cost model's best PREDICTION (the model ranks every candidate without compiling,
then the 12 best of that ranking again with their SASS and compiled registers; a current
default within 1% of the best stays). The model
is asked about FlashAttention's benchmark point at 4k tokens: batch 4, seqlen 4096, hidden
size 2048 (2048 // head dim heads), bf16, on the class's reference GPU (sm80: A100, sm86:
RTX 3090, sm90: H100). Predictions are the model's, not measurements.

The spill rule (``perf.sass.loops.MAX_LOCAL_ACCESSES``): a config may spill as long as no
local-memory access sits in a tensor-core chain and each main loop makes at most 8 of them
per iteration (FA2's own d128 tile makes 12).

Each reason starts with the rule's facts (``default_rule.Choice.reason``): registers (the
most over the class's archs and dtypes), resident blocks per SM (the fewest), local-memory
accesses per main-loop iteration (the most), and the best-predicted tile the filters ruled
out with why; where the rule changed an entry, the previous default's predicted time.
"""

from __future__ import annotations

import dataclasses

from flashtune.codegen.arch import ArchClass, ArchSpec, arch_class, get_arch
from flashtune.codegen.features import mods_of
from flashtune.codegen.score_mods import POINTER_TYPES
from flashtune.codegen.spec import MAX_HEAD_DIM, KernelConfig, Problem
from flashtune.errors import InvalidConfig
from flashtune.families.defaults import DefaultEntry
from flashtune.families.fwd.space import static_check

_A, _C, _H = ArchClass.SM80, ArchClass.SM86, ArchClass.SM90

#: The arch of each class whose kernels the cost model ranks (and the docs show).
REFERENCE_ARCH: dict[ArchClass, str] = {_A: "sm_80", _C: "sm_86", _H: "sm_90"}


# (class, compiled head dim, causal, config key, reason): the rule's output (see above).
_ROWS: tuple[tuple[ArchClass, int, bool, str, str], ...] = (
    # -- sm80: A100-class, 164 KB shared memory per SM; the model's GPU: A100 --------
    (_A, 32, False, "m128_n128_w4_s2", "kept: m128_n128_w4_s1, the best predicted (A100, 4k), "
                                       "gives only 0.2% less predicted time; 255 regs, 2 "
                                       "blocks/SM, no local memory in the loop; m256_n128_w8_s2 "
                                       "(0.7% less predicted time) is out: 1 block/SM on sm_80, "
                                       "registers the limit (the floor: 2 blocks, 8 warps)"),
    (_A, 32, True, "m128_n128_w4_s2", "kept: m128_n128_w4_s1, the best predicted (A100, 4k), gives"
                                      " only 0.2% less predicted time; 255 regs, 2 blocks/SM, no "
                                      "local memory in the loop; m128_n128_w8_s2 (0.6% less "
                                      "predicted time) is out: 1 block/SM on sm_80, registers the "
                                      "limit (the floor: 2 blocks, 8 warps)"),
    (_A, 64, False, "m128_n128_w4_s1", "best predicted of 139 tiles (A100, 4k); 255 regs, 2 "
                                       "blocks/SM, no local memory in the loop"),
    (_A, 64, True, "m128_n128_w4_s1", "kept: m64_n128_w4_s2, the best predicted (A100, 4k), gives "
                                      "only 0.3% less predicted time; 255 regs, 2 blocks/SM, no "
                                      "local memory in the loop"),
    (_A, 96, False, "m64_n128_w4_s1", "best predicted of 71 tiles (A100, 4k); 168 regs, 2 "
                                      "blocks/SM, no local memory in the loop; previous default "
                                      "m128_n64_w4_s2: this tile's predicted time is 4.2% lower"),
    (_A, 96, True, "m64_n128_w4_s1", "best predicted of 71 tiles (A100, 4k); 208 regs, 2 "
                                     "blocks/SM, no local memory in the loop; previous default "
                                     "m128_n64_w4_s2: this tile's predicted time is 4.1% lower"),
    (_A, 128, False, "m64_n112_w4_s1", "best predicted of 32 tiles (A100, 4k); 168 regs, 2 "
                                       "blocks/SM, no local memory in the loop; previous default "
                                       "m128_n32_w4_s2: this tile's predicted time is 7.4% lower"),
    (_A, 128, True, "m64_n96_w4_s1", "best predicted of 32 tiles (A100, 4k); 194 regs, 2 "
                                     "blocks/SM, no local memory in the loop; previous default "
                                     "m128_n32_w4_s2: this tile's predicted time is 8.6% lower"),
    (_A, 160, False, "m64_n80_w4_s1", "best predicted of 18 tiles (A100, 4k); 168 regs, 2 "
                                      "blocks/SM, no local memory in the loop; previous default "
                                      "m128_n32_w4_s1: this tile's predicted time is 6.2% lower"),
    (_A, 160, True, "m64_n64_w4_s1", "best predicted of 18 tiles (A100, 4k); 168 regs, 2 "
                                     "blocks/SM, no local memory in the loop; previous default "
                                     "m128_n32_w4_s1: this tile's predicted time is 17.1% lower; "
                                     "m128_n32_w4_s1 is out: 10 local accesses a tile on sm_80 "
                                     "(over 8)"),
    (_A, 192, False, "m64_n64_w4_s1", "best predicted of 10 tiles (A100, 4k); 171 regs, 2 "
                                      "blocks/SM, no local memory in the loop"),
    (_A, 192, True, "m64_n64_w4_s1", "best predicted of 10 tiles (A100, 4k); 177 regs, 2 "
                                     "blocks/SM, no local memory in the loop"),
    (_A, 224, False, "m64_n48_w4_s1", "best predicted of 6 tiles (A100, 4k); 168 regs, 2 "
                                      "blocks/SM, no local memory in the loop; previous default "
                                      "m64_n32_w4_s1: this tile's predicted time is 4.5% lower"),
    (_A, 224, True, "m64_n48_w4_s1", "best predicted of 6 tiles (A100, 4k); 172 regs, 2 blocks/SM,"
                                     " no local memory in the loop; previous default "
                                     "m64_n32_w4_s1: this tile's predicted time is 4.1% lower"),
    (_A, 256, False, "m64_n32_w4_s1", "best predicted of 3 tiles (A100, 4k); 172 regs, 2 "
                                      "blocks/SM, no local memory in the loop"),
    (_A, 256, True, "m64_n32_w4_s1", "best predicted of 3 tiles (A100, 4k); 233 regs, 2 blocks/SM,"
                                     " no local memory in the loop"),
    # -- sm86: consumer GPUs, 100 KB shared memory per SM; the model's GPU: RTX 3090 ---
    (_C, 32, False, "m128_n128_w4_s1", "best predicted of 165 tiles (RTX3090, 4k); 254 regs, 2 "
                                       "blocks/SM, no local memory in the loop"),
    (_C, 32, True, "m128_n128_w4_s1", "kept: m64_n64_w4_s3, the best predicted (RTX3090, 4k), "
                                      "gives only 0.2% less predicted time; 255 regs, 2 blocks/SM,"
                                      " no local memory in the loop"),
    (_C, 64, False, "m128_n64_w4_s1", "best predicted of 58 tiles (RTX3090, 4k); 208 regs, 2 "
                                      "blocks/SM, no local memory in the loop"),
    (_C, 64, True, "m64_n64_w4_s2", "best predicted of 58 tiles (RTX3090, 4k); 128 regs, 2 "
                                    "blocks/SM, no local memory in the loop; previous default "
                                    "m128_n64_w4_s1: this tile's predicted time is 2.5% lower"),
    (_C, 96, False, "m64_n64_w4_s1", "best predicted of 20 tiles (RTX3090, 4k); 128 regs, 2 "
                                     "blocks/SM, no local memory in the loop; previous default "
                                     "m128_n32_w4_s1: this tile's predicted time is 3.1% lower"),
    (_C, 96, True, "m64_n64_w4_s1", "best predicted of 20 tiles (RTX3090, 4k); 138 regs, 2 "
                                    "blocks/SM, no local memory in the loop; previous default "
                                    "m128_n32_w4_s1: this tile's predicted time is 4.8% lower"),
    (_C, 128, False, "m64_n32_w4_s1", "best predicted of 7 tiles (RTX3090, 4k); 132 regs, 2 "
                                      "blocks/SM, no local memory in the loop"),
    (_C, 128, True, "m64_n32_w4_s1", "best predicted of 7 tiles (RTX3090, 4k); 134 regs, 2 "
                                     "blocks/SM, no local memory in the loop"),
    (_C, 160, False, "m64_n32_w4_s1", "kept: m64_n16_w4_s1, the best predicted (RTX3090, 4k), "
                                      "gives only 0.0% less predicted time; 130 regs, 2 blocks/SM,"
                                      " no local memory in the loop"),
    (_C, 160, True, "m64_n32_w4_s1", "kept: m64_n16_w4_s1, the best predicted (RTX3090, 4k), gives"
                                     " only 0.0% less predicted time; 130 regs, 2 blocks/SM, no "
                                     "local memory in the loop"),
    (_C, 192, False, "m64_n16_w4_s1", "the one candidate tile (RTX3090, 4k); 128 regs, 2 "
                                      "blocks/SM, no local memory in the loop; previous default "
                                      "m128_n32_w8_s1: this tile's predicted time is 1.5% higher; "
                                      "m128_n32_w8_s1 is out: 1 block/SM on sm_86, registers the "
                                      "limit (the floor: 2 blocks, 8 warps)"),
    (_C, 192, True, "m64_n16_w4_s1", "the one candidate tile (RTX3090, 4k); 158 regs, 2 blocks/SM,"
                                     " no local memory in the loop; previous default "
                                     "m128_n32_w8_s1: this tile's predicted time is 5.1% lower; "
                                     "m128_n32_w8_s1 is out: 1 block/SM on sm_86, registers the "
                                     "limit (the floor: 2 blocks, 8 warps)"),
    (_C, 224, False, "m64_n16_w4_s1", "the one candidate tile (RTX3090, 4k); 166 regs, 2 "
                                      "blocks/SM, no local memory in the loop; previous default "
                                      "m128_n32_w8_s1: this tile's predicted time is 0.1% higher; "
                                      "m128_n32_w8_s1 is out: 1 block/SM on sm_86, registers the "
                                      "limit (the floor: 2 blocks, 8 warps)"),
    (_C, 224, True, "m64_n16_w4_s1", "the one candidate tile (RTX3090, 4k); 164 regs, 2 blocks/SM,"
                                     " no local memory in the loop; previous default "
                                     "m128_n32_w8_s1: this tile's predicted time is 3.2% lower; "
                                     "m128_n32_w8_s1 is out: 1 block/SM on sm_86, registers the "
                                     "limit (the floor: 2 blocks, 8 warps)"),
    (_C, 256, False, "m128_n16_w8_s2", "best predicted of 3 tiles (RTX3090, 4k); 170 regs, 1 "
                                       "block/SM, no local memory in the loop; previous default "
                                       "m128_n32_w8_s1: this tile's predicted time is 10.6% lower"),
    (_C, 256, True, "m128_n16_w8_s2", "best predicted of 3 tiles (RTX3090, 4k); 174 regs, 1 "
                                      "block/SM, no local memory in the loop; previous default "
                                      "m128_n32_w8_s1: this tile's predicted time is 10.5% lower"),
    # -- sm90: H100-class, 228 KB shared memory per SM; the model's GPU: H100 --------
    (_H, 32, False, "m128_n128_w4_s2", "kept: m128_n128_w4_s1, the best predicted (H100, 4k), "
                                       "gives only 0.1% less predicted time; 255 regs, 2 "
                                       "blocks/SM, no local memory in the loop; m128_n256_w8_s2 "
                                       "(1.7% less predicted time) is out: 1 block/SM on sm_90, "
                                       "registers the limit (the floor: 2 blocks, 8 warps)"),
    (_H, 32, True, "m128_n128_w4_s2", "kept: m128_n128_w4_s1, the best predicted (H100, 4k), gives"
                                      " only 0.1% less predicted time; 255 regs, 2 blocks/SM, no "
                                      "local memory in the loop"),
    (_H, 64, False, "m128_n128_w4_s1", "best predicted of 172 tiles (H100, 4k); 255 regs, 2 "
                                       "blocks/SM, no local memory in the loop; m256_n128_w8_s2 "
                                       "(0.3% less predicted time) is out: 1 block/SM on sm_90, "
                                       "registers the limit (the floor: 2 blocks, 8 warps); "
                                       "previous default m128_n64_w4_s2: this tile's predicted "
                                       "time is 2.6% lower"),
    (_H, 64, True, "m128_n128_w4_s2", "best predicted of 172 tiles (H100, 4k); 255 regs, 2 "
                                      "blocks/SM, no local memory in the loop; m128_n128_w8_s2 "
                                      "(2.3% less predicted time) is out: 1 block/SM on sm_90, "
                                      "registers the limit (the floor: 2 blocks, 8 warps)"),
    (_H, 96, False, "m128_n64_w4_s2", "kept: m128_n64_w4_s1, the best predicted (H100, 4k), gives "
                                      "only 0.2% less predicted time; 255 regs, 2 blocks/SM, no "
                                      "local memory in the loop; m256_n64_w8_s2 (0.4% less "
                                      "predicted time) is out: 1 block/SM on sm_90, registers the "
                                      "limit (the floor: 2 blocks, 8 warps)"),
    (_H, 96, True, "m128_n64_w4_s1", "best predicted of 109 tiles (H100, 4k); 254 regs, 2 "
                                     "blocks/SM, no local memory in the loop; m128_n96_w8_s2 (0.4%"
                                     " less predicted time) is out: 1 block/SM on sm_90, registers"
                                     " the limit (the floor: 2 blocks, 8 warps); previous default "
                                     "m128_n32_w4_s2: this tile's predicted time is 4.6% lower"),
    (_H, 128, False, "m128_n64_w4_s2", "best predicted of 67 tiles (H100, 4k); 255 regs, 2 "
                                       "blocks/SM, no local memory in the loop; m128_n64_w4_s1 "
                                       "(0.1% less predicted time) is out: 14 local accesses a "
                                       "tile on sm_100 (over 8); previous default m128_n32_w4_s2: "
                                       "this tile's predicted time is 3.2% lower"),
    (_H, 128, True, "m64_n64_w2_s1", "best predicted of 67 tiles (H100, 4k); 255 regs, 4 "
                                     "blocks/SM, 2 local accesses a tile; m128_n64_w4_s1 (0.2% "
                                     "less predicted time) is out: 16 local accesses a tile on "
                                     "sm_100 (over 8); previous default m128_n32_w4_s2: this "
                                     "tile's predicted time is 1.7% lower"),
    (_H, 160, False, "m128_n16_w4_s2", "best predicted of 41 tiles (H100, 4k); 240 regs, 2 "
                                       "blocks/SM, no local memory in the loop; m128_n32_w4_s2 "
                                       "(6.2% less predicted time) is out: 10 local accesses a "
                                       "tile on sm_100 (over 8); previous default m128_n32_w4_s2: "
                                       "this tile's predicted time is 6.6% higher"),
    (_H, 160, True, "m64_n128_w4_s1", "best predicted of 41 tiles (H100, 4k); 255 regs, 2 "
                                      "blocks/SM, no local memory in the loop; m128_n32_w4_s2 "
                                      "(10.7% less predicted time) is out: 10 local accesses a "
                                      "tile on sm_100 (over 8); previous default m128_n32_w4_s2: "
                                      "this tile's predicted time is 11.9% higher"),
    (_H, 192, False, "m64_n112_w4_s1", "best predicted of 20 tiles (H100, 4k); 243 regs, 2 "
                                       "blocks/SM, no local memory in the loop; previous default "
                                       "m64_n64_w4_s1: this tile's predicted time is 2.1% lower"),
    (_H, 192, True, "m64_n96_w4_s1", "best predicted of 20 tiles (H100, 4k); 254 regs, 2 "
                                     "blocks/SM, no local memory in the loop; previous default "
                                     "m64_n64_w4_s1: this tile's predicted time is 6.2% lower"),
    (_H, 224, False, "m64_n64_w4_s1", "kept: m64_n80_w4_s1, the best predicted (H100, 4k), gives "
                                      "only 0.1% less predicted time; 227 regs, 2 blocks/SM, no "
                                      "local memory in the loop"),
    (_H, 224, True, "m64_n64_w4_s1", "best predicted of 13 tiles (H100, 4k); 236 regs, 2 "
                                     "blocks/SM, no local memory in the loop"),
    (_H, 256, False, "m64_n64_w4_s1", "best predicted of 10 tiles (H100, 4k); 239 regs, 2 "
                                      "blocks/SM, no local memory in the loop"),
    (_H, 256, True, "m64_n64_w4_s1", "best predicted of 10 tiles (H100, 4k); 250 regs, 2 "
                                     "blocks/SM, no local memory in the loop"),
)

DEFAULT_TABLE: tuple[DefaultEntry, ...] = tuple(
    DefaultEntry(cls, hd, causal, KernelConfig.from_key(key), reason)
    for cls, hd, causal, key, reason in _ROWS
)
_BY_KEY: dict[tuple[ArchClass, int, bool], DefaultEntry] = {e.key: e for e in DEFAULT_TABLE}

#: The widest key tile of a default whose score modification loads captured tensors: their
#: index arithmetic and loads need registers the table's widest tiles leave no room for
#: (d64's m128_n128: 184 B/thread of spills on sm_80 with a T5 bias; m128_n64: none).
CAPTURED_MOD_BLOCK_N = 64

#: Used only when an entry does not fit an arch (one with less shared memory than its
#: class): the smallest tile of the space, 66 KB at head dim 256.
FALLBACK = KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=1)


def _spec(arch: ArchSpec | str) -> ArchSpec:
    return arch if isinstance(arch, ArchSpec) else get_arch(arch)


def default_entry(problem: Problem, arch: ArchSpec | str) -> DefaultEntry:
    """The table entry that serves ``problem`` on ``arch`` (by compiled head dim; with V's
    head dim split from Q/K's, the wider of the two: its tile holds the other's rows and
    accumulators too)."""
    dim = max(problem.padded_head_dim, problem.padded_v_head_dim)
    key = (arch_class(_spec(arch)), dim, problem.causal)
    try:
        return _BY_KEY[key]
    except KeyError:
        raise InvalidConfig(f"the default table has no entry for {key}; every class, "
                            f"compiled head dim and mask must have one") from None


def captures_tensors(problem: Problem) -> bool:
    """Whether one of ``problem``'s score modifications loads captured tensors."""
    return any(p.type in POINTER_TYPES for _, mod in mods_of(problem.features)
               for p in mod.params)


def _for_mods(problem: Problem, config: KernelConfig) -> KernelConfig:
    """``config`` with its key tile narrowed to CAPTURED_MOD_BLOCK_N for a problem whose
    modification loads captured tensors."""
    if captures_tensors(problem) and config.block_n > CAPTURED_MOD_BLOCK_N:
        return dataclasses.replace(config, block_n=CAPTURED_MOD_BLOCK_N)
    return config


def default_reason(problem: Problem, arch: ArchSpec | str) -> str:
    """Why ``default_config`` chose what it did: the table entry's reason, and the key
    tile's narrowing for a modification that loads captured tensors."""
    if problem.head_dim > MAX_HEAD_DIM:
        return (f"the widest of {', '.join(c.key() for c in WIDE_DEFAULTS)} that fits: 16 "
                f"rows a warp over 32-key tiles, Q read from shared memory (Q/K's head dim "
                f"{problem.head_dim} beside V's {problem.v_head_dim})")
    entry = default_entry(problem, arch)
    reason = entry.reason
    if problem.split_head_dims:
        reason = (f"{reason} (the entry of the wider head dim, "
                  f"{max(problem.padded_head_dim, problem.padded_v_head_dim)}, for Q/K's "
                  f"{problem.head_dim} and V's {problem.v_head_dim})")
    mods = _for_mods(problem, entry.config)
    if mods != entry.config:
        reason = (f"{reason}; its key tile narrowed to {CAPTURED_MOD_BLOCK_N} for a score "
                  "modification that loads captured tensors (their indices and loads take "
                  "the registers the wider tile leaves)")
    if _for_split(problem, mods) != mods:
        reason = (f"{reason}; {SPLIT_V_WIDER_MIN_WARPS} warps for V wider than Q/K (the "
                  "fewer warps' tile spills there)")
    return reason


#: The fewest warps of a default for a problem whose V head dim is wider than Q/K's: the
#: table's 2-warp tile (d128 causal on sm90-class GPUs, 32 rows a warp) spills there (NVRTC
#: 13, sm_90, d64 / v128: 92 B, the same tile at d128 4 B); four warps of 16 rows hold
#: half the accumulators each (151 registers, no spill).
SPLIT_V_WIDER_MIN_WARPS = 4


def _for_split(problem: Problem, config: KernelConfig) -> KernelConfig:
    """``config`` with at least SPLIT_V_WIDER_MIN_WARPS warps for a problem whose V head
    dim is wider than Q/K's (its block_m split over more warps where it can be)."""
    if (problem.v_head_dim > problem.head_dim and config.num_warps < SPLIT_V_WIDER_MIN_WARPS
            and config.block_m % (16 * SPLIT_V_WIDER_MIN_WARPS) == 0):
        return dataclasses.replace(config, num_warps=SPLIT_V_WIDER_MIN_WARPS)
    return config


#: The defaults of a Q/K head dim above 256 (spec.WIDE_HEAD_DIMS, V's at most 256), the
#: first that fits the arch: 32-key tiles of 16 rows a warp with Q read from shared memory
#: (NVRTC 13, sm_80, bf16 causal, 576 / 256: m64_n32_w4_s1 232 registers, 126 KB, no
#: spills; 512 / 256 with two stages 163 KB; 64-key tiles spill 128 B at 512); 32 rows for
#: the GPUs of 100 KB (90 KB at 576).
WIDE_DEFAULTS = (KernelConfig(64, 32, 4, 2), KernelConfig(64, 32, 4, 1),
                 KernelConfig(32, 32, 2, 1))


def _wide_default(problem: Problem, arch: ArchSpec) -> KernelConfig:
    for config in WIDE_DEFAULTS:
        if static_check(problem, config, arch) is None:
            return config
    why = static_check(problem, WIDE_DEFAULTS[-1], arch)
    raise InvalidConfig(f"no default config fits {problem.key()} on {arch.name}: "
                        f"{', '.join(c.key() for c in WIDE_DEFAULTS)} are ruled out ({why})")


def default_config(problem: Problem, arch: ArchSpec | str) -> KernelConfig:
    """The config to run ``problem`` on ``arch`` (an ArchSpec or a name such as "sm_90")
    when nothing is tuned; it always passes ``static_check`` for that arch (an
    InvalidConfig says so when no config could)."""
    arch = _spec(arch)
    if problem.head_dim > MAX_HEAD_DIM:
        return _wide_default(problem, arch)
    entry = default_entry(problem, arch)
    for config in (_for_split(problem, _for_mods(problem, entry.config)), FALLBACK):
        if static_check(problem, config, arch) is None:
            return config
    why = static_check(problem, FALLBACK, arch)
    raise InvalidConfig(f"no default config fits {problem.key()} on {arch.name}: the table's "
                        f"{entry.config.key()} and the fallback {FALLBACK.key()} are both "
                        f"ruled out ({why}); tune this problem or add a smaller fallback")
