"""Random inputs of a backward family with chosen feature values: the family's draws with
the window and the cap replaced, and the forward's LSE and D redrawn for them (the mma.sync
and the sm_90a backward share arguments, so one helper serves both)."""

from __future__ import annotations

from flashtune.codegen.spec import Problem, Shape
from flashtune.families.base import Inputs, KernelFamily
from flashtune.families.bwd.reference import softmax_stats
from flashtune.families.fwd.variants import VariantValues


def backward_inputs(family: KernelFamily, problem: Problem, shape: Shape, seed: int,
                    window: tuple[int, int] | None = None, cap: float | None = None
                    ) -> Inputs:
    """``family``'s random inputs for ``seed``, with ``window`` (left, right) and ``cap``
    (when given) instead of the drawn ones, and LSE and D of those values."""
    inputs = family.random_inputs(problem, shape, "cpu", seed)
    if window is None and cap is None:
        return inputs
    scalars = dict(inputs.scalars)
    if window is not None:
        scalars.update(window_left=window[0], window_right=window[1])
    if cap is not None:
        scalars["softcap"] = cap
    t = dict(inputs.tensors)
    values = VariantValues.of(Inputs(t, scalars)).only(problem)
    t["lse"], t["dsum"] = softmax_stats(t["q"], t["k"], t["v"], t["do"], problem.causal,
                                        scalars["softmax_scale"], values=values)
    return Inputs(t, scalars)
