"""A declared parameter space: named parameters, each with an ordered tuple of legal values.

This is the generic vocabulary of search. A kernel family declares its tunables as a
``ParamSpace`` (block_m, block_n, ...), and so does a recorded tuning landscape of any
other kernel; the search machinery (``flashtune.tuner.search``) sees only names and
ordered values, never what a block_m is. Which combinations are legal is decided by the
owner of the space (a family's static rules, or the failures recorded in a landscape), and
reported as a reason string, so that failures are data rather than exceptions.

Values keep their declared order: it is the order along which a search may assume speed
changes smoothly (tile sizes ascending, booleans False then True).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from flashtune.errors import InvalidConfig

#: A parameter value: an int (tile sizes, counts), a bool (a switch) or a str (a named mode).
Value = int | bool | str
#: One point of a space: parameter name -> value.
Point = Mapping[str, Value]


@dataclass(frozen=True)
class Param:
    """One tunable: a name and its legal values in search order (distinct, non-empty)."""

    name: str
    values: tuple[Value, ...]

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise InvalidConfig(f"parameter name {self.name!r} is not an identifier")
        if not self.values:
            raise InvalidConfig(f"parameter {self.name!r} has no values")
        if len(set(self.values)) != len(self.values):
            raise InvalidConfig(f"parameter {self.name!r} repeats a value: {self.values}")

    def index(self, value: Value) -> int:
        """Position of ``value`` in the search order; InvalidConfig when it is not legal."""
        for i, v in enumerate(self.values):
            if v == value and type(v) is type(value):
                return i
        raise InvalidConfig(f"{self.name}={value!r} is outside the search space; expected one "
                            f"of {list(self.values)}")


@dataclass(frozen=True)
class ParamSpace:
    """The product of its parameters' values (before any legality rule)."""

    params: tuple[Param, ...]

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise InvalidConfig(f"parameter names repeat: {names}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def __getitem__(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def size(self) -> int:
        """Number of points in the product (legal or not)."""
        n = 1
        for p in self.params:
            n *= len(p.values)
        return n

    def points(self) -> Iterator[dict[str, Value]]:
        """Every point of the product in a stable order (the last parameter varies fastest)."""
        for values in itertools.product(*(p.values for p in self.params)):
            yield dict(zip(self.names, values, strict=True))

    def check(self, point: Point) -> None:
        """InvalidConfig unless ``point`` names exactly these parameters with legal values."""
        unknown = set(point) - set(self.names)
        missing = set(self.names) - set(point)
        if unknown or missing:
            raise InvalidConfig(f"point has unknown parameters {sorted(unknown)} and lacks "
                                f"{sorted(missing)}; expected exactly {list(self.names)}")
        for p in self.params:
            p.index(point[p.name])

    def key(self, point: Point) -> str:
        """A canonical, order-independent text form of a point (for logs and memo keys)."""
        return ",".join(f"{name}={point[name]}" for name in self.names)
