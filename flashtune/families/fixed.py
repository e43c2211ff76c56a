"""A restriction of a family's search space: knobs held at one value each.

``flashtune tune``, ``profile``, ``compile``, ``space`` and ``show`` take ``--fix NAME=VALUE``
(repeatable), e.g. ``--fix pingpong=1`` for the warp-specialised sm_90a forward's ping-pong
kernels alone: a view of the family's declared space, not a family of its own. ``parse``
checks each name against the family's declared space and each value against the knob's
legal values; ``restrict`` is the space a search walks, ``matches`` says whether a config
lies in it and ``apply`` moves a config (the default, a --config key) into it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flashtune.codegen.params import Param, ParamSpace, Value
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.errors import InvalidConfig
from flashtune.families.base import KernelFamily

#: Fixed knobs, in the order of the family's space: (name, value) pairs.
Fixed = tuple[tuple[str, Value], ...]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _value(param: Param, text: str) -> Value | None:
    """The value of ``param`` that ``text`` names, or None when none does."""
    for value in param.values:
        if isinstance(value, bool):
            if text.lower() in (_TRUE if value else _FALSE):
                return value
        elif isinstance(value, int):
            try:
                if int(text) == value:
                    return value
            except ValueError:
                continue
        elif text == value:
            return value
    return None


def parse(family: KernelFamily, problem: Problem, texts: Sequence[str]) -> Fixed:
    """The knobs ``texts`` (each ``NAME=VALUE``) fix in ``family``'s space of ``problem``;
    InvalidConfig naming the family's knobs for an unknown name, and the knob's legal values
    for a value it does not take."""
    declared = family.space(problem)
    chosen: dict[str, Value] = {}
    for text in texts:
        name, sep, raw = (part.strip() for part in text.partition("="))
        if not sep or not name or not raw:
            raise InvalidConfig(f"--fix {text!r} is not NAME=VALUE; e.g. --fix pingpong=1")
        if name not in declared.names:
            raise InvalidConfig(f"--fix {text!r}: {name!r} is not a knob of the {family.op!r} "
                                f"family; its knobs are {list(declared.names)}")
        param = declared[name]
        value = _value(param, raw)
        if value is None:
            raise InvalidConfig(f"--fix {text!r}: {raw!r} is not a value of {name} in the "
                                f"{family.op!r} family; its values are {list(param.values)}")
        if name in chosen and chosen[name] != value:
            raise InvalidConfig(f"--fix gives {name} two values ({chosen[name]!r} and "
                                f"{value!r}); fix it once")
        chosen[name] = value
    return tuple((name, chosen[name]) for name in declared.names if name in chosen)


def restrict(space: ParamSpace, fixed: Fixed) -> ParamSpace:
    """``space`` with each fixed knob holding its one value (names ``parse`` checked)."""
    values = dict(fixed)
    return ParamSpace(tuple(Param(p.name, (values[p.name],)) if p.name in values else p
                            for p in space.params))


def _same(a: Value, b: Value) -> bool:
    return a == b and type(a) is type(b)


def matches(family: KernelFamily, config: KernelConfig, fixed: Fixed) -> bool:
    """Whether ``config``'s point has every fixed knob at its fixed value."""
    point: Mapping[str, Value] = family.point(config)
    return all(name in point and _same(point[name], value) for name, value in fixed)


def apply(family: KernelFamily, config: KernelConfig, fixed: Fixed) -> KernelConfig:
    """``config`` with the fixed knobs set (the family's ``config`` of the changed point)."""
    if not fixed:
        return config
    return family.config({**family.point(config), **dict(fixed)})


def text(fixed: Fixed) -> str:
    """``name=value+name=value``: the restriction in a study name or a message."""
    return "+".join(f"{name}={int(value) if isinstance(value, bool) else value}"
                    for name, value in fixed)
