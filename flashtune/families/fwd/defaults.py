"""Default forward-kernel configs: what the dispatcher runs when nothing is tuned.

One entry per (arch class, compiled head dim, causal); the classes (codegen.arch.ArchClass):

- ``sm80``: A100/A30 and Orin (sm_80, sm_87), 164 KB per SM;
- ``sm86``: consumer Ampere, Ada and Blackwell (sm_86, sm_89, sm_120), 100 KB per SM;
- ``sm90``: H100/H200 and B200 (sm_90, sm_100), 228 KB per SM.

How the entries are chosen: by the rule of ``flashtune.perf.default_rule``, which compiles
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

The spill rule (``perf.loops.MAX_LOCAL_ACCESSES``): a config may spill as long as no
local-memory access sits in a tensor-core chain and each main loop makes at most 8 of them
per iteration (FA2's own d128 tile makes 12).

Each reason starts with the rule's facts (``default_rule.Choice.reason``): registers (the
most over the class's archs and dtypes), resident blocks per SM (the fewest), local-memory
accesses per main-loop iteration (the most), and the best-predicted tile the filters ruled
out with why; where the rule changed an entry, the previous default's predicted time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashtune.codegen.arch import ARCH_CLASS, ArchClass, ArchSpec, arch_class, get_arch
from flashtune.codegen.spec import COMPILED_HEAD_DIMS, KernelConfig, Problem
from flashtune.errors import InvalidConfig
from flashtune.families.fwd.space import static_check


@dataclass(frozen=True)
class DefaultEntry:
    """The default config of one (arch class, compiled head dim, causal) and why."""

    arch_class: ArchClass
    head_dim: int
    causal: bool
    config: KernelConfig
    reason: str

    def __post_init__(self) -> None:
        if self.head_dim not in COMPILED_HEAD_DIMS:
            raise InvalidConfig(f"default entry head_dim={self.head_dim} is not a compiled "
                                f"head dim; expected one of {COMPILED_HEAD_DIMS}")
        if not self.reason.strip():
            raise InvalidConfig(f"default entry {self.key} needs a reason")

    @property
    def key(self) -> tuple[ArchClass, int, bool]:
        return (self.arch_class, self.head_dim, self.causal)

    def to_dict(self) -> dict[str, Any]:
        """A flat row for docs and ``flashtune`` listings."""
        return {
            "arch_class": self.arch_class.value,
            "archs": archs_of(self.arch_class),
            "head_dim": self.head_dim,
            "causal": self.causal,
            "config": self.config.key(),
            "reason": self.reason,
        }


_A, _C, _H = ArchClass.SM80, ArchClass.SM86, ArchClass.SM90

#: The arch of each class whose kernels the cost model ranks (and the docs show).
REFERENCE_ARCH: dict[ArchClass, str] = {_A: "sm_80", _C: "sm_86", _H: "sm_90"}


def archs_of(cls: ArchClass) -> list[str]:
    """Every arch flashtune knows in class ``cls``."""
    return [name for name, c in ARCH_CLASS.items() if c is cls]


# (class, compiled head dim, causal, config key, reason): the rule's output (see above).
_ROWS: tuple[tuple[ArchClass, int, bool, str, str], ...] = (
    # -- sm80: A100-class, 164 KB shared memory per SM -----------------------------------
    (_A, 32, False, "m128_n128_w4_s2", "FA2's 128x128 tile; 239 regs, 2 blocks/SM, so a "
                                       "second K/V buffer costs no occupancy"),
    (_A, 32, True, "m128_n128_w4_s2", "FA2's 128x128 tile; 255 regs without spills, "
                                      "2 blocks/SM with two K/V buffers"),
    (_A, 64, False, "m128_n128_w4_s1", "FA2's 128x128 tile; one buffer keeps 2 blocks/SM "
                                       "(two, 92 KB, fit only 1)"),
    (_A, 64, True, "m128_n128_w4_s1", "FA2's 128x128 tile; one buffer keeps 2 blocks/SM "
                                      "(two, 92 KB, fit only 1)"),
    (_A, 96, False, "m128_n64_w4_s2", "FA2's 128x64 tile; 244 regs, two K/V buffers at "
                                      "2 blocks/SM (78 KB each)"),
    (_A, 96, True, "m128_n64_w4_s2", "FA2's 128x64 tile; 243 regs, two K/V buffers at "
                                     "2 blocks/SM (78 KB each)"),
    (_A, 128, False, "m128_n32_w4_s2", "FA2's 128x64 makes 10 local accesses a tile with "
                                       "one buffer (over 8) and fits 1 block/SM with two; "
                                       "128x32 keeps 2 blocks"),
    (_A, 128, True, "m128_n32_w4_s2", "FA2's 128x64 makes 14 local accesses a tile with "
                                      "one buffer (over 8) and fits 1 block/SM with two; "
                                      "128x32 keeps 2 blocks"),
    (_A, 160, False, "m128_n32_w4_s1", "largest tile with 2 blocks/SM and no spills; a "
                                       "second buffer (86 KB) fits only 1 block"),
    (_A, 160, True, "m128_n32_w4_s1", "largest tile with 2 blocks/SM; 10 local accesses a "
                                      "tile, none in a tensor-core chain; a second buffer "
                                      "(86 KB) fits only 1 block"),
    (_A, 192, False, "m64_n64_w4_s1", "FA2's 128x64 8-warp tile fits 1 block/SM here; "
                                      "64x64 (75 KB) keeps 2, 167 regs"),
    (_A, 192, True, "m64_n64_w4_s1", "FA2's 128x64 8-warp tile fits 1 block/SM here; "
                                     "64x64 (75 KB) keeps 2, 167 regs"),
    (_A, 224, False, "m64_n32_w4_s1", "128-row tiles and 64x64 (87 KB) fit 1 block/SM; "
                                      "64x32 (58 KB) keeps 2, 166 regs"),
    (_A, 224, True, "m64_n32_w4_s1", "128-row tiles and 64x64 (87 KB) fit 1 block/SM; "
                                     "64x32 (58 KB) keeps 2, 166 regs"),
    (_A, 256, False, "m64_n32_w4_s1", "FA2's 64x64 fallback (99 KB) fits 1 block/SM; "
                                      "64x32 (66 KB) keeps 2, 231 regs"),
    (_A, 256, True, "m64_n32_w4_s1", "FA2's 64x64 fallback (99 KB) fits 1 block/SM; "
                                     "64x32 (66 KB) keeps 2, 232 regs"),
    # -- sm86: consumer GPUs, 100 KB shared memory per SM ---------------------------------
    (_C, 32, False, "m128_n128_w4_s1", "FA2's 128x128 tile; one K/V buffer (30 KB) keeps "
                                       "2 blocks/SM, 240 regs"),
    (_C, 32, True, "m128_n128_w4_s1", "FA2's 128x128 tile; one K/V buffer (30 KB) keeps "
                                      "2 blocks/SM, 254 regs"),
    (_C, 64, False, "m128_n64_w4_s1", "FA2's 128x128 (54 KB) fits 1 block in 100 KB; "
                                      "128x64 (36 KB) keeps 2, 214 regs"),
    (_C, 64, True, "m128_n64_w4_s1", "FA2's 128x128 (54 KB) fits 1 block in 100 KB; "
                                     "128x64 (36 KB) keeps 2, 218 regs"),
    (_C, 96, False, "m128_n32_w4_s1", "FA2's 128x64 (52 KB) fits 1 block in 100 KB; "
                                      "128x32 (39 KB) keeps 2, 210 regs"),
    (_C, 96, True, "m128_n32_w4_s1", "FA2's 128x64 (52 KB) fits 1 block in 100 KB; "
                                     "128x32 (39 KB) keeps 2, 210 regs"),
    (_C, 128, False, "m64_n32_w4_s1", "FA2's 128x32 (51 KB with padded rows) fits 1 block "
                                      "in 100 KB; 64x32 (34 KB) keeps 2, 125 regs"),
    (_C, 128, True, "m64_n32_w4_s1", "FA2's 64x64 (51 KB with padded rows) fits 1 block "
                                     "in 100 KB; 64x32 (34 KB) keeps 2, 128 regs"),
    (_C, 160, False, "m64_n32_w4_s1", "128-row tiles and 64x64 fit 1 block in 100 KB; "
                                      "64x32 (42 KB) keeps 2, 127 regs"),
    (_C, 160, True, "m64_n32_w4_s1", "128-row tiles and 64x64 fit 1 block in 100 KB; "
                                     "64x32 (42 KB) keeps 2, 128 regs"),
    (_C, 192, False, "m128_n32_w8_s1", "no tile fits 2 blocks in 100 KB; one 128x32 block "
                                       "(75 KB) runs 8 warps, 174 regs"),
    (_C, 192, True, "m128_n32_w8_s1", "no tile fits 2 blocks in 100 KB; one 128x32 block "
                                      "(75 KB) runs 8 warps, 174 regs"),
    (_C, 224, False, "m128_n32_w8_s1", "no tile fits 2 blocks in 100 KB; one 128x32 block "
                                       "(87 KB) runs 8 warps, 220 regs"),
    (_C, 224, True, "m128_n32_w8_s1", "no tile fits 2 blocks in 100 KB; one 128x32 block "
                                      "(87 KB) runs 8 warps, 226 regs"),
    (_C, 256, False, "m128_n32_w8_s1", "no tile fits 2 blocks in 100 KB; one 128x32 block "
                                       "(99 KB) runs 8 warps, 231 regs"),
    (_C, 256, True, "m128_n32_w8_s1", "no tile fits 2 blocks in 100 KB; one 128x32 block "
                                      "(99 KB) runs 8 warps, 237 regs"),
    # -- sm90: H100-class, 228 KB shared memory per SM ------------------------------------
    (_H, 32, False, "m128_n128_w4_s2", "FA2's 128x128 tile; two K/V buffers at 2 blocks/SM, "
                                       "238 regs"),
    (_H, 32, True, "m128_n128_w4_s2", "FA2's 128x128 tile; two K/V buffers at 2 blocks/SM, "
                                      "255 regs without spills"),
    (_H, 64, False, "m128_n64_w4_s2", "128x64 with two buffers, 2 blocks/SM; FA2's 128x128 "
                                      "no longer spills and is PREDICTED 2% faster (H100): "
                                      "to re-choose"),
    (_H, 64, True, "m128_n128_w4_s2", "FA2's 128x128 tile; two buffers (90 KB) at "
                                      "2 blocks/SM, 255 regs without spills"),
    (_H, 96, False, "m128_n64_w4_s2", "FA2's 128x64 tile; two buffers (78 KB) at "
                                      "2 blocks/SM, 255 regs without spills"),
    (_H, 96, True, "m128_n32_w4_s2", "128x32 with two buffers, 2 blocks/SM; FA2's 128x64 "
                                     "no longer spills and is PREDICTED 4% faster (H100): "
                                     "to re-choose"),
    (_H, 128, False, "m128_n32_w4_s2", "128x32 with two buffers, 2 blocks/SM; FA2's 128x64 "
                                       "no longer spills and is PREDICTED 3% faster (H100): "
                                       "to re-choose"),
    (_H, 128, True, "m128_n32_w4_s2", "FA2's 128x64 keeps the spill rule (8 local accesses "
                                      "a tile) but is PREDICTED 2% slower (H100); 128x32 with "
                                      "two buffers, 2 blocks/SM"),
    (_H, 160, False, "m128_n32_w4_s2", "128x64 makes 20 local accesses a tile (over 8); "
                                       "128x32 with two buffers (84 KB), 2 blocks/SM"),
    (_H, 160, True, "m128_n32_w4_s2", "128x64 makes 21 local accesses a tile (over 8); "
                                      "128x32 with two buffers (84 KB), 2 blocks/SM"),
    (_H, 192, False, "m64_n64_w4_s1", "128-row tiles need 8 warps and fit 1 block/SM; "
                                      "64x64 (75 KB) keeps 3, 167 regs"),
    (_H, 192, True, "m64_n64_w4_s1", "128-row tiles need 8 warps and fit 1 block/SM; "
                                     "64x64 (75 KB) keeps 3, 168 regs"),
    (_H, 224, False, "m64_n64_w4_s1", "128x32 spills inside tensor-core chains; larger "
                                      "128-row tiles fit 1 block/SM; 64x64 (87 KB) keeps 2"),
    (_H, 224, True, "m64_n64_w4_s1", "128x32 spills inside tensor-core chains; larger "
                                     "128-row tiles fit 1 block/SM; 64x64 (87 KB) keeps 2"),
    (_H, 256, False, "m64_n64_w4_s1", "FA2's 64x64 tile for d256; 2 blocks/SM (99 KB "
                                      "each), 251 regs"),
    (_H, 256, True, "m64_n64_w4_s1", "FA2's 64x64 tile for d256; 2 blocks/SM (99 KB "
                                     "each), 243 regs"),
)

DEFAULT_TABLE: tuple[DefaultEntry, ...] = tuple(
    DefaultEntry(cls, hd, causal, KernelConfig.from_key(key), reason)
    for cls, hd, causal, key, reason in _ROWS
)
_BY_KEY: dict[tuple[ArchClass, int, bool], DefaultEntry] = {e.key: e for e in DEFAULT_TABLE}

#: Used only when an entry does not fit an arch (one with less shared memory than its
#: class): the smallest tile of the space, 66 KB at head dim 256.
FALLBACK = KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=1)


def _spec(arch: ArchSpec | str) -> ArchSpec:
    return arch if isinstance(arch, ArchSpec) else get_arch(arch)


def default_entry(problem: Problem, arch: ArchSpec | str) -> DefaultEntry:
    """The table entry that serves ``problem`` on ``arch`` (by compiled head dim)."""
    key = (arch_class(_spec(arch)), problem.padded_head_dim, problem.causal)
    try:
        return _BY_KEY[key]
    except KeyError:
        raise InvalidConfig(f"the default table has no entry for {key}; every class, "
                            f"compiled head dim and mask must have one") from None


def default_config(problem: Problem, arch: ArchSpec | str) -> KernelConfig:
    """The config to run ``problem`` on ``arch`` (an ArchSpec or a name such as "sm_90")
    when nothing is tuned; it always passes ``static_check`` for that arch (an
    InvalidConfig says so when no config could)."""
    arch = _spec(arch)
    entry = default_entry(problem, arch)
    for config in (entry.config, FALLBACK):
        if static_check(problem, config, arch) is None:
            return config
    why = static_check(problem, FALLBACK, arch)
    raise InvalidConfig(f"no default config fits {problem.key()} on {arch.name}: the table's "
                        f"{entry.config.key()} and the fallback {FALLBACK.key()} are both "
                        f"ruled out ({why}); tune this problem or add a smaller fallback")
