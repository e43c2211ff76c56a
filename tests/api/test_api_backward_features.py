"""Gradients through ``flashtune.attention`` with sliding windows, softcaps and ALiBi (and
their combinations with causal masks and GQA), run by the CPU emulator and held to
flash-attn's rule: each gradient's largest error against a float64 autograd reference is at
most 3x that of the same attention in plain PyTorch in the input dtype. The default run
draws one case from the run's seed; ``-m sweep`` runs them all, deterministic and not.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch
from grad_helpers import ShapeTuple, feature_attention, gradients, make_inputs, within_rule

import flashtune

pytestmark = pytest.mark.emulator

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])

#: (causal, window_size, softcap, alibi): each feature, with causal, and together.
FEATURES = [(False, (16, 0), None, False), (False, (8, 20), None, False),
            (True, (-1, -1), 30.0, False), (False, (-1, -1), 5.0, False),
            (False, (-1, -1), None, True), (True, (-1, -1), None, True),
            (False, (24, 4), 50.0, True)]
SHAPES: tuple[ShapeTuple, ...] = ((1, 77, 90, 2, 1), (2, 40, 40, 2, 2), (1, 90, 33, 3, 1))
GRID = list(itertools.product(FEATURES, (torch.float16, torch.bfloat16), SHAPES,
                              (False, True)))
# ((causal, window, softcap, alibi), dtype, shape, deterministic)
Case = tuple[tuple[bool, tuple[int, int], float | None, bool], torch.dtype, ShapeTuple, bool]


def _check(case: Case) -> None:
    (causal, window, softcap, alibi), dtype, shape, deterministic = case
    seed = random.Random(f"{SEED}-{case}").randrange(2**31)
    inputs, dout = make_inputs(shape, 32, dtype, seed)
    gen = torch.Generator().manual_seed(seed)
    slopes = torch.rand(shape[0], shape[3], generator=gen) if alibi else None

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = flashtune.attention(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                  alibi_slopes=slopes, backend="emulator",
                                  deterministic=deterministic)
        assert isinstance(out, torch.Tensor)
        return out

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return feature_attention(q, k, v, causal, window, softcap, slopes)

    got = gradients(ours, inputs, dout)
    low = gradients(plain, inputs, dout)
    exact = gradients(plain, tuple(t.double() for t in inputs), dout)
    within_rule(got, low, exact, f"{case} seed={seed}")


def _id(case: Case) -> str:
    (causal, window, softcap, alibi), dtype, shape, deterministic = case
    parts = ["causal" if causal else "", f"w{window[0]}_{window[1]}" if window != (-1, -1)
             else "", f"cap{softcap:g}" if softcap else "", "alibi" if alibi else "",
             str(dtype)[6:], "x".join(map(str, shape)), "det" if deterministic else ""]
    return "-".join(p for p in parts if p)


@pytest.mark.usefixtures("dispatcher")
@pytest.mark.parametrize("case", random.Random(SEED).sample(GRID, 1), ids=_id)
def test_feature_gradients_within_3x_of_plain_pytorch(case: Case) -> None:
    _check(case)


@pytest.mark.sweep
@pytest.mark.usefixtures("dispatcher")
@pytest.mark.parametrize("case", GRID, ids=_id)
def test_feature_gradient_grid_within_3x_of_plain_pytorch(case) -> None:  # type: ignore[no-untyped-def]
    _check(case)
