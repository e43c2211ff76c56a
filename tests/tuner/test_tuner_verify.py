"""The verification step: its float64 reference and what it rejects."""

from __future__ import annotations

import math

import pytest
import torch

from flashtune.codegen.spec import DType, Problem
from flashtune.db.records import TrialStatus
from flashtune.perf.workload import Shape
from flashtune.tuner.verify import TOLERANCES, compare, random_inputs, reference


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
    assert compare(problem, rounded, lse, ref_out, ref_lse, shape).status is TrialStatus.OK

    wrong = rounded.clone()
    wrong[0, 5, 1, 3] += 20 * TOLERANCES[dtype].atol + 0.1
    verdict = compare(problem, wrong, lse, ref_out, ref_lse, shape)
    assert verdict.status is TrialStatus.WRONG_RESULT and "outside" in (verdict.error or "")

    unwritten = rounded.clone()
    unwritten[0, -1] = float("nan")  # the last row of a partial tile never stored
    verdict = compare(problem, unwritten, lse, ref_out, ref_lse, shape)
    assert verdict.status is TrialStatus.WRONG_RESULT and "unwritten" in (verdict.error or "")

    bad_lse = lse.clone()
    bad_lse[0, 1, 7] += 0.01
    verdict = compare(problem, rounded, bad_lse, ref_out, ref_lse, shape)
    assert verdict.status is TrialStatus.WRONG_RESULT and "LSE" in (verdict.error or "")
