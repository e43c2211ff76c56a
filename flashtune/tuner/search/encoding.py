"""How KernelConfigs are presented to Optuna's samplers.

Each tunable is its own integer parameter that keeps the order (and where possible the
scale) of its values, rather than one categorical over whole config keys:

- an evenly spaced value set (num_stages 1, 2, 3) is ``suggest_int(name, lo, hi, step)``;
- a doubling set (block_n 32, 64, 128) is ``suggest_int("log2_" + name, lo, hi)``;
- any other set (e.g. 80, 96, 144), and named modes or switches (a family's declared str
  or bool values, e.g. dqmode atomic, split), is ``suggest_int(name + "_rank", 0, len - 1)``
  over the declared order.

Why: kernel speed changes smoothly along each knob (a bigger tile amortises more loads until
it runs out of registers or shared memory), so TPE's Parzen estimators and the GP's kernel
can spread what they learn about one value to its neighbours, and multivariate TPE can learn
interactions. A categorical over ~20-200 opaque keys gives them nothing to generalise from:
TPE degenerates to counting and the GP to one-hot distances, i.e. close to random search.

Combinations the product of the per-knob ranges allows but the kernel does not (e.g.
block_m=64 with 8 warps, or a config over the shared-memory limit) are decoded to a reason
instead of a config; the search tells Optuna such a trial was pruned, which TPE ranks below
every completed trial, so it learns to avoid those regions. It costs no compile.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optuna

from flashtune import families
from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.params import Value
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.errors import InvalidConfig, TuningError


def _is_int(value: Value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Knob:
    """One tunable: its KernelConfig field, Optuna parameter name and legal values (ints
    sorted; words or switches in their declared order)."""

    field: str
    values: tuple[Value, ...]

    def __post_init__(self) -> None:
        if not self.values or len(set(self.values)) != len(self.values):
            raise TuningError(f"values of {self.field} must be distinct, got {self.values}")
        if self._ints is not None and list(self._ints) != sorted(self._ints):
            raise TuningError(f"values of {self.field} must be sorted, got {self.values}")

    @property
    def _ints(self) -> tuple[int, ...] | None:
        """The values as ints when every one is an int, else None (ranked by position)."""
        ints = tuple(v for v in self.values if isinstance(v, int) and not isinstance(v, bool))
        return ints if len(ints) == len(self.values) else None

    @property
    def _step(self) -> int | None:
        ints = self._ints
        if ints is None:
            return None
        if len(ints) == 1:
            return 1
        steps = {b - a for a, b in zip(ints, ints[1:], strict=False)}
        return steps.pop() if len(steps) == 1 else None

    @property
    def _log2(self) -> bool:
        ints = self._ints
        return ints is not None and all(v > 0 and v & (v - 1) == 0 for v in ints) and all(
            b == 2 * a for a, b in zip(ints, ints[1:], strict=False))

    @property
    def param(self) -> str:
        if self._step is not None:
            return self.field
        return f"log2_{self.field}" if self._log2 else f"{self.field}_rank"

    def distribution(self) -> optuna.distributions.IntDistribution:
        ints, step = self._ints, self._step
        if ints is not None and step is not None:
            return optuna.distributions.IntDistribution(ints[0], ints[-1], step=step)
        if ints is not None and self._log2:
            lo, hi = ints[0].bit_length() - 1, ints[-1].bit_length() - 1
            return optuna.distributions.IntDistribution(lo, hi)
        return optuna.distributions.IntDistribution(0, len(self.values) - 1)

    def encode(self, value: Value) -> int:
        position = next((i for i, v in enumerate(self.values)
                         if v == value and type(v) is type(value)), None)
        if position is None:
            raise InvalidConfig(f"{self.field}={value!r} is outside the search space "
                                f"{self.values}")
        if _is_int(value) and self._step is not None:
            return int(value)
        if _is_int(value) and self._log2:
            return int(value).bit_length() - 1
        return position

    def decode(self, raw: int) -> Value:
        if self._step is not None:
            return raw
        return 1 << raw if self._log2 else self.values[raw]


def family_knobs(problem: Problem) -> tuple[Knob, ...]:
    """The knobs of ``problem``'s family: one per parameter of its declared space."""
    return tuple(Knob(p.name, p.values) for p in families.of(problem).space(problem).params)


class SearchEncoding:
    """Maps between KernelConfigs and Optuna parameters for one problem on one arch."""

    def __init__(self, problem: Problem, arch: ArchSpec,
                 knobs: Sequence[Knob] | None = None) -> None:
        self.problem = problem
        self.arch = arch
        self.family = families.of(problem)
        self.knobs = tuple(knobs) if knobs is not None else family_knobs(problem)

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        return {k.param: k.distribution() for k in self.knobs}

    def grid(self) -> dict[str, list[int]]:
        """Every parameter's encoded values, for optuna's GridSampler."""
        return {k.param: [k.encode(v) for v in k.values] for k in self.knobs}

    def encode(self, config: KernelConfig) -> dict[str, int]:
        values = config.to_dict()
        return {k.param: k.encode(values[k.field]) for k in self.knobs}

    def decode(self, params: Mapping[str, Any]) -> KernelConfig | str:
        """The config these parameters name, or why it is impossible (never compiled)."""
        try:
            fields = {k.field: k.decode(int(params[k.param])) for k in self.knobs}
            config = KernelConfig.from_dict(fields)
        except (InvalidConfig, KeyError, IndexError, TypeError, ValueError) as exc:
            return f"illegal combination: {exc}"
        reason = self.family.static_check(self.problem, config, self.arch)
        return config if reason is None else reason

    def space(self) -> list[KernelConfig]:
        """Every structurally legal config the encoding can express, in a stable order."""
        out: list[KernelConfig] = []
        for values in itertools.product(*(k.values for k in self.knobs)):
            fields = {k.field: v for k, v in zip(self.knobs, values, strict=True)}
            try:
                out.append(KernelConfig.from_dict(fields))
            except InvalidConfig:
                continue
        return out

    def candidates(self) -> list[KernelConfig]:
        """The legal configs that pass the static check for this problem and arch."""
        return [c for c in self.space()
                if self.family.static_check(self.problem, c, self.arch) is None]

