"""The forward family's float64 reference, its inputs and what its comparison rejects."""

from __future__ import annotations

import math

import pytest
import torch

from flashtune.codegen.spec import DType, Problem, Shape
from flashtune.families.base import Inputs
from flashtune.families.fwd import FORWARD
from flashtune.families.fwd.reference import O_TOLERANCE


def _inputs(problem: Problem, shape: Shape, scale: float | None = None) -> Inputs:
    drawn = FORWARD.random_inputs(problem, shape, "cpu")
    if scale is None:
        return drawn
    return Inputs(drawn.tensors, {"softmax_scale": scale})


@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_torch_sdpa_in_float64_with_gqa(causal: bool) -> None:
    problem = Problem(64, DType.BF16, causal=causal)
    inputs = _inputs(problem, Shape(2, 4, 2, 37, 37))
    ref = FORWARD.reference(problem, inputs)
    q, k, v = (inputs.tensors[n] for n in ("q", "k", "v"))
    scale = inputs.scalars["softmax_scale"]
    assert scale == 1 / math.sqrt(64)
    # torch's SDPA on (B, H, N, D) float64 tensors, K/V heads repeated for GQA
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(2, dim=1), vd.repeat_interleave(2, dim=1)
    expected = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=causal,
                                                                scale=scale)
    torch.testing.assert_close(ref["o"], expected.transpose(1, 2), rtol=1e-12, atol=1e-12)
    scores = torch.einsum("bhqd,bhkd->bhqk", qd, kd) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), -math.inf)
    torch.testing.assert_close(ref["lse"], torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)


def test_fresh_inputs_differ_between_calls_and_a_seed_replays() -> None:
    problem = Problem(64, DType.FP16)
    shape = Shape(1, 1, 1, 16, 16)
    a, b = (FORWARD.random_inputs(problem, shape, "cpu").tensors["q"] for _ in range(2))
    assert a.dtype == torch.float16 and not torch.equal(a, b)
    c, d = (FORWARD.random_inputs(problem, shape, "cpu", seed=5).tensors["q"] for _ in range(2))
    assert torch.equal(c, d)


@pytest.mark.parametrize("dtype", [DType.FP16, DType.BF16])
def test_compare_accepts_rounding_and_rejects_errors(dtype: DType) -> None:
    problem = Problem(64, dtype)
    shape = Shape(1, 2, 2, 33, 33)
    inputs = _inputs(problem, shape, 0.125)
    ref = FORWARD.reference(problem, inputs)
    rounded = ref["o"].to(inputs.tensors["q"].dtype)  # what a correct kernel writes
    lse = ref["lse"].float()
    assert FORWARD.compare(problem, shape, {"o": rounded, "lse": lse}, ref).ok

    wrong = rounded.clone()
    wrong[0, 5, 1, 3] += 20 * O_TOLERANCE[dtype].atol + 0.1
    verdict = FORWARD.compare(problem, shape, {"o": wrong, "lse": lse}, ref)
    assert not verdict.ok and "outside" in verdict.message

    unwritten = rounded.clone()
    unwritten[0, -1] = float("nan")  # the last row of a partial tile never stored
    verdict = FORWARD.compare(problem, shape, {"o": unwritten, "lse": lse}, ref)
    assert not verdict.ok and "unwritten" in verdict.message

    bad_lse = lse.clone()
    bad_lse[0, 1, 7] += 0.01
    verdict = FORWARD.compare(problem, shape, {"o": rounded, "lse": bad_lse}, ref)
    assert not verdict.ok and "LSE" in verdict.message


def test_rows_that_see_no_key_need_zero_output_and_infinite_lse() -> None:
    problem = Problem(32, DType.FP16, causal=True)
    shape = Shape(1, 1, 1, 9, 4)  # causal with Nq > Nk: the first 5 rows see no key
    inputs = _inputs(problem, shape, 0.2)
    ref = FORWARD.reference(problem, inputs)
    assert torch.isposinf(ref["lse"][0, 0, :5]).all() and (ref["o"][0, :5] == 0).all()
    assert torch.isfinite(ref["lse"][0, 0, 5:]).all()
    good = {"o": ref["o"].to(torch.float16), "lse": ref["lse"].float()}
    assert FORWARD.compare(problem, shape, good, ref).ok
    wrong_lse = good["lse"].clone()
    wrong_lse[0, 0, 2] = -math.inf
    verdict = FORWARD.compare(problem, shape, {**good, "lse": wrong_lse}, ref)
    assert not verdict.ok and "LSE" in verdict.message
    finite_lse = good["lse"].clone()
    finite_lse[0, 0, 1] = 3.0  # a row that sees no key must not get a finite LSE
    verdict = FORWARD.compare(problem, shape, {**good, "lse": finite_lse}, ref)
    assert not verdict.ok and "LSE" in verdict.message
