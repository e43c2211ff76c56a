"""The forward family's float64 reference, its inputs and what its comparison rejects."""

from __future__ import annotations

import math

import pytest
import torch

from flashtune.codegen.spec import DType, Problem, Shape
from flashtune.families.base import Inputs
from flashtune.families.checks import O_TOLERANCE
from flashtune.families.fwd import FORWARD


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


def _loop_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    window: tuple[int, int], softcap: float | None,
                    slopes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The features written element by element from their definitions (one batch)."""
    nq, hq, d = q.shape[1], q.shape[2], q.shape[3]
    nk, group = k.shape[1], q.shape[2] // k.shape[2]
    out = torch.zeros(1, nq, hq, d, dtype=torch.float64)
    lse = torch.full((1, hq, nq), math.inf, dtype=torch.float64)
    for h in range(hq):
        for i in range(nq):
            logits, values = [], []
            for j in range(nk):
                diag = i + nk - nq
                if (window[0] >= 0 and j < diag - window[0]) or (
                        window[1] >= 0 and j > diag + window[1]):
                    continue
                s = float(q[0, i, h].double() @ k[0, j, h // group].double()) * scale
                if softcap is not None:
                    s = softcap * math.tanh(s / softcap)
                if slopes is not None:
                    s -= float(slopes[h]) * abs(diag - j)
                logits.append(s)
                values.append(v[0, j, h // group].double())
            if logits:
                top = max(logits)
                weights = torch.tensor([math.exp(x - top) for x in logits], dtype=torch.float64)
                total = float(weights.sum())
                out[0, i, h] = sum(w * val for w, val in zip(weights, values, strict=True)) / total
                lse[0, h, i] = top + math.log(total)
    return out, lse


@pytest.mark.parametrize(("window", "softcap", "alibi"),
                         [((3, 0), None, False), ((-1, 2), 5.0, False), ((4, -1), None, True),
                          ((2, 5), 30.0, True), ((-1, -1), 5.0, True)])
def test_features_match_their_definitions_element_by_element(
        window: tuple[int, int], softcap: float | None, alibi: bool) -> None:
    problem = Problem(16, DType.FP16, window=window != (-1, -1), softcap=softcap is not None,
                      alibi=alibi)
    inputs = FORWARD.random_inputs(problem, Shape(1, 2, 1, 9, 13), "cpu", seed=5)
    q, k, v = (inputs.tensors[n] for n in ("q", "k", "v"))
    slopes = inputs.tensors["alibi_slopes"][0] if alibi else None
    scalars = dict(inputs.scalars) | {"window_left": window[0], "window_right": window[1]}
    if softcap is not None:
        scalars["softcap"] = softcap
    ref = FORWARD.reference(problem, Inputs(dict(inputs.tensors), scalars))
    o, lse = _loop_reference(q, k, v, scalars["softmax_scale"], window, softcap, slopes)
    torch.testing.assert_close(ref["o"], o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref["lse"], lse, rtol=1e-12, atol=1e-12)
    if window == (3, 0):  # Nq < Nk: every row sees its diagonal key and three before it
        assert torch.isfinite(ref["lse"]).all()


def test_random_feature_values_come_from_the_grids() -> None:
    problem = Problem(32, DType.BF16, window=True, softcap=True, alibi=True)
    inputs = FORWARD.random_inputs(problem, Shape(2, 3, 1, 8, 8), "cpu", seed=11)
    from flashtune.families.fwd.variants import SOFTCAPS, WINDOW_SIZES

    window = (inputs.scalars["window_left"], inputs.scalars["window_right"])
    assert window != (-1, -1) and set(window) <= set(WINDOW_SIZES)
    assert inputs.scalars["softcap"] in SOFTCAPS
    slopes = inputs.tensors["alibi_slopes"]
    assert slopes.shape == (2, 3) and slopes.dtype == torch.float32
