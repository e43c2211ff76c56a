"""The shared verification step: its float64 reference and what it rejects."""

from __future__ import annotations

import math

import pytest
import torch

from flashtune.codegen.spec import DType, Problem
from flashtune.perf.workload import Shape
from flashtune.runtime.verify import TOLERANCES, compare, random_inputs, reference


@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_torch_sdpa_in_float64_with_gqa(causal: bool) -> None:
    problem = Problem(64, DType.BF16, causal=causal)
    shape = Shape(2, 4, 2, 37, 37)
    q, k, v = random_inputs(problem, shape, "cpu")
    scale = 1 / math.sqrt(64)
    out, lse = reference(q, k, v, causal, scale)
    # torch's SDPA on (B, H, N, D) float64 tensors, K/V heads repeated for GQA
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(2, dim=1), vd.repeat_interleave(2, dim=1)
    expected = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=causal,
                                                                scale=scale)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-12, atol=1e-12)
    scores = torch.einsum("bhqd,bhkd->bhqk", qd, kd) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)


def test_fresh_inputs_differ_between_calls() -> None:
    problem = Problem(64, DType.FP16)
    shape = Shape(1, 1, 1, 16, 16)
    a, b = random_inputs(problem, shape, "cpu")[0], random_inputs(problem, shape, "cpu")[0]
    assert a.dtype == torch.float16 and not torch.equal(a, b)


@pytest.mark.parametrize("dtype", [DType.FP16, DType.BF16])
def test_compare_accepts_rounding_and_rejects_errors(dtype: DType) -> None:
    problem = Problem(64, dtype)
    shape = Shape(1, 2, 2, 33, 33)
    q, k, v = random_inputs(problem, shape, "cpu")
    ref_out, ref_lse = reference(q, k, v, False, 0.125)
    tdtype = q.dtype
    rounded = ref_out.to(tdtype)  # what a correct kernel writes: O rounded to its type
    lse = ref_lse.float()
    assert compare(problem, rounded, lse, ref_out, ref_lse, shape).ok

    wrong = rounded.clone()
    wrong[0, 5, 1, 3] += 20 * TOLERANCES[dtype].atol + 0.1
    verdict = compare(problem, wrong, lse, ref_out, ref_lse, shape)
    assert not verdict.ok and "outside" in verdict.message

    unwritten = rounded.clone()
    unwritten[0, -1] = float("nan")  # the last row of a partial tile never stored
    verdict = compare(problem, unwritten, lse, ref_out, ref_lse, shape)
    assert not verdict.ok and "unwritten" in verdict.message

    bad_lse = lse.clone()
    bad_lse[0, 1, 7] += 0.01
    verdict = compare(problem, rounded, bad_lse, ref_out, ref_lse, shape)
    assert not verdict.ok and "LSE" in verdict.message


def test_rows_that_see_no_key_need_zero_output_and_infinite_lse() -> None:
    problem = Problem(32, DType.FP16, causal=True)
    shape = Shape(1, 1, 1, 9, 4)  # causal with Nq > Nk: the first 5 rows see no key
    q, k, v = random_inputs(problem, shape, "cpu")
    ref_out, ref_lse = reference(q, k, v, True, 0.2)
    assert torch.isposinf(ref_lse[0, 0, :5]).all() and (ref_out[0, :5] == 0).all()
    assert torch.isfinite(ref_lse[0, 0, 5:]).all()
    good = compare(problem, ref_out.to(q.dtype), ref_lse.float(), ref_out, ref_lse, shape)
    assert good.ok, good.message
    wrong_lse = ref_lse.float().clone()
    wrong_lse[0, 0, 2] = -math.inf
    verdict = compare(problem, ref_out.to(q.dtype), wrong_lse, ref_out, ref_lse, shape)
    assert not verdict.ok and "no key" in verdict.message
