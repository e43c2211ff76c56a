"""Derivatives of traced modifications (codegen.trace_grad): the slope by the score and the
gradients of captured tensors equal torch autograd of the user's own Python function in
float64 on dense grids (ties and kinks included), for the ready score modifications of
api.flex_mods and expressions that use every differentiable operation; an operation
without a supported derivative is refused naming it and the user's line; the slope's CUDA
holds no text of the user's code."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from flashtune.api import flex_mods
from flashtune.codegen import trace_grad
from flashtune.codegen.trace import trace
from flashtune.codegen.trace_expr import LEAVES, evaluate
from flashtune.codegen.trace_grad import (
    NotDifferentiable,
    captured_grads,
    derivative,
    fixed_order_sum,
)

_SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
B, H, L, S = 2, 3, 19, 23
Fn = Callable[..., Any]


def _grid(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    # Scores on a coarse lattice so that ties (min/max, abs at 0, where on equality) occur.
    score = (torch.randint(-12, 13, (B, H, L, S), generator=gen).to(torch.float64) / 4)
    return (score, torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
            torch.arange(L).view(1, 1, L, 1), torch.arange(S).view(1, 1, 1, S))


def _cases(gen: torch.Generator) -> dict[str, tuple[Fn, list[torch.Tensor]]]:
    """name -> (score_mod, the captured float64 tensors it closes over)."""
    t5 = torch.randn(H, 32, generator=gen, dtype=torch.float64)
    slopes = torch.rand(H, generator=gen, dtype=torch.float64)
    weight = torch.randn(B, H, generator=gen, dtype=torch.float64)
    table = torch.randn(L, S, generator=gen, dtype=torch.float64)
    temp = torch.rand(H, generator=gen, dtype=torch.float64) + 0.5
    return {
        "t5": (flex_mods.t5_relative_bias(t5, max(L, S), 40), [t5]),
        "alibi": (flex_mods.alibi(slopes), [slopes]),
        "softcap": (flex_mods.softcap(2.5), []),
        "every-op": (lambda s, b, h, q, k: torch.where(
            (q - k) // 3 % 2 == 0, torch.minimum(s, (q - 2 * k) % 5 / 2.0),
            -torch.abs(s) + torch.sigmoid(s) * torch.exp(-s * s) - torch.log(1 + s * s)
            + torch.maximum(s * 0.5, -s) + (h - q) // -4 + torch.tanh(s / 3.0)
            + (s * 1.5) % 1.25), []),
        "learned-scale": (lambda s, b, h, q, k: s * weight[b, h] / temp[h]
                          + table[q, k] * table[k % L, q] - torch.tanh(table[q, k] * s),
                          [weight, temp, table]),
        "masked-bias": (lambda s, b, h, q, k: torch.where(k <= q, s + table[q, k], s * 0.0
                                                          - table[q, k]), [table]),
    }


@pytest.mark.parametrize("name", ["t5", "alibi", "softcap", "every-op", "learned-scale",
                                  "masked-bias"])
def test_slopes_and_captured_gradients_match_torch_autograd(name: str) -> None:
    gen = torch.Generator().manual_seed(_SEED)
    score_mod, tensors = _cases(gen)[name]
    score, b, h, q, k = _grid(gen)
    traced = trace(score_mod)
    # The slope by the score: its tree evaluated vs autograd of the user's function.
    x = score.clone().requires_grad_(True)
    for t in tensors:
        t.requires_grad_(True)
    out = score_mod(x, b, h, q, k).expand(B, H, L, S)
    upstream = torch.randn(B, H, L, S, generator=gen, dtype=torch.float64)
    upstream[torch.rand(B, H, L, S, generator=gen) < 0.2] = 0.0  # hidden positions
    wanted = torch.autograd.grad(out, [x, *tensors], upstream, allow_unused=True)
    leaves = {"score": score, "batch": b, "head": h, "q_idx": q, "kv_idx": k}
    slope = evaluate(traced.score_slope(), leaves, list(traced.captured)).expand(B, H, L, S)
    torch.testing.assert_close(slope * upstream, wanted[0], rtol=1e-12, atol=1e-12,
                               msg=lambda m: f"{name} seed={_SEED}: d/dscore: {m}")
    slots = [next(i for i, c in enumerate(traced.captured) if c is t) for t in tensors]
    assert sorted(traced.grad_slots()) == sorted(slots)
    got = captured_grads(traced.expression, traced.captured, traced.grad_slots(), upstream,
                         score)
    for i, (slot, t) in enumerate(zip(slots, tensors, strict=True)):
        want = wanted[1 + i] if wanted[1 + i] is not None else torch.zeros_like(t)

        def message(m: str, s: int = slot) -> str:
            return f"{name} seed={_SEED}: d/dt{s}: {m}"

        torch.testing.assert_close(got[slot], want, rtol=1e-10, atol=1e-10, msg=message)


def test_a_mask_passes_the_slope_of_the_visible_part() -> None:
    traced = trace(flex_mods.softcap(3.0), flex_mods.causal)
    score, b, h, q, k = _grid(torch.Generator().manual_seed(_SEED))
    leaves = {"score": score, "batch": b, "head": h, "q_idx": q, "kv_idx": k}
    slope = evaluate(traced.score_slope(), leaves, [])
    torch.testing.assert_close(slope, 1 - torch.tanh(score / 3.0) ** 2)
    assert derivative(trace(mask_mod=flex_mods.causal).score_slope(), LEAVES["score"]) is None


def _floor(s: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
    return s + (s * 2.0) // 1.0


def test_an_operation_without_a_derivative_is_refused_naming_it_and_the_line() -> None:
    traced = trace(_floor)
    assert traced.score_mod().grad == ""  # the forward still serves it
    with pytest.raises(NotDifferentiable) as info:
        traced.score_slope()
    message = str(info.value)
    assert "floor division (//)" in message, message
    assert f"{__file__}:{_floor.__code__.co_firstlineno + 1}" in message, message
    # An int floor division of the indices is fine: it has no slope to pass.
    assert trace(lambda s, b, h, q, k: s * ((q - k) // 4)).grad_cuda()


def test_the_slopes_cuda_holds_no_user_text() -> None:
    system_call = torch.ones(5, 5)

    def mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return torch.tanh(score * system_call[q_idx % 3, kv_idx]) + system_call[0, 0]

    traced = trace(mod)
    cuda = traced.grad_cuda()
    for token in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", cuda):
        assert token in {"score", "q_idx", "kv_idx", "ft", "flex", "mod", "load2", "tanhf",
                         "float", "f"} or re.fullmatch(rf"{traced.name}_t\d+(_n\d+)?",
                                                       token), token
    assert "system" not in cuda


def test_the_fixed_order_sum_sums_per_element_and_ignores_thread_order() -> None:
    gen = torch.Generator().manual_seed(_SEED)
    index = torch.randint(0, 37, (5000,), generator=gen)
    index[:700] = 3  # one long run
    values = torch.randn(5000, generator=gen, dtype=torch.float64)
    got = fixed_order_sum(index, values, 40)
    want = torch.zeros(40, dtype=torch.float64).index_add_(0, index, values)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (got[37:] == 0).all()
    assert torch.equal(fixed_order_sum(index, values, 40), got)
    one = fixed_order_sum(index[:1], values[:1], 40)  # a single pair: no doubling step
    assert one[3] == values[0] and one.count_nonzero() == 1


def test_captured_gradients_are_the_same_a_block_of_rows_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(_SEED)
    score_mod, tensors = _cases(gen)["learned-scale"]
    score, *_ = _grid(gen)
    for t in tensors:
        t.requires_grad_(True)
    traced = trace(score_mod)
    upstream = torch.randn(B, H, L, S, generator=gen, dtype=torch.float64)
    whole = captured_grads(traced.expression, traced.captured, traced.grad_slots(), upstream,
                           score)
    monkeypatch.setattr(trace_grad, "CHUNK_ELEMENTS", B * H * S * 3)  # 3 rows at a time
    blocks = captured_grads(traced.expression, traced.captured, traced.grad_slots(),
                            upstream, score)
    for slot in traced.grad_slots():
        torch.testing.assert_close(blocks[slot], whole[slot], rtol=1e-12, atol=1e-12)
