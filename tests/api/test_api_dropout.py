"""Attention dropout through the API: ``flashtune.attention(dropout_p=...)`` forward and
gradients, ``attention_varlen`` (forward and gradients), the SDPA drop-in's ``dropout_p``
and the transformers integration's ``dropout``, run by the CPU emulator.

The mask of a call is drawn by the tests' own Philox (``dropout_philox``) from the seed the
API takes from torch's CPU generator (its documented draw: two 32-bit words, high first,
offset 0), and the outputs and gradients are held to flash-attn's rule against float64
autograd through that mask (the default run draws one case from the run's seed; ``-m sweep``
runs them all).
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Any

import pytest
import torch
from dropout_philox import call_seed, float32, mask
from grad_helpers import (
    ShapeTuple,
    feature_scores,
    gradients,
    make_inputs,
    packed_inputs,
    per_sequence,
    within_rule,
)

import flashtune
from flashtune.api.hf_transformers import make_attention_function
from flashtune.errors import InvalidInput

pytestmark = pytest.mark.emulator

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])

#: (causal, window_size, softcap, alibi, dropout_p).
FEATURES = [(False, (-1, -1), None, False, 0.17), (True, (-1, -1), None, False, 0.5),
            (False, (16, 4), None, False, 0.17), (True, (-1, -1), 30.0, False, 0.1),
            (False, (-1, -1), None, True, 0.3), (False, (24, 4), 50.0, True, 0.17)]
SHAPES: tuple[ShapeTuple, ...] = ((1, 77, 90, 2, 1), (2, 40, 33, 4, 2))
GRID = list(itertools.product(FEATURES, (torch.float16, torch.bfloat16), SHAPES,
                              (False, True)))


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    window: tuple[int, int], softcap: float | None,
                    slopes: torch.Tensor | None, kept: torch.Tensor, p: float
                    ) -> torch.Tensor:
    """flash-attn's attention with dropout in plain, differentiable PyTorch, in the inputs'
    dtype: P M / (1 - p) for the mask ``kept`` (B, Hq, Nq, Nk)."""
    scores, visible, v = feature_scores(q, k, v, causal, window, softcap, slopes)
    seen = visible.any(-1)[:, None]
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~seen, 0.0)
    probs = torch.softmax(scores, dim=-1).masked_fill(~seen, 0.0)
    probs = probs * kept.to(probs.dtype) * (1.0 / (1.0 - float32(p)))
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def _check(case: tuple[tuple[bool, tuple[int, int], float | None, bool, float], torch.dtype,
                       ShapeTuple, bool]) -> None:
    (causal, window, softcap, alibi, p), dtype, shape, deterministic = case
    seed = random.Random(f"{SEED}-{case}").randrange(2**31)
    inputs, dout = make_inputs(shape, 32, dtype, seed)
    gen = torch.Generator().manual_seed(seed)
    slopes = torch.rand(shape[0], shape[3], generator=gen) if alibi else None
    batch, nq, nk, hq, _ = shape
    kept = mask(call_seed(seed), 0, p, range(batch), hq, nq, nk)

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(seed)
        out = flashtune.attention(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                  alibi_slopes=slopes, backend="emulator",
                                  deterministic=deterministic, dropout_p=p)
        assert isinstance(out, torch.Tensor)
        return out

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return plain_attention(q, k, v, causal, window, softcap, slopes, kept, p)

    got = gradients(ours, inputs, dout)
    low = gradients(plain, inputs, dout)
    exact = gradients(plain, tuple(t.double() for t in inputs), dout)
    within_rule(got, low, exact, f"{case} seed={seed}")


def test_dropout_gradients_follow_flash_attn_rule() -> None:
    _check(random.Random(SEED).choice(GRID))


@pytest.mark.sweep
@pytest.mark.parametrize("case", GRID, ids=str)
def test_dropout_gradients_grid(case) -> None:  # type: ignore[no-untyped-def]
    _check(case)


def _qkv(seed: int, shape: ShapeTuple = (1, 40, 40, 2, 1)) -> tuple[torch.Tensor, ...]:
    inputs, _ = make_inputs(shape, 32, torch.float16, seed)
    return tuple(inputs)


def test_same_torch_seed_is_bitwise_equal_and_each_call_draws_a_new_mask() -> None:
    q, k, v = _qkv(SEED)
    torch.manual_seed(SEED)
    first = flashtune.attention(q, k, v, causal=True, dropout_p=0.3, backend="emulator")
    second = flashtune.attention(q, k, v, causal=True, dropout_p=0.3, backend="emulator")
    torch.manual_seed(SEED)
    again = flashtune.attention(q, k, v, causal=True, dropout_p=0.3, backend="emulator")
    assert torch.equal(first, again)
    assert not torch.equal(first, second)


def test_returned_mask_is_the_tests_mask() -> None:
    q, k, v = _qkv(SEED, (2, 21, 30, 2, 1))
    torch.manual_seed(SEED)
    out, lse, kept = flashtune.attention(q, k, v, dropout_p=0.25, return_lse=True,
                                         return_dropout_mask=True, backend="emulator")
    assert kept.dtype == torch.bool and kept.shape == (2, 2, 21, 30)
    assert torch.equal(kept, mask(call_seed(SEED), 0, 0.25, range(2), 2, 21, 30))
    assert out.shape == q.shape and lse.shape == (2, 2, 21)


@pytest.mark.parametrize("p", [1.0, -0.1, float("nan"), True, "0.1"])
def test_bad_dropout_p_is_refused(p: object) -> None:
    q, k, v = _qkv(SEED)
    with pytest.raises(InvalidInput, match="dropout_p"):
        flashtune.attention(q, k, v, dropout_p=p, backend="emulator")  # type: ignore[call-overload]


def test_mask_without_dropout_is_refused() -> None:
    q, k, v = _qkv(SEED)
    with pytest.raises(InvalidInput, match="return_dropout_mask"):
        flashtune.attention(q, k, v, return_dropout_mask=True, backend="emulator")


def test_sdpa_and_transformers_dropout_are_attention_dropout() -> None:
    q, k, v = _qkv(SEED)
    torch.manual_seed(SEED)
    want = flashtune.attention(q, k, v, causal=True, dropout_p=0.2, backend="emulator")
    torch.manual_seed(SEED)
    sdpa = flashtune.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(2, 1),
        v.transpose(1, 2).repeat_interleave(2, 1), dropout_p=0.2, is_causal=True,
        backend="emulator")
    assert torch.equal(sdpa.transpose(1, 2), want)
    module = torch.nn.Module()
    torch.manual_seed(SEED)
    hf, _ = make_attention_function("emulator")(
        module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, dropout=0.2,
        is_causal=True)
    assert torch.equal(hf, want)


def test_varlen_dropout_matches_float64_per_sequence() -> None:
    lengths_q, lengths_k, heads, p = [17, 0, 40], [23, 5, 40], 2, 0.3
    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(sum(lengths_q), heads, 32, generator=gen).half()
    k = torch.randn(sum(lengths_k), 1, 32, generator=gen).half()
    v = torch.randn(sum(lengths_k), 1, 32, generator=gen).half()

    def cumulative(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)

    out = torch.full_like(q, float("nan"))
    torch.manual_seed(SEED)
    out = flashtune.attention_varlen(q, k, v, cumulative(lengths_q), cumulative(lengths_k),
                                     max(lengths_q), max(lengths_k), causal=True,
                                     dropout_p=p, backend="emulator")
    seed = call_seed(SEED)
    q0 = k0 = 0
    for b, (nq, nk) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        kept = mask(seed, 0, p, range(b, b + 1), heads, nq, nk)
        ref = plain_attention(q[None, q0:q0 + nq].double(), k[None, k0:k0 + nk].double(),
                              v[None, k0:k0 + nk].double(), True, (-1, -1), None, None,
                              kept, p)[0]
        err = (out[q0:q0 + nq].double() - ref).abs().max() if nq else torch.tensor(0.0)
        assert float(err) <= 4e-3, (b, float(err))
        q0, k0 = q0 + nq, k0 + nk


@pytest.mark.parametrize(("deterministic", "modified"),
                         [random.Random(SEED).choice(list(itertools.product((False, True),
                                                                            repeat=2)))])
def test_varlen_dropout_gradients_follow_flash_attn_rule(deterministic: bool,
                                                          modified: bool) -> None:
    """attention_varlen(dropout_p=) gradients against float64 autograd per sequence with
    the tests' own mask (sequence b of the pack is the mask's batch b): GQA, causal (or the
    causal mask as a traced ``mask_mod``: ``modified``), a sequence with no queries and one
    with no keys; atomic or deterministic dQ and the causal form drawn from the run's
    seed."""
    lens_q, lens_k, p = [17, 0, 40, 6], [23, 5, 40, 0], 0.17
    seed = random.Random(f"{SEED}-varlen-{deterministic}").randrange(2**31)
    inputs, dout, cu_q, cu_k = packed_inputs(lens_q, lens_k, 4, 2, 32, torch.bfloat16, seed)
    drawn = call_seed(seed)
    ends_q, ends_k = (torch.tensor(lens) for lens in (lens_q, lens_k))

    def bottom_right(b: Any, h: Any, i: Any, j: Any) -> Any:
        """attention's causal mask of sequence b (its last row sees its last key)."""
        return j - i <= ends_k[b] - ends_q[b]

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(seed)
        out = flashtune.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                         causal=not modified, dropout_p=p,
                                         mask_mod=bottom_right if modified else None,
                                         backend="emulator", deterministic=deterministic)
        assert isinstance(out, torch.Tensor)
        return out

    def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int) -> torch.Tensor:
        kept = mask(drawn, 0, p, range(b, b + 1), q.shape[2], q.shape[1], k.shape[1])
        return plain_attention(q, k, v, True, (-1, -1), None, None, kept, p)

    plain = per_sequence(dense, cu_q, cu_k)
    got = gradients(ours, inputs, dout)
    low = gradients(plain, inputs, dout)
    exact = gradients(plain, tuple(t.double() for t in inputs), dout)
    within_rule(got, low, exact, f"varlen dropout deterministic={deterministic} seed={seed}")
