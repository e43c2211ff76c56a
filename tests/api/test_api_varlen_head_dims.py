"""attention_varlen with V's head dim other than Q/K's (DeepSeek's 192 / 128) and with Q/K
head dims 512 and 576 (V up to theirs, above 256 in column chunks): O, dQ, dK and dV of
packed sequences (one with no queries, one with no keys) within flash-attn's rule against
float64 autograd per sequence, on the emulator, GQA, causal, with a window and softcap drawn
from the run's seed (the pair too; every pair under -m sweep)."""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch
from grad_helpers import feature_attention, gradients, per_sequence, within_rule

import flashtune

pytestmark = pytest.mark.emulator

_SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
PAIRS = [(192, 128), (512, 512), (576, 512), (512, 256)]


def _check(dq: int, dv: int, seed: int) -> None:
    rng = random.Random(seed)
    window, softcap = rng.choice([((-1, -1), None), ((9, 0), 20.0)])
    lens_q, lens_k = [13, 0, 29, 5], [17, 4, 29, 0]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), 2, dq, generator=gen).bfloat16()
    k = torch.randn(sum(lens_k), 1, dq, generator=gen).bfloat16()
    v = torch.randn(sum(lens_k), 1, dv, generator=gen).bfloat16()
    dout = torch.randn(sum(lens_q), 2, dv, generator=gen).bfloat16()
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32)
                  for n in (lens_q, lens_k))

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = flashtune.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                         causal=True, window_size=window, softcap=softcap,
                                         backend="emulator")
        assert isinstance(out, torch.Tensor) and out.shape == (sum(lens_q), 2, dv)
        return out

    def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int) -> torch.Tensor:
        return feature_attention(q, k, v, True, window, softcap, None)

    plain = per_sequence(dense, cu_q, cu_k)
    got = gradients(ours, (q, k, v), dout)
    low = gradients(plain, (q, k, v), dout)
    exact = gradients(plain, (q.double(), k.double(), v.double()), dout)
    within_rule(got, low, exact, f"{dq}/{dv} window={window} softcap={softcap} seed={seed}")


def test_a_drawn_pair_within_the_rule() -> None:
    """192 / 128 or 512 / 256 (one launch each way; the column-chunked pairs are slower to
    emulate: the sweep has them)."""
    rng = random.Random(f"{_SEED}-varlen-dims")
    _check(*rng.choice([PAIRS[0], PAIRS[3]]), rng.randrange(2**31))


@pytest.mark.sweep
@pytest.mark.parametrize("dq, dv", PAIRS)
def test_every_pair_within_the_rule(dq: int, dv: int) -> None:
    _check(dq, dv, random.Random(f"{_SEED}-{dq}-{dv}").randrange(2**31))
