"""The forward kernel's structure knobs: the template switches beyond the four base fields.

Each knob is an optional variable of ``templates/flash_fwd.cu.jinja``; a config that omits
one means its default, and the defaults render exactly the kernel a config without extras
always rendered (so the keys of existing configs and their database rows stay valid).

    swizzle     0/1  XOR-swizzled shared-memory rows (no padding) instead of padded rows
    qregs       0/1  Q's fragments held in registers instead of re-read from shared memory
    pipeline    0/1  Q K^T of the next tile issued before the softmax of this one (two S
                     tiles live; needs two or more stages)
    minblocks   0/2/3/4  ``__launch_bounds__`` minimum resident blocks per SM, a register cap
                     of 65536 / (minblocks x threads); 0: none (1 never lowers the cap)
    order       plain / headsinner / longest  block order (see templates/flash_fwd.cuh)
    persistent  0/1  a smaller grid whose blocks walk the query blocks of their head
"""

from __future__ import annotations

from collections.abc import Mapping

from flashtune.codegen.params import Param, Value
from flashtune.codegen.spec import KernelConfig
from flashtune.errors import InvalidConfig

SWIZZLE = "swizzle"
QREGS = "qregs"
PIPELINE = "pipeline"
MINBLOCKS = "minblocks"
ORDER = "order"
PERSISTENT = "persistent"

ORDER_PLAIN = "plain"
ORDER_HEADS_INNER = "headsinner"
ORDER_LONGEST = "longest"

#: The knobs in declaration order; each one's first value is its default.
KNOB_PARAMS: tuple[Param, ...] = (
    Param(SWIZZLE, (0, 1)),
    Param(QREGS, (0, 1)),
    Param(PIPELINE, (0, 1)),
    Param(MINBLOCKS, (0, 2, 3, 4)),
    Param(ORDER, (ORDER_PLAIN, ORDER_HEADS_INNER, ORDER_LONGEST)),
    Param(PERSISTENT, (0, 1)),
)
DEFAULTS: Mapping[str, Value] = {p.name: p.values[0] for p in KNOB_PARAMS}


def knob(config: KernelConfig, name: str) -> Value:
    """The value of knob ``name`` in ``config`` (its default when the config omits it)."""
    for key, value in config.extras:
        if key == name:
            return value
    return DEFAULTS[name]


def knob_values(config: KernelConfig) -> dict[str, Value]:
    """Every knob's value in ``config``, defaults filled in (other extras left out)."""
    values = dict(DEFAULTS)
    values.update((k, v) for k, v in config.extras if k in DEFAULTS)
    return values


def value_reason(values: Mapping[str, Value]) -> str | None:
    """Why a knob of ``values`` (as ``knob_values`` gives them) is outside its declared
    values, or None."""
    for param in KNOB_PARAMS:
        try:
            param.index(values[param.name])
        except InvalidConfig as exc:
            return str(exc)
    return None


def without_defaults(point: Mapping[str, Value]) -> dict[str, Value]:
    """``point`` minus the knobs set to their defaults: the canonical config fields (a
    default kernel's key carries no knob)."""
    return {name: value for name, value in point.items()
            if name not in DEFAULTS or value != DEFAULTS[name]
            or type(value) is not type(DEFAULTS[name])}
