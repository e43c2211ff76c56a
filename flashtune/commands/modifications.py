"""``--score-mod MODULE:FUNCTION`` and ``--mask-mod MODULE:FUNCTION``: a traced modification
(``codegen.trace``) on the command line.

The function is imported from the user's own module (as ``python -c "from MODULE import
FUNCTION"`` would) and traced; the Problem gets its feature (registered by digest,
``api.flex.traced_feature``), so ``show`` prints the kernel with the traced expression in
its ``ScoreMods`` functor. A modification that captures tensors renders with its captured
tensors as kernel arguments.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Annotated, Any

import typer

from flashtune.codegen.spec import Problem
from flashtune.errors import FlashtuneError

ScoreModOpt = Annotated[str | None, typer.Option(
    "--score-mod", metavar="MODULE:FUNCTION",
    help="A FlexAttention score_mod(score, b, h, q_idx, kv_idx), traced into the kernel.")]
MaskModOpt = Annotated[str | None, typer.Option(
    "--mask-mod", metavar="MODULE:FUNCTION",
    help="A FlexAttention mask_mod(b, h, q_idx, kv_idx), traced into the kernel.")]


def load_function(spec: str, option: str) -> Callable[..., Any]:
    """The function ``MODULE:FUNCTION`` names (a usage error naming ``option`` otherwise)."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name.isidentifier():
        raise typer.BadParameter(f"{spec!r} is not MODULE:FUNCTION, e.g. mymods:rel_bias",
                                 param_hint=option)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise typer.BadParameter(f"cannot import {module_name!r}: {exc}; is it on "
                                 "PYTHONPATH?", param_hint=option) from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise typer.BadParameter(f"{module_name!r} has no function {name!r}",
                                 param_hint=option)
    return fn  # type: ignore[no-any-return]


def with_modifications(problem: Problem, score_mod: str | None, mask_mod: str | None
                       ) -> Problem:
    """``problem`` with the traced modification of the options (unchanged without)."""
    if score_mod is None and mask_mod is None:
        return problem
    from flashtune.api.flex import traced_feature
    from flashtune.codegen.trace import trace

    score = None if score_mod is None else load_function(score_mod, "--score-mod")
    mask = None if mask_mod is None else load_function(mask_mod, "--mask-mod")
    try:
        name = traced_feature(trace(score, mask))
        # replace keeps every other field (the per-operand types, V's head dim)
        return dataclasses.replace(problem, features=(*problem.features, name))
    except FlashtuneError as exc:
        raise typer.BadParameter(str(exc), param_hint="--score-mod/--mask-mod") from exc
