"""A kernel family's search space as the generic search sees it.

``KernelDomain`` turns a family's declared ``ParamSpace`` for one problem on one arch into
a ``SearchSpace`` (legality: the point names a config, and the family's static rules pass)
and maps its points to and from ``KernelConfig``; ``fixed`` (``families.fixed``: knobs held
at one value, ``--fix``) restricts it. ``SearchEncoding`` adds what the tuner asks of it:
the legal candidates, the structurally legal configs, and Optuna's encoding.
Everything kernel-specific the search touches goes through the family here.
"""

from __future__ import annotations

from flashtune import families
from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.params import Point, Value
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.errors import InvalidConfig
from flashtune.families import fixed as fixing
from flashtune.families.fixed import Fixed
from flashtune.tuner.search.space import Candidates, SearchSpace


class KernelDomain:
    """The points of a family's space for ``problem`` on ``arch`` (with the ``fixed`` knobs
    at their values), as KernelConfigs."""

    def __init__(self, problem: Problem, arch: ArchSpec, fixed: Fixed = ()) -> None:
        self.problem = problem
        self.arch = arch
        self.family = families.of(problem)
        declared = self.family.space(problem)
        for name, value in fixed:  # a restriction of the declared space only
            if name not in declared.names:
                raise InvalidConfig(f"fixed knob {name!r} is not a knob of the "
                                    f"{self.family.op!r} family; its knobs are "
                                    f"{list(declared.names)}")
            declared[name].index(value)
        self.fixed = fixed
        self._space = SearchSpace(fixing.restrict(declared, fixed), self.legality)

    @property
    def space(self) -> SearchSpace:
        return self._space

    def legality(self, point: Point) -> str | None:
        try:
            config = self.family.config(point)
        except InvalidConfig as exc:
            return f"illegal combination: {exc}"
        return self.family.static_check(self.problem, config, self.arch)

    def config(self, point: Point) -> KernelConfig:
        return self.family.config(point)

    def point(self, config: KernelConfig) -> dict[str, Value]:
        return self.family.point(config)

    def key(self, config: KernelConfig) -> str:
        return config.key()


class SearchEncoding(Candidates[KernelConfig]):
    """The legal configs of ``problem`` on ``arch`` (with the ``fixed`` knobs at their
    values) and their Optuna encoding."""

    def __init__(self, problem: Problem, arch: ArchSpec, fixed: Fixed = ()) -> None:
        super().__init__(KernelDomain(problem, arch, fixed))
        self.problem = problem
        self.arch = arch
        self.fixed = fixed

    def candidates(self) -> list[KernelConfig]:
        """The legal configs (they pass the family's static check), in a stable order."""
        return list(self.configs)

    def space(self) -> list[KernelConfig]:
        """Every structurally legal config of the family's (restricted) space, in a stable
        order."""
        family = families.of(self.problem)
        configs = family.search_space(self.problem)
        if not self.fixed:
            return configs
        return [c for c in configs if fixing.matches(family, c, self.fixed)]

    def static_rejections(self) -> int:
        """How many configs of the space the static rules exclude on this arch (counted,
        never recorded: the rules are a pure function of problem, config and arch)."""
        return len(self.space()) - len(self.configs)
