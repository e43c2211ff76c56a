"""Gradients through score and mask modifications on the emulator: flashtune.flex_attention
(with a block mask), attention(score_mod=, mask_mod=) and the SDPA drop-in's float
attn_mask that requires grad give O, dQ, dK, dV and the captured tensors' gradients (the
T5 bias's and ALiBi slopes' included) within flash-attn's rule (at most 3x the error of the
same Python functions applied to the dense score matrix in plain PyTorch in the input
dtype, against float64 autograd); deterministic gradients (captured ones included) are
bitwise equal over shuffled block orders; an operation without a derivative is refused
before anything runs. One case, drawn with the run's seed, in the default run; every case
under -m sweep."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from flex_fixtures import (
    Fn,
    dense,
    docs_of,
    random_flashmask,
)
from grad_helpers import Grads, gradients, packed_inputs, per_sequence, within_rule

import flashtune
from flashtune.api import flex_mods
from flashtune.codegen.trace_grad import NotDifferentiable

pytestmark = pytest.mark.emulator

_SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
#: (learned tensors, score_mod made from them, mask_mod) of a case, from (heads, length, gen).
Case = Callable[[int, int, torch.Generator],
                tuple[list[torch.Tensor], Callable[..., Fn], Fn]]


def _none(*learned: torch.Tensor) -> Fn:
    return None


CASES: dict[str, Case] = {
    "t5-causal": lambda h, n, g: ([torch.randn(h, 32, generator=g)],
                                  lambda bias: flex_mods.t5_relative_bias(bias, n, 64),
                                  flex_mods.causal),
    "t5-only": lambda h, n, g: ([torch.randn(h, 32, generator=g)],
                                lambda bias: flex_mods.t5_relative_bias(bias, n, 64), None),
    "alibi-sliding-window": lambda h, n, g: ([torch.rand(h, generator=g)], flex_mods.alibi,
                                             flex_mods.sliding_window_causal(40)),
    "softcap-document": lambda h, n, g: ([], lambda: flex_mods.softcap(2.0),
                                         flex_mods.document(docs_of(n, g))),
    "prefix-lm": lambda h, n, g: ([], _none, flex_mods.prefix_lm(torch.tensor([17, 90]))),
    "flashmask-causal": lambda h, n, g: ([], _none, random_flashmask(h, n, g, True)),
    "flashmask-bidirectional": lambda h, n, g: ([], lambda: flex_mods.softcap(4.0),
                                                random_flashmask(h, n, g, False)),
    "global-tokens": lambda h, n, g: ([], _none, flex_mods.global_tokens(5, 20)),
    # A learned per-head temperature: its gradient reads the score itself.
    "temperature-causal": lambda h, n, g: ([torch.rand(h, generator=g) + 0.5],
                                           lambda t: lambda s, b, hh, q, k: s * t[hh],
                                           flex_mods.causal),
}
_SAMPLED = random.Random(f"{_SEED}-grad").choice([*sorted(CASES), "sdpa-float"])


def _flex_case(name: str, dtype: torch.dtype, seed: int, deterministic: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, heads, heads_kv, n, dim = 2, 4, 2, 120, 64
    learned, make, mask_mod = CASES[name](heads, n, gen)
    q = torch.randn(batch, heads, n, dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch, heads_kv, n, dim, generator=gen).to(dtype) for _ in "kv")
    dout = torch.randn(batch, heads, n, dim, generator=gen).to(dtype)
    # Per head (FlashMask's columns vary with it): the backward's tile ranges then differ
    # between the query heads of a kv head.
    block_mask = (None if mask_mod is None
                  else flashtune.create_block_mask(mask_mod, None, heads, n, n))
    names = ("dq", "dk", "dv", *(f"learned{i}" for i in range(len(learned))))

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *t: torch.Tensor
             ) -> torch.Tensor:
        out = flashtune.flex_attention(q, k, v, make(*t), block_mask, enable_gqa=True,
                                       backend="emulator", deterministic=deterministic)
        assert isinstance(out, torch.Tensor)
        return out

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *t: torch.Tensor
              ) -> torch.Tensor:
        return dense(q, k, v, dim ** -0.5, make(*t), mask_mod, q.dtype)[0]

    inputs = (q, k, v, *learned)
    got = gradients(ours, inputs, dout, names)
    low = gradients(plain, (q, k, v, *(t.to(dtype) for t in learned)), dout, names)
    exact = gradients(plain, tuple(t.double() for t in inputs), dout, names)
    within_rule(got, low, exact, f"{name} {dtype} deterministic={deterministic} seed={seed}")


def _sdpa_case(seed: int) -> None:
    """A float attn_mask per head and position (some -inf), requiring grad, through the
    SDPA drop-in: its gradient is the gradient by the scores, summed over the batch."""
    gen = torch.Generator().manual_seed(seed)
    batch, heads, nq, nk, dim = 2, 2, 70, 90, 64
    q = torch.randn(batch, heads, nq, dim, generator=gen).half()
    k, v = (torch.randn(batch, heads, nk, dim, generator=gen).half() for _ in "kv")
    mask = torch.randn(heads, nq, nk, generator=gen) * 2
    mask[:, :, ::7] = float("-inf")
    dout = torch.randn(batch, heads, nq, dim, generator=gen).half()
    names = ("dq", "dk", "dv", "dmask")

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor
             ) -> torch.Tensor:
        return flashtune.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                      backend="emulator")

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor
              ) -> torch.Tensor:
        def bias(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
            return s + m.expand(batch, heads, nq, nk)[b, h, i, j]
        return dense(q, k, v, dim ** -0.5, bias, None, q.dtype)[0]

    got = gradients(ours, (q, k, v, mask), dout, names)
    low = gradients(plain, (q, k, v, mask.half()), dout, names)
    exact = gradients(plain, (q.double(), k.double(), v.double(), mask.double()), dout, names)
    # -inf entries have gradient 0 everywhere.
    assert (got["dmask"][:, :, ::7] == 0).all()
    within_rule(got, low, exact, f"sdpa float attn_mask seed={seed}")


@pytest.mark.usefixtures("dispatcher")
def test_a_sampled_modifications_gradients_within_the_rule() -> None:
    seed = random.Random(f"{_SEED}-{_SAMPLED}-grad").randrange(2**31)
    if _SAMPLED == "sdpa-float":
        _sdpa_case(seed)
    else:
        _flex_case(_SAMPLED, torch.float16, seed, random.Random(seed).random() < 0.5)


@pytest.mark.sweep
@pytest.mark.usefixtures("dispatcher")
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_modifications_gradients_within_the_rule(name: str, dtype: torch.dtype,
                                                       deterministic: bool) -> None:
    _flex_case(name, dtype, random.Random(f"{_SEED}-{name}-{dtype}").randrange(2**31),
               deterministic)


@pytest.mark.sweep
@pytest.mark.usefixtures("dispatcher")
def test_a_float_attn_mask_requiring_grad() -> None:
    _sdpa_case(random.Random(f"{_SEED}-sdpa-grad").randrange(2**31))


def _attention_grads(backend: str, seed: int) -> Grads:
    """attention(score_mod=, mask_mod=) in flash-attn's layout, deterministic, with a
    learned T5 bias and document masking (no block mask: the mask on every tile)."""
    gen = torch.Generator().manual_seed(seed)
    batch, heads, n, dim = 1, 2, 100, 32
    bias = torch.randn(heads, 32, generator=gen)
    docs = docs_of(n, gen)
    q, k, v, dout = (torch.randn(batch, n, heads, dim, generator=gen).half() for _ in "qkvo")

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor
           ) -> torch.Tensor:
        out = flashtune.attention(q, k, v, backend=backend, deterministic=True,
                                  score_mod=flex_mods.t5_relative_bias(b, n, 64),
                                  mask_mod=flex_mods.document(docs))
        assert isinstance(out, torch.Tensor)
        return out

    return gradients(fn, (q, k, v, bias), dout, ("dq", "dk", "dv", "dbias"))


@pytest.mark.usefixtures("dispatcher")
def test_deterministic_gradients_are_bitwise_equal_over_block_orders(
        shuffled: list[str]) -> None:
    runs = [_attention_grads(name, _SEED) for name in ["emulator", *shuffled[:2]]]
    for other in runs[1:]:
        for name in ("dq", "dk", "dv", "dbias"):
            assert torch.equal(other[name], runs[0][name]), name
    assert runs[0]["dbias"].abs().sum() > 0


@pytest.mark.usefixtures("dispatcher")
def test_an_operation_without_a_derivative_is_refused_before_running() -> None:
    q = torch.randn(1, 1, 16, 32, dtype=torch.float16, requires_grad=True)

    def stepped(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        return s + s // 2.0

    with pytest.raises(NotDifferentiable, match=r"floor division \(//\) at .*test_api_flex_grad"):
        flashtune.flex_attention(q, q.detach(), q.detach(), stepped, backend="emulator")
    with torch.no_grad():  # the forward serves it
        flashtune.flex_attention(q, q, q, stepped, backend="emulator")


@pytest.mark.usefixtures("dispatcher", "poisoned_outputs")
@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
def test_varlen_gradients_through_a_modification(deterministic: bool) -> None:
    """attention_varlen with a score_mod and a mask_mod gives dQ, dK, dV and the gradient of
    the learned slopes the score_mod captures within flash-attn's rule against float64
    autograd of the same functions applied per sequence (b its index, q_idx and kv_idx
    positions within it), over a pack with an empty-query and an empty-key sequence, GQA
    4:2; deterministic: twice the same bits."""
    seed = _SEED + 11 + deterministic
    gen = torch.Generator().manual_seed(seed)
    lens_q, lens_k, heads, heads_kv, dim = [33, 0, 70, 9], [50, 7, 70, 0], 4, 2, 64
    (q, k, v), dout, cu_q, cu_k = packed_inputs(lens_q, lens_k, heads, heads_kv, dim,
                                                torch.float16, seed)
    slopes = torch.rand(heads, generator=gen)

    def score_mod_of(learned: torch.Tensor) -> Callable[..., Any]:
        def score_mod(s: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return s - learned[h] * torch.abs(q_idx - kv_idx) / 8 + 0.25 * b
        return score_mod

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx <= q_idx + 3 * b

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, learned: torch.Tensor
             ) -> torch.Tensor:
        out = flashtune.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                         score_mod=score_mod_of(learned), mask_mod=mask_mod,
                                         deterministic=deterministic, backend="emulator")
        assert isinstance(out, torch.Tensor)
        return out

    def plain(dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        def packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, learned: torch.Tensor
                   ) -> torch.Tensor:
            def attend(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, b: int
                       ) -> torch.Tensor:
                def at_b(s: Any, _: Any, h: Any, i: Any, j: Any) -> Any:
                    return score_mod_of(learned)(s, b, h, i, j)

                def mask_b(_: Any, h: Any, i: Any, j: Any) -> Any:
                    return mask_mod(b, h, i, j)
                qt, kt, vt = (t.transpose(1, 2) for t in (qb, kb, vb))
                return dense(qt, kt, vt, dim ** -0.5, at_b, mask_b, dtype)[0].transpose(1, 2)
            return per_sequence(attend, cu_q, cu_k)(q, k, v)
        return packed

    names = ("dq", "dk", "dv", "dslopes")
    got = gradients(ours, (q, k, v, slopes), dout, names)
    low = gradients(plain(torch.float16), (q, k, v, slopes), dout, names)
    exact = gradients(plain(torch.float64), (q.double(), k.double(), v.double(),
                                             slopes.double()), dout, names)
    within_rule(got, low, exact, f"varlen modified seed={seed}")
    if deterministic:
        again = gradients(ours, (q, k, v, slopes), dout, names)
        for name in names:
            assert torch.equal(again[name], got[name]), name
