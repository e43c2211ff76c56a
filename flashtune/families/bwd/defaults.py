"""Default backward main-kernel configs: what the dispatcher runs when nothing is tuned.

One entry per (arch class, compiled head dim), the same for both masks; ``bwd`` runs it with
float32 dQ atomics, ``bwddet`` (deterministic) with the same tile and dQ slices.

How the entries were chosen (NVRTC 13.0 ``--ptxas-options=-v``, no GPU): walk the search
space from the largest key tile down (block_n, then block_m, more warps first, two Q/dO
buffers before one) and take the first config that fits the class's shared memory and
compiles without register spills on every arch of the class, fp16 causal and bf16 full
(FlashAttention-2 also favours wide key tiles in its backward: they amortise the streaming
of Q and dO and the dQ additions over more keys). Every entry runs one block of 4 or 8
warps per SM; the reason names the most registers per thread over the class and the
shared memory per block. These are compile-time choices: tuning on the GPU
(``flashtune tune --op bwd``) replaces them where it finds faster ones.
"""

from __future__ import annotations

import dataclasses

from flashtune.codegen.arch import ArchClass, ArchSpec, arch_class, get_arch
from flashtune.codegen.spec import MAX_HEAD_DIM, WIDE_HEAD_DIMS, KernelConfig, Problem
from flashtune.errors import FeatureNotSupported, InvalidConfig
from flashtune.families.bwd.space import DQ_ATOMIC, DQ_SPLIT, smem_bytes, static_check
from flashtune.families.defaults import DefaultEntry

_A, _C, _H = ArchClass.SM80, ArchClass.SM86, ArchClass.SM90
_FIRST = "largest key tile without spills"

# (class, compiled head dim, tile key without the dQ mode, reason).
_ROWS: tuple[tuple[ArchClass, int, str, str], ...] = (
    # -- sm80: A100-class, 163 KB of shared memory per block ------------------------------
    (_A, 32, "m128_n128_w8_s2", f"FA2's 128x128 tile; {_FIRST}, 255 regs, 130 KB"),
    (_A, 64, "m128_n64_w8_s2", "128x128 spills (bf16); 128x64 with two Q/dO buffers, "
                               "166 regs, 128 KB"),
    (_A, 96, "m128_n64_w8_s1", "128x128 spills; two buffers exceed 163 KB; 128x64, "
                               "179 regs, 115 KB"),
    (_A, 128, "m128_n64_w8_s1", f"{_FIRST} (128 keys spill); one buffer, 227 regs, 139 KB"),
    (_A, 160, "m128_n64_w8_s1", f"{_FIRST}; one buffer, 239 regs, 163 KB"),
    (_A, 192, "m128_n32_w4_s1", "64-key tiles exceed 163 KB and 128x32 over 8 warps spills "
                                "(bf16); 4 warps, 255 regs, 146 KB"),
    (_A, 224, "m64_n32_w4_s2", "128-row tiles exceed 163 KB or spill; 64x32 with two "
                               "buffers, 246 regs, 156 KB"),
    (_A, 256, "m64_n32_w4_s1", f"{_FIRST} within 163 KB; 254 regs, 110 KB"),
    # -- sm86: consumer Ampere, Ada, Blackwell: 99 KB of shared memory per block ------------
    (_C, 32, "m128_n64_w8_s2", "64x128 over 4 warps spills; 128x64 with two buffers, "
                               "128 regs, 88 KB"),
    (_C, 64, "m128_n64_w8_s1", f"{_FIRST} within 99 KB; 171 regs, 91 KB"),
    (_C, 96, "m64_n64_w4_s2", f"{_FIRST} within 99 KB; 246 regs, 97 KB"),
    (_C, 128, "m64_n32_w4_s1", "64-key tiles exceed 99 KB or spill; 64x32, 168 regs, 62 KB"),
    (_C, 160, "m64_n16_w4_s1", "32-key tiles spill (bf16) or exceed 99 KB; 64x16, 129 regs, "
                               "59 KB"),
    (_C, 192, "m64_n32_w4_s1", f"{_FIRST} within 99 KB; 218 regs, 86 KB"),
    (_C, 224, "m64_n32_w4_s1", f"{_FIRST} within 99 KB; 245 regs, 98 KB"),
    (_C, 256, "m64_n16_w4_s1", "32-key tiles exceed 99 KB or need 256 accumulator regs; "
                               "64x16, 231 regs, 89 KB"),
    # -- sm90: H100/H200 and B200, 227 KB of shared memory per block -----------------------
    (_H, 32, "m128_n128_w8_s2", f"FA2's 128x128 tile; {_FIRST}, 254 regs, 130 KB"),
    (_H, 64, "m128_n64_w8_s2", "128x128 spills (bf16); 128x64 with two buffers, 232 regs "
                               "(sm_100), 128 KB"),
    (_H, 96, "m128_n64_w8_s2", f"{_FIRST}; two buffers, 235 regs, 168 KB"),
    (_H, 128, "m128_n64_w8_s2", f"{_FIRST} (128 keys spill); two buffers, 237 regs, 208 KB"),
    (_H, 160, "m128_n64_w8_s1", "two buffers exceed 227 KB; one, 239 regs, 163 KB"),
    (_H, 192, "m128_n64_w8_s1", f"{_FIRST}; one buffer, 248 regs, 187 KB"),
    (_H, 224, "m128_n64_w8_s1", f"{_FIRST}; one buffer, 254 regs, 211 KB"),
    (_H, 256, "m128_n32_w8_s1", "64-key tiles exceed 227 KB; 128x32, 171 regs, 186 KB"),
)


def _with_mode(key: str, mode: str) -> KernelConfig:
    return KernelConfig.from_key(f"{key}_dqmode-{mode}")


DEFAULT_TABLE: tuple[DefaultEntry, ...] = tuple(
    DefaultEntry(cls, hd, causal, _with_mode(key, DQ_ATOMIC), reason)
    for cls, hd, key, reason in _ROWS for causal in (False, True)
)
_BY_KEY = {e.key: e for e in DEFAULT_TABLE}

#: Used only when an entry does not fit an arch or a real head dim (a padded one whose
#: head-dim tiles do not split over the entry's warps, e.g. 232 -> 240 columns over 4):
#: two small tiles whose warps split the head dim in two at most, the last fitting every
#: arch and head dim.
FALLBACKS = (KernelConfig(64, 32, 4, 1, extras=(("dqmode", DQ_ATOMIC),)),
             KernelConfig(32, 16, 2, 1, extras=(("dqmode", DQ_ATOMIC),)))


@dataclasses.dataclass(frozen=True)
class WideDefault:
    """The default config of one (arch class, Q/K head dim above 256, V's head dim class:
    at most 256, or 512 or 576 itself), both masks, and why."""

    arch_class: ArchClass
    head_dim: int
    v_head_dim: int
    key: str
    reason: str

    def __post_init__(self) -> None:
        if self.head_dim not in WIDE_HEAD_DIMS or not (
                self.v_head_dim == MAX_HEAD_DIM or self.v_head_dim in WIDE_HEAD_DIMS):
            raise InvalidConfig(f"wide default ({self.head_dim}, {self.v_head_dim}): expected "
                                f"Q/K's head dim in {WIDE_HEAD_DIMS} and V's class "
                                f"{MAX_HEAD_DIM} or one of {WIDE_HEAD_DIMS}")
        if not self.reason.strip():
            raise InvalidConfig(f"wide default {self.key} needs a reason")

    @property
    def config(self) -> KernelConfig:
        return _with_mode(self.key, DQ_ATOMIC)


_NOSPILL = "NVRTC 13, bf16 full and fp16 causal, no spills"
# Q/K head dims 512 and 576 in output column chunks (space.CHUNKS). Chosen like the table
# above over the wide space (NVRTC 13.0, no GPU): the first config without spills in the
# order 4 warps before 2, fewer chunks (less recomputation of S and dP) before more, wider
# key tiles, two Q/dO buffers before one. Shared memory holds Q, K, V and dO full width,
# so 16- and 32-key tiles of 32 or 64 rows are what fit.
WIDE_DEFAULTS: tuple[WideDefault, ...] = (
    # -- sm80 (163 KB): 64 rows fit beside V of 256 only; a wider V takes 32-row tiles ----
    WideDefault(_A, 512, 256, "m64_n16_w4_s1_chunks-1", f"one chunk; {_NOSPILL}, "
                "241 regs, 129 KB"),
    WideDefault(_A, 576, 256, "m64_n16_w4_s1_chunks-1", f"one chunk; {_NOSPILL}, "
                "241 regs, 139 KB"),
    WideDefault(_A, 512, 512, "m32_n16_w2_s1_chunks-2", "64 rows exceed 163 KB; two "
                f"chunks; {_NOSPILL}, 246 regs, 100 KB"),
    WideDefault(_A, 576, 512, "m32_n16_w2_s1_chunks-4", "64 rows exceed 163 KB; two chunks "
                f"spill; four, {_NOSPILL}, 228 regs, 106 KB"),
    WideDefault(_A, 576, 576, "m32_n16_w2_s1_chunks-2", "64 rows exceed 163 KB; two "
                f"chunks (four spill in bwddet, fp16 causal); {_NOSPILL}, 254 regs, 113 KB"),
    # -- sm86 (99 KB): V of 256 only (a V of 512 needs at least 100 KB: refused) -----------
    WideDefault(_C, 512, 256, "m32_n16_w2_s1_chunks-2", "64 rows exceed 99 KB; one chunk "
                f"needs 208 accumulator regs; two, {_NOSPILL}, 76 KB"),
    WideDefault(_C, 576, 256, "m32_n16_w2_s1_chunks-2", "64 rows exceed 99 KB; one chunk "
                f"needs 208 accumulator regs; two, {_NOSPILL}, 82 KB"),
    # -- sm90 (227 KB): 64 rows over 16 keys in one chunk ---------------------------------
    WideDefault(_H, 512, 256, "m64_n16_w4_s1_chunks-1", f"one chunk; {_NOSPILL}, "
                "236 regs, 129 KB"),
    WideDefault(_H, 576, 256, "m64_n16_w4_s1_chunks-1", f"one chunk; {_NOSPILL}, "
                "237 regs, 139 KB"),
    WideDefault(_H, 512, 512, "m64_n16_w4_s1_chunks-1", f"one chunk; {_NOSPILL}, "
                "241 regs, 169 KB"),
    WideDefault(_H, 576, 512, "m64_n16_w4_s1_chunks-1", f"one chunk; {_NOSPILL}, "
                "248 regs, 179 KB"),
    WideDefault(_H, 576, 576, "m64_n16_w4_s1_chunks-1", f"one chunk; {_NOSPILL}, "
                "246 regs, 189 KB"),
)
_WIDE_BY_KEY = {(e.arch_class, e.head_dim, e.v_head_dim): e for e in WIDE_DEFAULTS}


def wide_default(problem: Problem, arch: ArchSpec | str) -> WideDefault:
    """The WIDE_DEFAULTS entry of ``problem`` (Q/K's head dim above 256) on ``arch``;
    FeatureNotSupported, naming the shared memory it needs and the arch's, where the
    class has none (a V of 512 or 576 on 99 KB GPUs)."""
    arch = _spec(arch)
    v = problem.v_head_dim if problem.v_head_dim > MAX_HEAD_DIM else MAX_HEAD_DIM
    entry = _WIDE_BY_KEY.get((arch_class(arch), problem.head_dim, v))
    if entry is None:
        least = min(smem_bytes(problem, c) for c in FALLBACKS)
        raise FeatureNotSupported(
            f"the backward of Q/K head dim {problem.head_dim} with V's {problem.v_head_dim} "
            f"({problem.key()}) needs at least {least} B of shared memory per block (Q, K, V "
            f"and dO tiles full width, 32 query rows and 16 keys), over the {arch.name} "
            f"per-block limit {arch.max_smem_per_block} B; it runs on sm_80 (163 KB) and "
            f"sm_90-class GPUs (227 KB); here V's head dim must be at most {MAX_HEAD_DIM}")
    return entry


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
        raise InvalidConfig(f"the backward default table has no entry for {key}") from None


def _mode(config: KernelConfig, deterministic: bool) -> KernelConfig:
    if not deterministic:
        return config
    extras = tuple((k, DQ_SPLIT if k == "dqmode" else v) for k, v in config.extras)
    return KernelConfig(config.block_m, config.block_n, config.num_warps, config.num_stages,
                        extras=extras)


def default_config(problem: Problem, arch: ArchSpec | str, *, deterministic: bool = False
                   ) -> KernelConfig:
    """The config to run ``problem`` on ``arch`` when nothing is tuned (the split dQ mode
    when ``deterministic``); it always passes the static rules (InvalidConfig when no
    config could)."""
    arch = _spec(arch)
    if problem.head_dim > MAX_HEAD_DIM:
        return _wide_config(problem, arch, deterministic)
    entry = default_entry(problem, arch)
    for config in (entry.config, *FALLBACKS):
        config = _mode(config, deterministic)
        if static_check(problem, config, arch, deterministic=deterministic) is None:
            return config
    raise InvalidConfig(f"no default backward config fits {problem.key()} on {arch.name}: "
                        f"the table's {entry.config.key()} and the fallbacks are all ruled "
                        "out; tune this problem")


#: The fallback of a wide head dim: the smallest tile in the most chunks.
WIDE_FALLBACK = KernelConfig(32, 16, 2, 1, extras=(("dqmode", DQ_ATOMIC), ("chunks", 4)))


def _wide_config(problem: Problem, arch: ArchSpec, deterministic: bool) -> KernelConfig:
    entry = wide_default(problem, arch)
    for config in (entry.config, WIDE_FALLBACK):
        config = _mode(config, deterministic)
        if static_check(problem, config, arch, deterministic=deterministic) is None:
            return config
    why = static_check(problem, _mode(WIDE_FALLBACK, deterministic), arch,
                       deterministic=deterministic)
    raise InvalidConfig(f"no default backward config fits {problem.key()} on {arch.name}: "
                        f"{entry.key} and {WIDE_FALLBACK.key()} are ruled out ({why})")


def default_reason(problem: Problem, arch: ArchSpec | str) -> str:
    """Why ``default_config`` chose what it did (the entry's reason)."""
    if problem.head_dim > MAX_HEAD_DIM:
        entry = wide_default(problem, arch)
        return (f"{entry.reason} (Q/K's head dim {problem.head_dim}, V's "
                f"{problem.v_head_dim}: output column chunks, S and dP recomputed per chunk)")
    return default_entry(problem, arch).reason
