"""A feature added through declarations only: a score modification registered in this file
(a ``Feature`` with a ``ScoreMod``) is keyed, gated, rendered into the forward kernel, given
its own kernel argument, packed, run in the CPU emulator and checked against the float64
reference, with no edit of any family, runtime or API module.

Two modifications: a constant score bias (it shifts every LSE; O is unchanged) and a bias
that depends on the batch, the query head, the row and the key (it changes O, and catches
a wrong index). Each case runs with NaN-poisoned outputs on fresh inputs from a printed seed,
and a control checks that the kernel's outputs do not match the reference without the
modification (the kernel applied it)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch

from flashtune.api import flex_mods
from flashtune.api.flex import traced_feature
from flashtune.codegen.arch import ARCHS
from flashtune.codegen.features import Feature, register_feature, unregister_feature
from flashtune.codegen.score_mods import ModParam, ScoreMod
from flashtune.codegen.spec import DType, Problem, Shape
from flashtune.codegen.trace import trace
from flashtune.families import render
from flashtune.families.base import Inputs
from flashtune.families.fwd import FORWARD
from flashtune.runtime.backends.emulator import EmulatorBackend

pytestmark = pytest.mark.emulator

_SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
_ARCH = ARCHS["sm_80"]

BIAS = Feature("bias", "bias", "a constant score bias (score_bias)", score=ScoreMod(
    "score + bias", lambda score, b, h, q_idx, kv_idx, bias: score + bias,
    (ModParam("bias", draws=(0.75, -1.5, 2.0)),)))

#: A bias by position, head and batch: weight * ((q + 2 kv + 3 head + 5 batch) mod 4).
STRIPES = Feature("stripes", "stripes", "a striped bias (stripes)", score=ScoreMod(
    "score + weight * (float)((q_idx + 2 * kv_idx + 3 * head + 5 * batch) % period)",
    lambda score, b, h, q_idx, kv_idx, weight, period:
        score + weight * ((q_idx + 2 * kv_idx + 3 * h + 5 * b) % period).to(torch.float64),
    (ModParam("weight", draws=(0.4, -0.7)), ModParam("period", "int", draws=(3, 4)))))


@pytest.fixture
def declared() -> Iterator[None]:
    register_feature(BIAS)
    register_feature(STRIPES)
    try:
        yield
    finally:
        unregister_feature(STRIPES.name)
        unregister_feature(BIAS.name)


def _run(problem: Problem, shape: Shape, seed: int) -> tuple[dict[str, torch.Tensor], Inputs]:
    inputs = FORWARD.random_inputs(problem, shape, "cpu", seed)
    config = FORWARD.default_config(problem, _ARCH)
    kernel = EmulatorBackend().load(render(problem, config))
    outputs = FORWARD.empty_outputs(problem, shape, inputs, poison=True)
    plan = FORWARD.launch_plan(problem, config, shape, inputs, outputs)
    kernel.launch(plan.grid, plan.args)
    return outputs, inputs


#: (head dim, dtype, switches, shape): problems are made inside the tests, once the
#: features are registered.
_CASES = [
    (64, DType.FP16, {"bias": True}, Shape(2, 2, 2, 70, 90)),
    (64, DType.BF16, {"causal": True, "stripes": True}, Shape(2, 4, 2, 65, 130)),
    (32, DType.FP16, {"softcap": True, "stripes": True, "bias": True}, Shape(1, 2, 1, 40, 72)),
    (64, DType.FP16, {"varlen": True, "window": True, "stripes": True}, Shape(3, 2, 2, 48, 48)),
]


@pytest.mark.parametrize(("head_dim", "dtype", "switches", "shape"), _CASES,
                         ids=["bias", "causal-stripes-gqa", "softcap-stripes-bias",
                              "varlen-window-stripes"])
def test_a_declared_modification_runs_in_the_forward_kernel(
        declared: None, head_dim: int, dtype: DType, switches: dict[str, bool],
        shape: Shape) -> None:
    problem = Problem(head_dim, dtype, **cast(dict[str, Any], switches))
    seed = random.Random(f"{_SEED}-{problem.key()}").randrange(2**31)
    outputs, inputs = _run(problem, shape, seed)
    where = f"{problem.key()} {shape.key()} {dict(inputs.scalars)} seed={seed}"
    verdict = FORWARD.compare(problem, shape, outputs, FORWARD.reference(problem, inputs))
    assert verdict.ok, f"{where}: {verdict.message}"
    # The control: without the modifications the reference differs from the kernel.
    plain = Problem(problem.head_dim, problem.dtype, causal=problem.causal,
                    features=[f for f in problem.features if f not in ("bias", "stripes")])
    control = FORWARD.compare(plain, shape, outputs, FORWARD.reference(plain, inputs))
    assert not control.ok, f"{where}: the kernel's outputs match the unmodified reference"


def test_the_declaration_is_the_kernel_argument_and_the_source(declared: None) -> None:
    problem = Problem(64, DType.FP16, causal=True, stripes=True)
    source = render(problem, FORWARD.default_config(problem, _ARCH)).code
    assert "float weight;\n  int period;" in source
    assert "score = (score + weight * (float)((q_idx" in source
    assert "ScoreMods{weight, period}" in source
    assert FORWARD.abi is not None
    assert FORWARD.abi.signature(problem.features).endswith("float weight, int period")
    assert FORWARD.abi.emulator_signature(problem.features).endswith("fi")
    # A problem without it keeps the plain kernel's source and arguments.
    plain = Problem(64, DType.FP16, causal=True)
    assert "ScoreMods" not in render(plain, FORWARD.default_config(plain, _ARCH)).code
    assert "weight" not in FORWARD.abi.signature(plain.features)


def test_a_missing_value_is_named(declared: None) -> None:
    problem = Problem(64, DType.FP16, bias=True)
    shape = Shape(1, 1, 1, 16, 16)
    inputs = FORWARD.random_inputs(problem, shape, "cpu", 0)
    scalars = {k: v for k, v in inputs.scalars.items() if k != "bias"}
    outputs = FORWARD.empty_outputs(problem, shape, inputs, poison=True)
    with pytest.raises(Exception, match="needs the value of 'bias'"):
        FORWARD.launch_plan(problem, FORWARD.default_config(problem, _ARCH), shape,
                            Inputs(inputs.tensors, scalars), outputs)


def test_params_of_two_modifications_cannot_share_a_name(declared: None) -> None:
    twin = Feature("twin", "twin", "a second bias (twin)", score=ScoreMod(
        "score - bias", lambda score, b, h, q, k, bias: score - bias, (ModParam("bias"),)))
    with pytest.raises(Exception, match=r"params \['bias'\] are taken by \['bias'\]"):
        register_feature(twin)


@pytest.mark.parametrize(("make", "needle"), [
    (lambda: ScoreMod("score; return 0", lambda *a: a[0]), "one C\\+\\+ expression"),
    (lambda: ScoreMod("score", lambda *a: a[0], (ModParam("q_idx"),)), "not one of"),
    (lambda: ModParam("n", "double"), "expected one of"),
    (lambda: ModParam("n", "int", draws=(0.5,)), "whole numbers"),
])
def test_bad_modifications_are_refused(make, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(Exception, match=needle):
        make()


def test_verification_draws_of_captured_ints_cut_rows_and_repeat_ids() -> None:
    """A FlashMask-like bound drawn for verification hides some rows of a column and not
    others (ints in [0, 4) alone hid every row past the third: zeros that any config
    matches), and small ids still repeat (document-like masks see more than the diagonal)."""
    n = 256
    traced = trace(None, flex_mods.flashmask(torch.full((n,), n)))
    problem = Problem(64, DType.FP16, features=[traced_feature(traced)])
    drawn = FORWARD.random_inputs(problem, Shape(1, 1, 1, n, n), "cpu", 1234)
    ends = drawn.tensors[f"{traced.name}_t0"].long()
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = flex_mods.flashmask(ends)(torch.zeros(1, dtype=torch.long),
                                        torch.zeros(1, dtype=torch.long), q, k)
    seen = visible.any(-1)
    assert int(seen.sum()) > n // 4, int(seen.sum())  # rows past the third see keys
    assert int(visible.sum()) < int((k <= q).sum())   # and some are cut
    assert int((ends < 4).sum()) > n // 4              # small values (repeating ids) too
