"""``flashtune.attention_varlen`` on the emulator: packed sequences of many short and a few
long lengths (zero-length ones included) against the float64 reference per sequence, with
causal masks, windows, softcap, ALiBi and GQA; the validation of the cumulative lengths; and
the gradients (flash-attn's rule against float64 autograd per sequence)."""

from __future__ import annotations

import itertools
import os
import random
from typing import Any

import pytest
import torch
from grad_helpers import feature_attention, gradients, packed_inputs, per_sequence, within_rule
from runtime_helpers import check_varlen_outputs

import flashtune
from flashtune.api.validate_varlen import check_varlen_inputs
from flashtune.errors import InvalidInput
from flashtune.families.fwd.reference import varlen_reference
from flashtune.families.fwd.variants import SOFTCAPS, WINDOW_SIZES

_RNG = random.Random(int(os.environ["FLASHTUNE_TEST_SEED"]))
TOL = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def _packed(lens_q: list[int], lens_k: list[int], heads_q: int, heads_kv: int, dim: int,
            dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), heads_q, dim, generator=gen).to(dtype)
    k = torch.randn(sum(lens_k), heads_kv, dim, generator=gen).to(dtype)
    v = torch.randn(sum(lens_k), heads_kv, dim, generator=gen).to(dtype)
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def _lengths(rng: random.Random, count: int, longest: int) -> list[int]:
    """Many short (zero-length included), a few long, one of exactly ``longest``."""
    out = [rng.randrange(0, 9) if rng.random() < 0.75 else rng.randrange(longest // 2, longest)
           for _ in range(count - 1)]
    out.insert(rng.randrange(count), longest)
    return out


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher", "poisoned_outputs")
@pytest.mark.parametrize(("dtype", "causal"), [(torch.float16, True), (torch.bfloat16, False)])
def test_varlen_matches_the_reference_per_sequence(dtype: torch.dtype, causal: bool) -> None:
    seed = _RNG.randrange(2**31)
    rng = random.Random(seed)
    lens_q = _lengths(rng, 10, 150)
    lens_k = lens_q if causal else _lengths(rng, 10, 120)
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 4, 2, 64, dtype, seed)
    out, lse = flashtune.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                          causal=causal, return_lse=True, backend="emulator")
    ref_o, ref_lse = varlen_reference(q, k, v, cu_q, cu_k, causal, 64 ** -0.5)
    where = f"seed={seed} lens_q={lens_q} lens_k={lens_k}"
    assert out.shape == q.shape and lse.shape == (4, q.shape[0]), where
    check_varlen_outputs(out, lse, ref_o, ref_lse, TOL[dtype] * 4, where)


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher", "poisoned_outputs")
def test_varlen_combines_with_window_softcap_alibi_and_gqa() -> None:
    seed = _RNG.randrange(2**31)
    rng = random.Random(seed)
    window = rng.choice([p for p in itertools.product(WINDOW_SIZES, WINDOW_SIZES)
                         if p != (-1, -1)])
    cap = rng.choice(SOFTCAPS)
    lens = _lengths(rng, 6, 130)
    q, k, v, cu_q, cu_k = _packed(lens, lens, 4, 1, 32, torch.float16, seed)
    slopes = torch.rand(6, 4, generator=torch.Generator().manual_seed(seed))
    out = flashtune.attention_varlen(q, k, v, cu_q, cu_k, max(lens), max(lens),
                                     window_size=window, softcap=cap, alibi_slopes=slopes,
                                     backend="emulator")
    ref_o, _ = varlen_reference(q, k, v, cu_q, cu_k, False, 32 ** -0.5, window=window,
                                softcap=cap, alibi_slopes=slopes)
    err = float((out.double() - ref_o).abs().max())
    assert err <= 4 * TOL[torch.float16], f"seed={seed} window={window} cap={cap}: {err}"


def _call(**overrides: object) -> None:
    q, k, v, cu_q, cu_k = _packed([5, 0, 7], [3, 4, 0], 2, 2, 32, torch.float16, 0)
    args: dict[str, object] = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
                               "max_seqlen_q": 7, "max_seqlen_k": 4, "q": q, "k": k, "v": v}
    args.update(overrides)
    flashtune.attention_varlen(backend="emulator", **args)  # type: ignore[call-overload]


_I32 = torch.int32


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"cu_seqlens_q": torch.tensor([1, 5, 5, 12], dtype=_I32)}, "starts at 1; expected 0"),
    ({"cu_seqlens_q": torch.tensor([0, 6, 5, 12], dtype=_I32)}, "is not monotone"),
    ({"cu_seqlens_q": torch.tensor([0, 5, 5, 11], dtype=_I32)}, "ends at 11 but the packed"),
    ({"cu_seqlens_k": torch.tensor([0, 3, 7, 8], dtype=_I32)}, "ends at 8 but the packed"),
    ({"cu_seqlens_q": torch.tensor([0, 5, 5, 12])}, "expected torch.int32"),
    ({"cu_seqlens_q": torch.tensor([[0, 5, 5, 12]], dtype=_I32)}, "expected (batch + 1,)"),
    ({"cu_seqlens_k": torch.tensor([0, 3, 7], dtype=_I32)}, "has 4 entries but cu_seqlens_k 3"),
    ({"cu_seqlens_q": torch.tensor([0, 5, 5, 12], dtype=_I32, device="meta")},
     "cu_seqlens_q.to(q.device)"),
    ({"cu_seqlens_q": [0, 5, 5, 12]}, "must be a torch.Tensor"),
    ({"max_seqlen_q": 6}, "max_seqlen_q=6 but sequence 2"),
    ({"max_seqlen_k": 7.0}, "must be an int"),
    ({"q": torch.zeros(1, 12, 2, 32, dtype=torch.float16)}, "expected 3 dims"),
    ({"alibi_slopes": torch.ones(2, 2)}, "expected (2,) (one slope per query head) or (3, 2)"),
    ({"window_size": (-5, 0)}, "below -1"),
])
def test_bad_varlen_inputs_are_refused_with_the_fix(overrides: dict[str, object],
                                                    needle: str) -> None:
    with pytest.raises(InvalidInput) as info:
        _call(**overrides)
    assert needle in str(info.value)


def test_lengths_are_not_read_off_the_cpu() -> None:
    """Only metadata is checked for tensors that are not on the CPU (on CUDA, reading the
    values would synchronise): meta tensors, whose values cannot be read, pass."""
    q, k, v, cu_q, cu_k = (t.to("meta") for t in _packed([5, 7], [3, 4], 2, 2, 32,
                                                         torch.float16, 0))
    bad = torch.tensor([3, 1, 99], dtype=torch.int32, device="meta")
    assert check_varlen_inputs(q, k, v, bad, cu_k, 7, 4)[2:] == (7, 4)


#: (dtype, causal, window, softcap, deterministic, (lens_q, lens_k, heads_q, heads_kv)):
#: zero-length sequences (no queries; no keys), Nq != Nk per sequence, GQA.
GRAD_CASES = [
    (torch.float16, True, (-1, -1), None, None, ([20, 0, 45, 7], [50, 17, 30, 7], 4, 2)),
    (torch.bfloat16, False, (16, 4), 30.0, True, ([33, 12, 0, 70], [0, 40, 9, 64], 3, 1)),
]


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher")
@pytest.mark.parametrize("case", [
    case if i == random.Random(os.environ["FLASHTUNE_TEST_SEED"]).randrange(len(GRAD_CASES))
    else pytest.param(case, marks=pytest.mark.sweep) for i, case in enumerate(GRAD_CASES)],
    ids=["causal-fp16", "window-softcap-det-bf16"])
def test_varlen_gradients_follow_flash_attns_rule(case: tuple[Any, ...]) -> None:
    """dQ, dK, dV of attention_varlen against float64 autograd per sequence, each error at
    most 3x that of the same attention in plain PyTorch in the input dtype; keys of a
    sequence with no queries get exactly zero gradients (one case drawn from the run's
    seed, both under ``-m sweep``)."""
    dtype, causal, window, softcap, deterministic, (lens_q, lens_k, hq, hkv) = case
    seed = _RNG.randrange(2**31)
    inputs, dout, cu_q, cu_k = packed_inputs(lens_q, lens_k, hq, hkv, 32, dtype, seed)

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = flashtune.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                         causal=causal, window_size=window, softcap=softcap,
                                         deterministic=deterministic, backend="emulator")
        assert isinstance(out, torch.Tensor)
        return out

    def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int) -> torch.Tensor:
        return feature_attention(q, k, v, causal, window, softcap, None)

    plain = per_sequence(dense, cu_q, cu_k)
    got = gradients(ours, inputs, dout)
    low = gradients(plain, inputs, dout)
    exact = gradients(plain, tuple(t.double() for t in inputs), dout)
    within_rule(got, low, exact, f"{case} seed={seed}")
    start = sum(lens_k[:lens_q.index(0)]) if 0 in lens_q else None
    if start is not None:  # the keys of the sequence with no queries
        end = start + lens_k[lens_q.index(0)]
        assert not got["dk"][start:end].any() and not got["dv"][start:end].any()
