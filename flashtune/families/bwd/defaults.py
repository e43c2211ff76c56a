"""Default backward main-kernel configs: what the dispatcher runs when nothing is tuned.

One entry per (arch class, compiled head dim), the same for both masks; the atomic dQ mode
for ``bwd``, the split mode (same tile) for ``bwddet``. See ``_ROWS`` for how the entries
were chosen.
"""

from __future__ import annotations

from flashtune.codegen.arch import ArchClass, ArchSpec, arch_class, get_arch
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.errors import InvalidConfig
from flashtune.families.bwd.space import DQ_ATOMIC, DQ_SPLIT, static_check
from flashtune.families.fwd.defaults import DefaultEntry

_A, _C, _H = ArchClass.SM80, ArchClass.SM86, ArchClass.SM90

# (class, compiled head dim, tile key without the dQ mode, reason).
_ROWS: tuple[tuple[ArchClass, int, str, str], ...] = (
    (_A, 32, "m128_n128_w8_s2", "provisional"),
    (_A, 64, "m128_n64_w8_s2", "provisional"),
    (_A, 96, "m128_n64_w8_s1", "provisional"),
    (_A, 128, "m128_n64_w8_s1", "provisional"),
    (_A, 160, "m128_n32_w8_s1", "provisional"),
    (_A, 192, "m128_n32_w8_s1", "provisional"),
    (_A, 224, "m64_n32_w4_s1", "provisional"),
    (_A, 256, "m64_n32_w4_s1", "provisional"),
    (_C, 32, "m128_n64_w8_s1", "provisional"),
    (_C, 64, "m64_n64_w4_s1", "provisional"),
    (_C, 96, "m64_n64_w4_s1", "provisional"),
    (_C, 128, "m64_n32_w4_s1", "provisional"),
    (_C, 160, "m64_n32_w4_s1", "provisional"),
    (_C, 192, "m64_n32_w4_s1", "provisional"),
    (_C, 224, "m64_n32_w4_s1", "provisional"),
    (_C, 256, "m32_n32_w2_s1", "provisional"),
    (_H, 32, "m128_n128_w8_s2", "provisional"),
    (_H, 64, "m128_n64_w8_s2", "provisional"),
    (_H, 96, "m128_n64_w8_s2", "provisional"),
    (_H, 128, "m128_n64_w8_s2", "provisional"),
    (_H, 160, "m128_n32_w8_s2", "provisional"),
    (_H, 192, "m128_n32_w8_s1", "provisional"),
    (_H, 224, "m64_n32_w4_s1", "provisional"),
    (_H, 256, "m64_n32_w4_s1", "provisional"),
)


def _with_mode(key: str, mode: str) -> KernelConfig:
    return KernelConfig.from_key(f"{key}_dqmode-{mode}")


DEFAULT_TABLE: tuple[DefaultEntry, ...] = tuple(
    DefaultEntry(cls, hd, causal, _with_mode(key, DQ_ATOMIC), reason)
    for cls, hd, key, reason in _ROWS for causal in (False, True)
)
_BY_KEY = {e.key: e for e in DEFAULT_TABLE}

#: Used only when an entry does not fit an arch or a head dim (the smallest tile).
FALLBACK = KernelConfig(32, 32, 2, 1, extras={"dqmode": DQ_ATOMIC})


def _spec(arch: ArchSpec | str) -> ArchSpec:
    return arch if isinstance(arch, ArchSpec) else get_arch(arch)


def default_entry(problem: Problem, arch: ArchSpec | str) -> DefaultEntry:
    """The table entry that serves ``problem`` on ``arch`` (by compiled head dim)."""
    key = (arch_class(_spec(arch)), problem.padded_head_dim, problem.causal)
    try:
        return _BY_KEY[key]
    except KeyError:
        raise InvalidConfig(f"the backward default table has no entry for {key}") from None


def _mode(config: KernelConfig, deterministic: bool) -> KernelConfig:
    if not deterministic:
        return config
    return KernelConfig(config.block_m, config.block_n, config.num_warps, config.num_stages,
                        extras={"dqmode": DQ_SPLIT})


def default_config(problem: Problem, arch: ArchSpec | str, *, deterministic: bool = False
                   ) -> KernelConfig:
    """The config to run ``problem`` on ``arch`` when nothing is tuned (the split dQ mode
    when ``deterministic``); it always passes the static rules (InvalidConfig when no
    config could)."""
    arch = _spec(arch)
    entry = default_entry(problem, arch)
    for config in (entry.config, FALLBACK):
        config = _mode(config, deterministic)
        if static_check(problem, config, arch, deterministic=deterministic) is None:
            return config
    raise InvalidConfig(f"no default backward config fits {problem.key()} on {arch.name}: "
                        f"the table's {entry.config.key()} and the fallback {FALLBACK.key()} "
                        "are both ruled out; tune this problem")
