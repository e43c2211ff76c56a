"""Which strategy (strategy.py) predicts a kernel: chosen once per prediction from what the
problem's family declares. The cost model describes the forward kernels (``ForwardFamily``)
only: on the wgmma path when the family's target arch is one that ``TARGET_PATHS`` names
(sm_90a), else on the portable mma.sync path. No family is known here by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flashtune import families
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.errors import InvalidProblem
from flashtune.families.base import KernelFamily
from flashtune.families.fwd import ForwardFamily
from flashtune.perf.model.params import MODEL_NAME, ModelParams
from flashtune.perf.model.strategy import (
    MMA_SYNC,
    REGISTER_OVERHEAD_ESTIMATE,
    ModelPath,
    versioned,
)
from flashtune.perf.model.wgmma import MODEL_NAME as WGMMA_MODEL_NAME
from flashtune.perf.model.wgmma import WgmmaPath


def _wgmma(family: KernelFamily, problem: Problem, config: KernelConfig) -> ModelPath:
    return WgmmaPath.of(family, problem, config, REGISTER_OVERHEAD_ESTIMATE)


@dataclass(frozen=True)
class TargetPath:
    """The path of the forward families of one arch-specific target: its model name and
    how it is built for one config."""

    model_name: str
    build: Callable[[KernelFamily, Problem, KernelConfig], ModelPath]
    #: Whether the path has a model of a family of its target (one it cannot build is not
    #: predicted: ``predicts`` is False, and ``flashtune profile`` prints its SASS alone).
    models: Callable[[KernelFamily], bool]


#: The path of a forward family whose declared target arch is a key here (its code uses
#: that target's own instructions); every other forward takes the mma.sync path.
TARGET_PATHS: dict[str, TargetPath] = {
    "sm_90a": TargetPath(WGMMA_MODEL_NAME, _wgmma, WgmmaPath.models),
}


def _forward(problem: Problem) -> tuple[KernelFamily, TargetPath | None]:
    family = families.of(problem)
    if not isinstance(family, ForwardFamily):
        raise InvalidProblem(f"the cost model describes the forward kernels (fwd and the "
                             f"sm_90a families); it has no model of the {problem.op!r} "
                             f"family ({problem.key()})")
    return family, TARGET_PATHS.get(family.target_arch or "")


def predicts(problem: Problem) -> bool:
    """Whether the cost model describes ``problem``'s family (a forward kernel that its
    path has a model of)."""
    family = families.of(problem)
    if not isinstance(family, ForwardFamily):
        return False
    target = TARGET_PATHS.get(family.target_arch or "")
    return target is None or target.models(family)


def model_path(problem: Problem, config: KernelConfig) -> ModelPath:
    """The path that predicts ``config`` of ``problem`` (the module docstring). Raises
    InvalidProblem for a family the model has no model of (not a forward)."""
    family, target = _forward(problem)
    return MMA_SYNC if target is None else target.build(family, problem, config)


def is_arch_specific_path(problem: Problem) -> bool:
    """Whether ``problem`` is predicted on an arch-specific target's path (wgmma), not the
    portable one. Raises InvalidProblem as ``model_path``."""
    return _forward(problem)[1] is not None


def model_version(params: ModelParams, problem: Problem) -> str:
    """The version a prediction of ``problem`` carries (its path's model name with
    ``params``' digest)."""
    _, target = _forward(problem)
    return versioned(params, MODEL_NAME if target is None else target.model_name)
