"""The registry of kernel families: the one place that lists them.

``get(op)`` returns the family that serves ``Problem.op == op``; ``render(problem, config)``
renders any problem through its family. ``register`` adds a family (an extension, or a
test's); every consumer (runtime, verification, tuner, cost model, benchmarks, CLI) reaches
kernels through these functions, so a new family needs no change anywhere else.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from flashtune.codegen.arch import ArchSpec, get_arch
from flashtune.codegen.spec import DType, KernelConfig, KernelSource, Problem
from flashtune.errors import InvalidProblem
from flashtune.families.base import KernelFamily

log = logging.getLogger(__name__)
_lock = threading.Lock()
_families: dict[str, KernelFamily] = {}


def _builtins() -> None:
    from flashtune.families.bwd import BACKWARD, BACKWARD_DETERMINISTIC
    from flashtune.families.bwd.rows import CONVERT, PREPROCESS
    from flashtune.families.bwd8 import BACKWARD_FP8, BACKWARD_FP8_DETERMINISTIC
    from flashtune.families.bwd90a import HOPPER_BACKWARD, HOPPER_BACKWARD_DETERMINISTIC
    from flashtune.families.combine import COMBINE
    from flashtune.families.decode import DECODE
    from flashtune.families.decode.fp8 import DECODE_FP8
    from flashtune.families.fwd import FORWARD
    from flashtune.families.fwd8 import FORWARD_FP8
    from flashtune.families.fwd8_90a import FORWARD_FP8_90A
    from flashtune.families.hopper import HOPPER_FORWARD
    from flashtune.families.hopper.ws import HOPPER_WS_FORWARD
    from flashtune.families.lse import LSE
    from flashtune.families.mla import MLA

    for family in (FORWARD, BACKWARD, BACKWARD_DETERMINISTIC, PREPROCESS, CONVERT, LSE,
                   DECODE, COMBINE, HOPPER_FORWARD, HOPPER_WS_FORWARD, FORWARD_FP8,
                   HOPPER_BACKWARD, HOPPER_BACKWARD_DETERMINISTIC, MLA, BACKWARD_FP8,
                   BACKWARD_FP8_DETERMINISTIC, FORWARD_FP8_90A, DECODE_FP8):
        _families.setdefault(family.op, family)


def register(family: KernelFamily, *, replace: bool = False) -> None:
    """Add ``family`` under its ``op``; an existing op needs ``replace=True``."""
    with _lock:
        if not _families:
            _builtins()
        if family.op in _families and not replace:
            raise InvalidProblem(f"a kernel family for op {family.op!r} is already registered "
                                 "(pass replace=True to replace it)")
        Problem(head_dim=64, dtype=DType.FP16, op=family.op)  # the op must be a legal key part
        _families[family.op] = family


def unregister(op: str) -> None:
    """Remove a family added with ``register`` (tests)."""
    with _lock:
        _families.pop(op, None)


def all_families() -> tuple[KernelFamily, ...]:
    """Every registered family, by op."""
    with _lock:
        if not _families:
            _builtins()
        return tuple(_families[op] for op in sorted(_families))


def get(op: str) -> KernelFamily:
    """The family of ``op``; InvalidProblem naming the known ones if there is none."""
    family = _families.get(op)
    if family is None:
        known = [f.op for f in all_families()]
        family = _families.get(op)
        if family is None:
            raise InvalidProblem(f"no kernel family serves op={op!r}; expected one of {known}")
    return family


def of(problem: Problem) -> KernelFamily:
    """The family that serves ``problem``."""
    return get(problem.op)


def served_problem(problem: Problem, arch: ArchSpec) -> Problem:
    """The problem a call of ``problem`` runs on a device of ``arch``: ``problem`` itself, or
    the same problem for a registered family that ``serves`` its op with an arch-specific
    target this device runs (e.g. the Hopper forward on compute capability 9.0) and that
    accepts it (its head dim, mask, ...)."""
    for family in all_families():
        if family.serves != problem.op or family.target_arch is None:
            continue
        if not get_arch(family.target_arch).runs_on(arch):
            continue
        try:  # the problem may not exist for that op at all (a V wider than it takes)
            variant = dataclasses.replace(problem, op=family.op)
            family.check_problem(variant)
        except InvalidProblem as refused:
            # the op's own family serves it; the refusal names why (a head dim, a feature)
            log.debug("%s does not serve %s on %s: %s", family.op, problem.key(), arch.name,
                      refused)
            continue
        return variant
    return problem


def served_on_virtual(problem: Problem, arch: ArchSpec) -> Problem:
    """What a virtual device of ``arch`` runs for ``problem`` (``DeviceInfo.virtual``): the
    arch-specific family's problem (``served_problem``) only when ``arch`` is that target itself
    (sm_90a), else ``problem``: a virtual sm_90 keeps the op's own family."""
    return served_problem(problem, arch) if arch.arch_specific else problem


def render(problem: Problem, config: KernelConfig) -> KernelSource:
    """The KernelSource of ``problem`` x ``config``, rendered by the problem's family."""
    return of(problem).render(problem, config)


__all__ = ["KernelFamily", "all_families", "get", "of", "register", "render",
           "served_on_virtual", "served_problem", "unregister"]
