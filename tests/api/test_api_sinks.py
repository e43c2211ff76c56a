"""Attention sinks through the API (``sinks=``), run by the CPU emulator: gradients of q, k,
v and the sinks through ``flashtune.attention`` (alone and with causal masks, windows,
softcaps, ALiBi and GQA) held to flash-attn's rule against float64 autograd (each error at
most 3x that of the same attention in plain PyTorch in the input dtype), deterministic
gradients (the sinks' included) bitwise equal over shuffled block orders, the varlen
forward and gradients, decoding over paged and unpaged caches, and the refusals of bad sinks.

The plain attention here is gpt-oss's eager definition (the sink appended as one more
column of the scores, softmaxed, then dropped), written independently of the kernels and
of flashtune's reference.
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Any

import pytest
import torch
from grad_helpers import (
    ShapeTuple,
    feature_scores,
    gradients,
    make_inputs,
    per_sequence,
    within_rule,
)

import flashtune
from flashtune.errors import InvalidInput

pytestmark = pytest.mark.emulator

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   causal: bool = False, window: tuple[int, int] = (-1, -1),
                   softcap: float | None = None, slopes: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """O and LSE of (B, N, H, D) tensors with sinks (H,), in the inputs' dtype,
    differentiable: softcapped, biased, masked scores with the sink appended as a column,
    softmax, the sink's column dropped (a row that sees no key gets O = 0, LSE = sink)."""
    scores, visible, v = feature_scores(q, k, v, causal, window, softcap, slopes)
    scores = scores.masked_fill(~visible, float("-inf"))
    column = sinks.to(scores.dtype)[None, :, None, None].expand(q.shape[0], -1, q.shape[1], 1)
    combined = torch.cat([scores, column], dim=-1)
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), torch.logsumexp(combined, dim=-1)


#: (causal, window_size, softcap, alibi)
FEATURES = [(False, (-1, -1), None, False), (True, (-1, -1), None, False),
            (False, (16, 0), None, False), (True, (-1, -1), 30.0, False),
            (False, (-1, -1), None, True), (False, (24, 4), 50.0, True)]
SHAPES: tuple[ShapeTuple, ...] = ((1, 77, 90, 4, 2), (2, 40, 40, 2, 2), (1, 90, 33, 3, 1))
GRID = list(itertools.product(FEATURES, (torch.float16, torch.bfloat16), SHAPES,
                              (False, True)))


def _draw_sinks(heads: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    sinks = torch.randn(heads, generator=gen) * 2 + 1
    sinks[0] = 6.0  # a sink that outweighs the row's keys
    return sinks


#: The gradients of (q, k, v, sinks).
WITH_SINKS = ("dq", "dk", "dv", "dsinks")


def _check(case: tuple[Any, ...]) -> None:
    (causal, window, softcap, alibi), dtype, shape, deterministic = case
    seed = random.Random(f"sinks-{SEED}-{case}").randrange(2**31)
    (q, k, v), dout = make_inputs(shape, 32, dtype, seed)
    sinks = _draw_sinks(shape[3], seed)
    gen = torch.Generator().manual_seed(seed)
    slopes = torch.rand(shape[0], shape[3], generator=gen) if alibi else None

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor
             ) -> torch.Tensor:
        out = flashtune.attention(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                  alibi_slopes=slopes, sinks=s, backend="emulator",
                                  deterministic=deterministic)
        assert isinstance(out, torch.Tensor)
        return out

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor
              ) -> torch.Tensor:
        return sink_attention(q, k, v, s, causal, window, softcap, slopes)[0]

    got = gradients(ours, (q, k, v, sinks), dout, WITH_SINKS)
    low = gradients(plain, (q, k, v, sinks.to(dtype)), dout, WITH_SINKS)
    exact = gradients(plain, (q.double(), k.double(), v.double(), sinks.double()), dout,
                      WITH_SINKS)
    assert set(got) == {"out", "dq", "dk", "dv", "dsinks"}
    within_rule(got, low, exact, f"{case} seed={seed}")
    assert got["dsinks"].dtype == torch.float32


def _id(case: tuple[Any, ...]) -> str:
    (causal, window, softcap, alibi), dtype, shape, deterministic = case
    parts = ["causal" if causal else "", f"w{window[0]}_{window[1]}" if window != (-1, -1)
             else "", f"cap{softcap:g}" if softcap else "", "alibi" if alibi else "",
             str(dtype)[6:], "x".join(map(str, shape)), "det" if deterministic else ""]
    return "-".join(p for p in parts if p)


@pytest.mark.usefixtures("dispatcher")
@pytest.mark.parametrize("case", random.Random(f"sinks-{SEED}").sample(GRID, 1), ids=_id)
def test_sink_gradients_within_3x_of_plain_pytorch(case: tuple[Any, ...]) -> None:
    _check(case)


@pytest.mark.sweep
@pytest.mark.usefixtures("dispatcher")
@pytest.mark.parametrize("case", GRID, ids=_id)
def test_sink_gradient_grid_within_3x_of_plain_pytorch(case: tuple[Any, ...]) -> None:
    _check(case)


@pytest.mark.usefixtures("dispatcher")
def test_deterministic_sink_gradients_are_bitwise_equal_over_block_orders(
        shuffled: list[str]) -> None:
    """dQ, dK, dV and d sinks of bwddet, with a window and sinks, in four block orders."""
    shape = (1, 100, 200, 4, 2)
    (q, k, v), dout = make_inputs(shape, 32, torch.float16, SEED)
    sinks = _draw_sinks(4, SEED)

    def run(backend: str) -> dict[str, torch.Tensor]:
        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor
               ) -> torch.Tensor:
            out = flashtune.attention(q, k, v, window_size=(40, 8), sinks=s, backend=backend,
                                      deterministic=True)
            assert isinstance(out, torch.Tensor)
            return out
        return gradients(fn, (q, k, v, sinks), dout, WITH_SINKS)

    runs = [run(name) for name in ["emulator", *shuffled]]
    for other in runs[1:]:
        for name in ("dq", "dk", "dv", "dsinks"):
            assert torch.equal(other[name], runs[0][name]), name


def test_the_lse_includes_the_sink_and_its_gradient_flows() -> None:
    """return_lse: LSE = log(exp(sink) + sum exp(s)); a loss on the LSE reaches the sinks
    (d LSE / d sink = exp(sink - LSE))."""
    # The kernels of the block-order test above (window, fp16, deterministic).
    (q, k, v), _ = make_inputs((1, 100, 200, 4, 2), 32, torch.float16, SEED + 1)
    sinks = _draw_sinks(4, SEED + 1).requires_grad_(True)
    out, lse = flashtune.attention(q, k, v, window_size=(40, 8), sinks=sinks, return_lse=True,
                                   backend="emulator", deterministic=True)
    exact = sinks.detach().double().requires_grad_(True)
    ref_o, ref_lse = sink_attention(q.double(), k.double(), v.double(), exact,
                                    window=(40, 8))
    assert float((lse.detach().double() - ref_lse.detach()).abs().max()) < 1e-3
    assert float((out.detach().double() - ref_o.detach()).abs().max()) < 4e-3
    torch.autograd.backward([lse.sum(), ref_lse.sum()])
    assert sinks.grad is not None and exact.grad is not None
    assert torch.allclose(sinks.grad.double(), exact.grad, atol=1e-3, rtol=1e-3)


def test_varlen_with_sinks_matches_each_sequence() -> None:
    """attention_varlen(sinks=) against each sequence on its own (a zero-length key
    sequence: O = 0 and LSE = sink), and its gradients (the sinks' included, summed over
    every sequence's rows) within flash-attn's rule of float64 autograd per sequence."""
    gen = torch.Generator().manual_seed(SEED)
    lens_q, lens_k = [9, 0, 30, 4], [12, 0, 25, 0]
    q = torch.randn(sum(lens_q), 4, 32, generator=gen).half()
    k = torch.randn(sum(lens_k), 2, 32, generator=gen).half()
    v = torch.randn(sum(lens_k), 2, 32, generator=gen).half()
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32)
    sinks = _draw_sinks(4, SEED)
    out, lse = flashtune.attention_varlen(q, k, v, cu_q, cu_k, 30, 25, causal=True,
                                          sinks=sinks, return_lse=True, backend="emulator")
    for b in range(4):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0:
            continue
        ref_o, ref_lse = sink_attention(q[None, q0:q1].double(), k[None, k0:k1].double(),
                                        v[None, k0:k1].double(), sinks.double(), causal=True)
        assert float((out[q0:q1].double() - ref_o[0]).abs().max()) < 4e-3, b
        assert float((lse[:, q0:q1].double() - ref_lse[0]).abs().max()) < 1e-3, b

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor
             ) -> torch.Tensor:
        out = flashtune.attention_varlen(q, k, v, cu_q, cu_k, 30, 25, causal=True, sinks=s,
                                         backend="emulator")
        assert isinstance(out, torch.Tensor)
        return out

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor
              ) -> torch.Tensor:
        return per_sequence(lambda qb, kb, vb, b: sink_attention(qb, kb, vb, s, True)[0],
                            cu_q, cu_k)(q, k, v)

    dout = torch.randn(q.shape, generator=gen).half()
    got = gradients(ours, (q, k, v, sinks), dout, WITH_SINKS)
    low = gradients(plain, (q, k, v, sinks.half()), dout, WITH_SINKS)
    exact = gradients(plain, (q.double(), k.double(), v.double(), sinks.double()), dout,
                      WITH_SINKS)
    within_rule(got, low, exact, f"varlen sinks seed={SEED}")


@pytest.mark.parametrize(("sinks", "match"), [
    (torch.zeros(4, dtype=torch.float16), "sinks has dtype torch.float16; expected torch.float32"),
    (torch.zeros(3), r"sinks has shape \(3,\); expected \(4,\)"),
    (torch.zeros(1, 4), r"sinks has shape \(1, 4\); expected \(4,\)"),
    ([0.0] * 4, "sinks must be a torch.Tensor, got list"),
])
def test_bad_sinks_are_refused_naming_them(sinks: Any, match: str) -> None:
    q = torch.zeros(1, 8, 4, 16, dtype=torch.float16)
    k = torch.zeros(1, 8, 2, 16, dtype=torch.float16)
    with pytest.raises(InvalidInput, match=match):
        flashtune.attention(q, k, k, sinks=sinks, backend="emulator")
    cache = torch.zeros(1, 16, 2, 16, dtype=torch.float16)
    with pytest.raises(InvalidInput, match=match):
        flashtune.attention_with_kvcache(q[:, :1], cache, cache,
                                         torch.tensor([8], dtype=torch.int32), sinks=sinks,
                                         backend="emulator")


def test_explain_names_the_sinks_problem() -> None:
    """Sinks are their own problem key (the plain key is unchanged)."""
    q = torch.empty(1, 64, 4, 64, dtype=torch.float16, device="meta")
    sinks = torch.zeros(4, device="meta")
    assert flashtune.explain(q, q, q, sinks=sinks).problem.key() == "fwd_d64_fp16_full_sinks"
    assert flashtune.explain(q, q, q).problem.key() == "fwd_d64_fp16_full"
