"""Dropout together with score and mask modifications: ``flashtune.attention(score_mod=,
mask_mod=, dropout_p=)`` gives O, dQ, dK, dV and a learned bias's gradient within
flash-attn's rule against float64 autograd of the same Python functions on the dense score
matrix with the tests' own dropout mask (``dropout_philox``, drawn from the seed the call
takes from torch's CPU generator); the returned mask is that mask, and SDPA's ``attn_mask``
takes ``dropout_p``. One case, drawn with the run's seed, in the default run; every case
under -m sweep (``attention_varlen`` with a ``mask_mod`` and dropout: test_api_dropout.py)."""

from __future__ import annotations

import itertools
import os
import random
from typing import Any

import pytest
import torch
from dropout_philox import call_seed, float32, mask
from flex_fixtures import grid
from grad_helpers import gradients, within_rule

import flashtune
from flashtune.api import flex_mods

pytestmark = pytest.mark.emulator

_SEED = int(os.environ["FLASHTUNE_TEST_SEED"])

#: (name, dtype, deterministic, p).
GRID = list(itertools.product(("t5-causal", "softcap-window"),
                              (torch.float16, torch.bfloat16), (False, True), (0.17, 0.4)))


def _mods(name: str, n: int, bias: torch.Tensor, *_: torch.Tensor) -> tuple[Any, Any]:
    if name == "t5-causal":
        return flex_mods.t5_relative_bias(bias, n, 64), flex_mods.causal
    return flex_mods.softcap(3.0), flex_mods.sliding_window_causal(24)


def _dense_dropped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: Any,
                   mask_mod: Any, kept: torch.Tensor, p: float) -> torch.Tensor:
    """O of flash-layout (B, N, H, D) inputs with the functions on the dense scores and P
    multiplied by ``kept`` / (1 - p), in the inputs' dtype."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    groups = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(groups, 1), vh.repeat_interleave(groups, 1)
    s = (qh @ kh.transpose(-1, -2)) * q.shape[-1] ** -0.5
    b, h, i, j = grid(*s.shape)
    s = score_mod(s, b, h, i, j).to(q.dtype)
    s = s.masked_fill(~mask_mod(b, h, i, j).expand(s.shape), float("-inf"))
    probs = torch.softmax(s, dim=-1)
    probs = probs * kept.to(probs.dtype) * (1.0 / (1.0 - float32(p)))
    return (probs @ vh).transpose(1, 2)


def _check(case: tuple[str, torch.dtype, bool, float]) -> None:
    name, dtype, deterministic, p = case
    seed = random.Random(f"{_SEED}-{case}").randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    batch, n, heads, heads_kv, dim = 1, 45, 2, 1, 32
    q = torch.randn(batch, n, heads, dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch, n, heads_kv, dim, generator=gen).to(dtype) for _ in "kv")
    dout = torch.randn(batch, n, heads, dim, generator=gen).to(dtype)
    bias = torch.randn(heads, 32, generator=gen)
    kept = mask(call_seed(seed), 0, p, range(batch), heads, n, n)

    learned = (bias,) if name == "t5-causal" else ()  # the softcap case reads no bias

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *t: torch.Tensor
             ) -> torch.Tensor:
        score_mod, mask_mod = _mods(name, n, *t, bias)
        torch.manual_seed(seed)
        out = flashtune.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                  dropout_p=p, backend="emulator", deterministic=deterministic)
        assert isinstance(out, torch.Tensor)
        return out

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *t: torch.Tensor
              ) -> torch.Tensor:
        return _dense_dropped(q, k, v, *_mods(name, n, *t, bias), kept, p)

    names = ("dq", "dk", "dv", *("dbias" for _ in learned))
    got = gradients(ours, (q, k, v, *learned), dout, names)
    low = gradients(plain, (q, k, v, *(t.to(dtype) for t in learned)), dout, names)
    exact = gradients(plain, (q.double(), k.double(), v.double(),
                              *(t.double() for t in learned)), dout, names)
    within_rule(got, low, exact, f"{case} seed={seed}")


@pytest.mark.usefixtures("dispatcher")
def test_dropout_with_modifications_within_the_rule() -> None:
    _check(random.Random(_SEED).choice(GRID))


@pytest.mark.sweep
@pytest.mark.usefixtures("dispatcher")
@pytest.mark.parametrize("case", GRID, ids=str)
def test_dropout_with_modifications_grid(case: tuple[str, torch.dtype, bool, float]) -> None:
    _check(case)


def test_returned_mask_with_a_mask_mod_is_the_tests_mask() -> None:
    gen = torch.Generator().manual_seed(_SEED)
    q, k, v = (torch.randn(1, 37, 2, 32, generator=gen).half() for _ in "qkv")
    torch.manual_seed(_SEED)
    out, kept = flashtune.attention(q, k, v, mask_mod=flex_mods.causal, dropout_p=0.25,
                                    return_dropout_mask=True, backend="emulator")
    assert torch.equal(kept, mask(call_seed(_SEED), 0, 0.25, range(1), 2, 37, 37))
    want = _dense_dropped(q.double(), k.double(), v.double(), lambda s, *_: s,
                          flex_mods.causal, kept, 0.25)
    assert float((out.double() - want).abs().max()) < 4e-3


def test_sdpa_attn_mask_with_dropout_is_attention_with_the_mask() -> None:
    gen = torch.Generator().manual_seed(_SEED)
    q, k, v = (torch.randn(1, 2, 33, 32, generator=gen).half() for _ in "qkv")
    allowed = torch.rand(33, 33, generator=gen) < 0.7
    torch.manual_seed(_SEED)
    out = flashtune.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=0.3,
                                                 backend="emulator")
    kept = mask(call_seed(_SEED), 0, 0.3, range(1), 2, 33, 33)
    qd, kd, vd = (t.transpose(1, 2).double() for t in (q, k, v))
    want = _dense_dropped(qd, kd, vd, lambda s, *_: s, lambda b, h, i, j: allowed[i, j],
                          kept, 0.3)
    assert float((out.transpose(1, 2).double() - want).abs().max()) < 4e-3
