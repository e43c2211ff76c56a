"""The forward's attention features on the family side: what the template binds, the
run-time values a launch passes, and random values for verification.

A Problem's feature switches (``window``, ``softcap``, ``alibi``) are compiled in; their
values (window sizes, the cap, the slopes) are run-time arguments (``args.variant_args``).
In an ``Inputs`` they are the scalars ``window_left``, ``window_right``, ``softcap`` and the
tensor ``alibi_slopes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtune.codegen.render import TemplateValue
from flashtune.codegen.spec import Problem, ShapeLike
from flashtune.families.base import Inputs

#: Window sizes flash-attn's tests draw from (plus -1, unbounded), and its softcap values.
WINDOW_SIZES = (-1, 0, 1, 3, 16, 64, 100, 256)
SOFTCAPS = (5.0, 30.0, 50.0)

#: Template parameter of each feature switch.
_TEMPLATE_NAMES = {"window": "local", "softcap": "softcap", "alibi": "alibi"}


@dataclass(frozen=True)
class VariantValues:
    """The run-time values of the features of one call (unused ones keep these defaults)."""

    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None

    @classmethod
    def of(cls, inputs: Inputs) -> VariantValues:
        """The values an ``Inputs`` carries (absent ones: the defaults)."""
        s = inputs.scalars
        return cls((int(s.get("window_left", -1)), int(s.get("window_right", -1))),
                   float(s.get("softcap", 0.0)), inputs.tensors.get("alibi_slopes"))

    def only(self, problem: Problem) -> VariantValues:
        """These values with those of features ``problem`` does not switch on reset."""
        return VariantValues(self.window if problem.window else (-1, -1),
                             self.softcap if problem.softcap else 0.0,
                             self.alibi_slopes if problem.alibi else None)


def template_params(problem: Problem) -> dict[str, TemplateValue]:
    """The template switches of ``problem``'s features (none for a plain problem, so that
    its source is the same as before features existed)."""
    return {_TEMPLATE_NAMES[name]: True for name in problem.features}


def random_values(problem: Problem, shape: ShapeLike, gen: torch.Generator,
                  device: torch.device | str) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Random feature values for ``problem`` (scalars, tensors), drawn with ``gen``: window
    sizes from WINDOW_SIZES (not both unbounded), a cap from SOFTCAPS, and ALiBi slopes in
    [0, 1) of shape (batch, heads_q)."""
    scalars: dict[str, float] = {}
    tensors: dict[str, torch.Tensor] = {}

    def pick(values: tuple[float, ...]) -> float:
        return values[int(torch.randint(len(values), (1,), generator=gen, device=device))]

    if problem.window:
        left, right = -1, -1
        while (left, right) == (-1, -1):
            left, right = int(pick(WINDOW_SIZES)), int(pick(WINDOW_SIZES))
        scalars.update(window_left=left, window_right=right)
    if problem.softcap:
        scalars["softcap"] = pick(SOFTCAPS)
    if problem.alibi:
        tensors["alibi_slopes"] = torch.rand(shape.batch, shape.heads_q, generator=gen,
                                             device=device)
    return scalars, tensors
