"""The search's view of a space: declared parameters, a legality rule, and Optuna's encoding.

A ``SearchSpace`` is a ``ParamSpace`` (named parameters with ordered values) plus a
legality callable ``(point) -> reason | None``: a kernel family's static rules, or a recorded
landscape's membership. Nothing here knows what a parameter means.

Each parameter is presented to Optuna as ``suggest_int(name, 0, len(values) - 1)``: the
index of its value in the declared order. The order is the information a sampler can use
(speed changes smoothly along a tile size); the index keeps it for any value type (ints,
switches, named modes) and is evenly spaced for the doubling tile sizes a kernel declares.

A point the product allows but the rule does not is decoded to its reason, so a search
tells Optuna such a trial was pruned without compiling anything. ``Domain`` is what the
search needs besides: the configs the points name (a family's KernelConfig, or a landscape
row) and their keys.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import optuna

from flashtune.codegen.params import ParamSpace, Point, Value
from flashtune.errors import InvalidConfig

#: Why a point can never be measured, or None when it may be.
Legality = Callable[[Point], "str | None"]

#: Spaces with more points than this are sampled (with a fixed seed), not listed.
MAX_LISTED = 500_000

C = TypeVar("C")


@dataclass(frozen=True)
class SearchSpace:
    """Declared parameters plus the rule that says which of their combinations are legal."""

    params: ParamSpace
    legality: Legality = field(compare=False)

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        return self.params.names

    @functools.cached_property
    def cardinalities(self) -> tuple[int, ...]:
        return tuple(len(p.values) for p in self.params.params)

    @functools.cached_property
    def choices(self) -> tuple[str, ...]:
        """The parameters with more than one value: the ones a sampler chooses (a constant
        is no choice, and asking Optuna for it would only cost time)."""
        return tuple(p.name for p in self.params.params if len(p.values) > 1)

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        """Each parameter as the index of its value (see the module docstring)."""
        return {p.name: optuna.distributions.IntDistribution(0, len(p.values) - 1)
                for p in self.params.params if p.name in self.choices}

    def indices(self, point: Point) -> tuple[int, ...]:
        """The value index of each parameter (InvalidConfig when a value is not declared)."""
        self.params.check(point)
        return tuple(p.index(point[p.name]) for p in self.params.params)

    def encode(self, point: Point) -> dict[str, int]:
        """Optuna parameters of ``point``."""
        choices = self.choices
        return {n: i for n, i in zip(self.names, self.indices(point), strict=True)
                if n in choices}

    def raw_indices(self, raw: Mapping[str, Any]) -> tuple[int, ...]:
        """Value indices from Optuna parameters (constants, which are not asked, are 0);
        KeyError, TypeError or ValueError when a choice is missing or not an integer."""
        choices = self.choices
        return tuple(int(raw[n]) if n in choices else 0 for n in self.names)

    def point_at(self, indices: tuple[int, ...]) -> dict[str, Value]:
        return {p.name: p.values[i] for p, i in zip(self.params.params, indices, strict=True)}

    def decode(self, raw: Mapping[str, Any]) -> dict[str, Value] | str:
        """The legal point Optuna parameters name, or why there is none."""
        try:
            indices = self.raw_indices(raw)
        except (KeyError, TypeError, ValueError) as exc:
            return f"parameters {dict(raw)} do not name a point of {list(self.names)}: {exc}"
        if any(not 0 <= i < n for i, n in zip(indices, self.cardinalities, strict=True)):
            return f"parameter indices {indices} are outside {list(self.cardinalities)}"
        point = self.point_at(indices)
        reason = self.legality(point)
        return point if reason is None else reason

    def key(self, point: Point) -> str:
        """A point's canonical text (``ParamSpace.key``)."""
        return ",".join(f"{name}={point[name]}" for name in self.names)

    @functools.cached_property
    def legal(self) -> tuple[tuple[int, ...], ...]:
        """Value indices of every legal point in a stable order (a fixed-seed sample of
        ``MAX_LISTED`` points of the product when it is larger)."""
        ranges = [range(n) for n in self.cardinalities]
        if self.params.size <= MAX_LISTED:
            combos: Any = itertools.product(*ranges)
        else:
            rng = random.Random(0)
            combos = sorted({tuple(rng.randrange(n) for n in self.cardinalities)
                             for _ in range(MAX_LISTED)})
        return tuple(c for c in combos if self.legality(self.point_at(c)) is None)


class Domain(Protocol[C]):
    """What a search needs to know about the configs a space's points name."""

    @property
    def space(self) -> SearchSpace: ...

    def config(self, point: Point) -> C:
        """The config of a legal point."""
        ...

    def point(self, config: C) -> dict[str, Value]: ...

    def key(self, config: C) -> str:
        """A config's canonical key (memo, duplicate detection, the database)."""
        ...


class PointDomain:
    """The identity domain: a config is the tuple of its point's values (landscapes)."""

    def __init__(self, space: SearchSpace) -> None:
        self._space = space

    @property
    def space(self) -> SearchSpace:
        return self._space

    def config(self, point: Point) -> tuple[Value, ...]:
        return tuple(point[name] for name in self._space.names)

    def point(self, config: tuple[Value, ...]) -> dict[str, Value]:
        if len(config) != len(self._space.names):
            raise InvalidConfig(f"config {config} does not have one value per parameter "
                                f"{list(self._space.names)}")
        return dict(zip(self._space.names, config, strict=True))

    def key(self, config: tuple[Value, ...]) -> str:
        return self._space.key(self.point(config))


class Candidates(Generic[C]):
    """The legal configs of a domain, with the encodings a search asks for."""

    def __init__(self, domain: Domain[C]) -> None:
        self.domain = domain
        self.search_space = domain.space
        self.configs: list[C] = [domain.config(self.search_space.point_at(i))
                                 for i in self.search_space.legal]

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        return self.search_space.distributions()

    def key(self, config: C) -> str:
        return self.domain.key(config)

    def encode(self, config: C) -> dict[str, int]:
        return self.search_space.encode(self.domain.point(config))

    def decode(self, raw: Mapping[str, Any]) -> C | str:
        point = self.search_space.decode(raw)
        return point if isinstance(point, str) else self.domain.config(point)
