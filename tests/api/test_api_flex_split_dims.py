"""Score and mask modifications with V's head dim other than Q/K's (DeepSeek's prefill:
192 / 128): ``flashtune.attention(score_mod=, mask_mod=)`` gives O, dQ, dK, dV and a learned
T5 bias's gradient within flash-attn's rule against float64 autograd of the same Python
functions on the dense score matrix (the emulator; fresh seeded inputs; the pair and the
dtype drawn from the run's seed)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from flex_fixtures import dense
from grad_helpers import gradients, within_rule

import flashtune
from flashtune.api import flex_mods

pytestmark = pytest.mark.emulator

_SEED = int(os.environ["FLASHTUNE_TEST_SEED"])


@pytest.mark.usefixtures("dispatcher")
def test_a_learned_bias_with_split_head_dims_within_the_rule() -> None:
    rng = random.Random(f"{_SEED}-flex-split")
    (dq, dv), dtype = rng.choice([(192, 128), (64, 96)]), rng.choice([torch.float16,
                                                                      torch.bfloat16])
    seed = rng.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    n, heads = 41, 2
    q = torch.randn(1, n, heads, dq, generator=gen).to(dtype)
    k = torch.randn(1, n, 1, dq, generator=gen).to(dtype)
    v = torch.randn(1, n, 1, dv, generator=gen).to(dtype)
    dout = torch.randn(1, n, heads, dv, generator=gen).to(dtype)
    bias = torch.randn(heads, 32, generator=gen)

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: torch.Tensor
             ) -> torch.Tensor:
        out = flashtune.attention(q, k, v, score_mod=flex_mods.t5_relative_bias(t, n, 64),
                                  mask_mod=flex_mods.causal, backend="emulator")
        assert isinstance(out, torch.Tensor) and out.shape == (1, n, heads, dv)
        return out

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: torch.Tensor
              ) -> torch.Tensor:
        qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
        return dense(qh, kh, vh, dq ** -0.5, flex_mods.t5_relative_bias(t, n, 64),
                     flex_mods.causal, q.dtype)[0].transpose(1, 2)

    names = ("dq", "dk", "dv", "dbias")
    got = gradients(ours, (q, k, v, bias), dout, names)
    low = gradients(plain, (q, k, v, bias.to(dtype)), dout, names)
    exact = gradients(plain, (q.double(), k.double(), v.double(), bias.double()), dout, names)
    within_rule(got, low, exact, f"{dq}/{dv} {dtype} seed={seed}")
