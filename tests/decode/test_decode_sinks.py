"""Decoding with attention sinks (``attention_with_kvcache(..., sinks=)``) on the emulator
against float64: the split kernel's partial results leave the sink out and the combine
joins it where the final O and LSE are written, so every split count, paged and unpaged
caches, GQA packing and appended rows must give the attention with the sink in each row's
denominator. The reference is the decoding reference without sinks with the sink joined
in float64 (O' = O exp(LSE - LSE'), LSE' = log(exp(LSE) + exp(sink))); a seeded sample in
the default run, the grid behind the sweep marker."""

from __future__ import annotations

import itertools
import os
import random
from typing import Any

import pytest
import torch
from decode_cases import call_api
from test_decode_features import FeatureCase, inputs_of

from flashtune.codegen.spec import DType
from flashtune.families.base import close_enough
from flashtune.families.checks import LSE_TOLERANCE, O_TOLERANCE
from flashtune.families.decode.reference import (
    attention_with_kvcache_reference,
    expected_caches,
)
from flashtune.families.fwd.variants import VariantValues

pytestmark = pytest.mark.emulator

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])

#: (window, softcap, slopes, causal, page size, heads, seqlen_q, append, splits)
GRID = list(itertools.product(
    (((-1, -1), None, ""), ((16, 0), None, ""), ((-1, -1), 30.0, "h"), ((5, 3), 5.0, "bh")),
    (False, True), (None, 1, 16), ((2, 2), (8, 2)), (1, 3), (False, True), (1, 3)))


def join_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 O (B, Nq, Hq, D) and LSE (B, Hq, Nq) of attention without sinks (+inf: no
    key) turned into those with each head's sink in the denominator."""
    lse = lse.masked_fill(torch.isposinf(lse), float("-inf"))
    joined = torch.logaddexp(lse, sinks.double()[None, :, None])
    return o * torch.exp(lse - joined).transpose(1, 2)[..., None], joined


def _check(params: tuple[Any, ...]) -> None:
    (window, softcap, slopes), causal, page, heads, nq, append, splits = params
    case = FeatureCase(None if window == (-1, -1) else window, softcap, slopes, page, heads,
                       nq, append, splits, seed=GRID.index(params))
    inputs = inputs_of(case)
    t = inputs.tensors
    gen = torch.Generator().manual_seed(SEED + case.seed)
    sinks = torch.randn(heads[0], generator=gen) * 3 + 1
    kwargs: dict[str, Any] = {"window_size": window, "softcap": softcap}
    if slopes:
        kwargs["alibi_slopes"] = t["alibi_slopes"]
    out, lse = call_api(inputs, causal=causal, return_lse=True, backend="emulator",
                        num_splits=splits, sinks=sinks, **kwargs)
    values = VariantValues((window[0], 0) if causal and window != (-1, -1) else window,
                           softcap or 0.0, t.get("alibi_slopes"))
    ref_o, ref_lse = attention_with_kvcache_reference(
        inputs, causal and window == (-1, -1), values)
    ref_o, ref_lse = join_sinks(ref_o, ref_lse, sinks)
    for name, got, want, tol in (("O", out, ref_o, O_TOLERANCE[DType.FP16]),
                                 ("LSE", lse, ref_lse, LSE_TOLERANCE)):
        _, _, wrong = close_enough(name, got, want, tol)
        assert not wrong, f"{case.key} causal={causal} seed {SEED}: {wrong}"
    for name, want in expected_caches(inputs).items():
        got = t[name]
        assert ((got == want) | (torch.isnan(got) & torch.isnan(want))).all(), name


def _id(params: tuple[Any, ...]) -> str:
    (window, softcap, slopes), causal, page, heads, nq, append, splits = params
    return "-".join(str(p) for p in (
        f"w{window[0]}_{window[1]}", f"cap{softcap}", slopes or "noalibi",
        "causal" if causal else "full", f"page{page}", f"h{heads[0]}x{heads[1]}", f"q{nq}",
        "append" if append else "noappend", f"s{splits}"))


@pytest.mark.parametrize("params", random.Random(f"sinks-{SEED}").sample(GRID, 1), ids=_id)
def test_decoding_with_sinks_matches_float64(params: tuple[Any, ...]) -> None:
    _check(params)


@pytest.mark.sweep
@pytest.mark.parametrize("params", GRID, ids=_id)
def test_decoding_with_sinks_whole_grid(params: tuple[Any, ...]) -> None:
    _check(params)


def test_the_sink_changes_the_answer() -> None:
    """The reference with sinks is not the one without (the check above can fail), and a
    row with no key gets LSE = sink."""
    o = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    lse = torch.tensor([[[0.5, float("inf")], [2.0, 1.0], [-1.0, 0.0]]], dtype=torch.float64)
    sinks = torch.tensor([1.0, -2.0, 3.0])
    joined_o, joined = join_sinks(o, lse, sinks)
    assert joined[0, 0, 1] == 1.0 and (joined_o[0, 1, 0] == 0).all()
    assert float((joined_o - o).abs().max()) > 0.1
