"""The attention features through the public API (``window_size``, ``softcap``,
``alibi_slopes``): numerics on the emulator against the float64 reference, normalisation of
windows to the cheapest mask, clear errors for bad values, and refusal (FeatureNotSupported)
by the operations whose kernel families do not implement them (backward, decoding)."""

from __future__ import annotations

import dataclasses
import math
import os
import random

import pytest
import torch
from runtime_helpers import qkv
from sampling import seeded_part

import flashtune
from flashtune import families
from flashtune.api import ops
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import FEATURES, DType, Problem
from flashtune.errors import FeatureNotSupported, InvalidInput
from flashtune.families.fwd.reference import attention_reference
from flashtune.families.fwd.variants import SOFTCAPS, WINDOW_SIZES

_RNG = random.Random(int(os.environ["FLASHTUNE_TEST_SEED"]))
TOL = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def _check(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, causal: bool, where: str, **features: object) -> None:
    ref_o, ref_lse = attention_reference(q, k, v, causal, q.shape[-1] ** -0.5,
                                         **features)  # type: ignore[arg-type]
    assert not out.isnan().any() and not lse.isnan().any(), where
    err = float((out.double() - ref_o).abs().max())
    assert err <= TOL[q.dtype] * max(1.0, float(v.abs().max())), f"{where}: max |err| {err}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), where
    if finite.any():
        assert float((lse[finite].double() - ref_lse[finite]).abs().max()) < 2e-3, where


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher", "poisoned_outputs")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_features_through_the_api_match_the_reference(dtype: torch.dtype) -> None:
    """A seeded window, cap and ALiBi slopes, with causal and GQA, on both dtypes."""
    seed = _RNG.randrange(2**31)
    rng = random.Random(seed)
    window = rng.choice([p for p in ((a, b) for a in WINDOW_SIZES for b in WINDOW_SIZES)
                         if p != (-1, -1)])
    cap = rng.choice(SOFTCAPS)
    q, k, v = qkv(2, 90, 120, 4, 2, 64, dtype=dtype, seed=seed)
    slopes = torch.rand(2, 4, generator=torch.Generator().manual_seed(seed))
    causal = rng.random() < 0.5
    out, lse = flashtune.attention(q, k, v, causal=causal, window_size=window, softcap=cap,
                                   alibi_slopes=slopes, return_lse=True, backend="emulator")
    ref_window = (window[0], 0) if causal else window
    _check(out, lse, q, k, v, False, f"seed={seed} window={window} cap={cap} causal={causal}",
           window=ref_window, softcap=cap, alibi_slopes=slopes)


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher", "poisoned_outputs")
def test_each_feature_alone_and_per_head_slopes() -> None:
    seed = _RNG.randrange(2**31)
    q, k, v = qkv(1, 70, 70, 2, 1, 32, seed=seed)
    slopes = torch.tensor([0.5, 0.125])
    out, lse = flashtune.attention(q, k, v, alibi_slopes=slopes, return_lse=True,
                                   backend="emulator")
    _check(out, lse, q, k, v, False, f"alibi seed={seed}", alibi_slopes=slopes)
    out, lse = flashtune.attention(q, k, v, softcap=5.0, causal=True, return_lse=True,
                                   backend="emulator")
    _check(out, lse, q, k, v, True, f"softcap seed={seed}", softcap=5.0)
    out, lse = flashtune.attention(q, k, v, window_size=(16, 3), return_lse=True,
                                   backend="emulator")
    _check(out, lse, q, k, v, False, f"window seed={seed}", window=(16, 3))


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher", "poisoned_outputs")
def test_softcap_zero_is_flash_attns_off() -> None:
    """softcap=0.0 (flash-attn's default) is no softcap: the plain kernel and key, plain
    attention against float64, gradients included, and accepted by decoding."""
    seed = _RNG.randrange(2**31)
    q, k, v = qkv(1, 50, 70, 2, 1, 32, seed=seed)
    meta = [t.to("meta") for t in (q, k, v)]
    keys = {ops.explain(*meta, causal=True, softcap=cap).problem.key() for cap in (0.0, None)}
    assert keys == {"fwd_d32_fp16_causal"}
    out, lse = flashtune.attention(q, k, v, causal=True, softcap=0.0, return_lse=True,
                                   backend="emulator")
    _check(out, lse, q, k, v, True, f"softcap=0.0 seed={seed}")
    qg = q.clone().requires_grad_()
    loss = flashtune.attention(qg, k, v, causal=True, softcap=0, backend="emulator").sum()
    loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    cache = torch.randn(1, 32, 1, 32, dtype=torch.float16)
    lens = torch.tensor([20], dtype=torch.int32)
    decoded = flashtune.attention_with_kvcache(q[:, :1], cache, cache.clone(), lens,
                                               softcap=0.0, backend="emulator")
    assert torch.equal(decoded, flashtune.attention_with_kvcache(
        q[:, :1], cache, cache.clone(), lens, backend="emulator"))


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher")
def test_the_op_path_takes_the_same_features() -> None:
    """Inputs that need a gradient go through the custom op: same outputs as the direct
    call, and a backward through them (its numerics: test_api_backward_features.py)."""
    q, k, v = qkv(1, 40, 40, 2, 2, 32, seed=3)
    direct = flashtune.attention(q, k, v, window_size=(8, 8), softcap=30.0,
                                 backend="emulator")
    qg = q.clone().requires_grad_()
    through_op = flashtune.attention(qg, k, v, window_size=(8, 8), softcap=30.0,
                                     backend="emulator")
    assert torch.equal(direct, through_op.detach())
    through_op.sum().backward()  # type: ignore[no-untyped-call]  # unannotated in torch
    assert qg.grad is not None and torch.isfinite(qg.grad).all() and qg.grad.abs().sum() > 0


def test_windows_resolve_to_the_cheapest_equal_mask() -> None:
    q, k, v = (t.to("meta") for t in qkv(1, 100, 300, 2, 2, 64))

    def key(**kwargs: object) -> str:
        return ops.explain(q, k, v, arch="sm_80", **kwargs).problem.key()  # type: ignore[arg-type]

    assert key(window_size=(-1, 0)) == "fwd_d64_fp16_causal"
    assert key(window_size=(299, 0)) == "fwd_d64_fp16_causal"  # reaches key 0 from every row
    assert key(window_size=(298, 0)) == "fwd_d64_fp16_local"
    assert key(window_size=(10, 99)) == key(window_size=(10, -1))  # row 0 sees the last key
    assert key(window_size=(10, 500), causal=True) == "fwd_d64_fp16_local"
    assert key(window_size=(500, 500)) == "fwd_d64_fp16_full"
    assert key(softcap=30.0, alibi_slopes=torch.ones(2, device="meta")) == (
        "fwd_d64_fp16_full_softcap_alibi")
    assert key() == "fwd_d64_fp16_full" and key(causal=True) == "fwd_d64_fp16_causal"


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"window_size": (-2, 0)}, "has a size below -1"),
    ({"window_size": (4,)}, "must be a pair of ints"),
    ({"window_size": (True, 0)}, "must be a pair of ints"),
    ({"window_size": (1.5, 0)}, "must be a pair of ints"),
    ({"softcap": -0.5}, "or 0.0) for no softcapping"),
    ({"softcap": -5.0}, "is not a finite number > 0"),
    ({"softcap": math.nan}, "is not a finite number > 0"),
    ({"softcap": "30"}, "must be a float > 0"),
    ({"alibi_slopes": torch.ones(3)}, "expected (2,) (one slope per query head) or (1, 2)"),
    ({"alibi_slopes": torch.ones(2, 2)}, "has shape (2, 2)"),
    ({"alibi_slopes": torch.ones(2, dtype=torch.float16)}, "expected torch.float32"),
    ({"alibi_slopes": [0.5, 0.25]}, "must be a torch.Tensor"),
    ({"alibi_slopes": torch.ones(2, device="meta")}, "alibi_slopes.to(q.device)"),
])
def test_bad_feature_values_are_refused_with_the_fix(kwargs: dict[str, object],
                                                     needle: str) -> None:
    q, k, v = qkv(1, 8, 8, 2, 2, 32)
    with pytest.raises(InvalidInput) as info:
        flashtune.attention(q, k, v, backend="emulator", **kwargs)  # type: ignore[call-overload]  # ill-typed on purpose
    assert needle in str(info.value)


def test_decoding_validates_its_feature_values() -> None:
    q = torch.randn(1, 1, 2, 64, dtype=torch.float16)
    cache = torch.randn(1, 32, 2, 64, dtype=torch.float16)
    lens = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(InvalidInput, match="below -1"):
        flashtune.attention_with_kvcache(q, cache, cache, lens, window_size=(-3, 0),
                                         backend="emulator")


@pytest.mark.parametrize("family", [f.op for f in families.all_families()])
def test_every_family_serves_or_refuses_each_feature(family: str) -> None:
    """No family silently computes plain attention for a feature problem: it implements the
    feature (renders with it) or refuses it naming the feature and itself."""
    impl = families.get(family)
    dtypes = min(impl.dtypes, key=str)  # fp16 where the family takes it
    for name in FEATURES:
        problem = Problem(64, dtypes.q, op=family, kv_dtype=dtypes.kv, o_dtype=dtypes.o,
                          **{name: True})  # type: ignore[arg-type]
        if name in impl.features:
            impl.check_problem(problem)
            continue
        with pytest.raises(FeatureNotSupported, match=f"'{family}' kernel family") as info:
            fp8 = dtypes.fp8  # FP8 mma and conversions: sm_89 and later
            arch = get_arch(impl.target_arch or ("sm_89" if fp8 else "sm_80"))
            plain = Problem(64, dtypes.q, op=family, kv_dtype=dtypes.kv, o_dtype=dtypes.o)
            impl.render(problem, impl.default_config(plain, arch))
        keyword = {"window": "window_size", "softcap": "softcap", "alibi": "alibi_slopes",
                   "varlen": "attention_varlen", "sinks": "sinks", "dropout": "dropout_p"}[name]
        assert f"({keyword})" in str(info.value)


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher", "poisoned_outputs")
@pytest.mark.parametrize(("head_dim", "dtype"), seeded_part(
    [(59, torch.float16), (111, torch.bfloat16)], 1, "api-padded-head-dim", several=True))
def test_any_head_dim_is_padded_inside(head_dim: int, dtype: torch.dtype) -> None:
    """Head dims that are not multiples of 8: the result (scaled by 1/sqrt of the real head
    dim) matches the reference, the output has the caller's head dim, and the inputs are
    copied once each (their padded copies are what the kernel reads). One of the two drawn
    with the run's seed, the other under -m sweep."""
    seed = _RNG.randrange(2**31)
    q, k, v = qkv(2, 50, 70, 4, 2, head_dim, dtype=dtype, seed=seed)
    copies: list[tuple[int, ...]] = []
    real_pad = torch.nn.functional.pad

    def counting_pad(t: torch.Tensor, pad: tuple[int, ...], *args: object) -> torch.Tensor:
        copies.append(tuple(t.shape))
        return real_pad(t, pad, *args)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "pad", counting_pad)
        out, lse = flashtune.attention(q, k, v, causal=True, softcap=30.0, return_lse=True,
                                       backend="emulator")
    assert copies == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
    assert out.shape == q.shape
    _check(out, lse, q, k, v, True, f"d={head_dim} seed={seed}", softcap=30.0)
    q3, k3, v3 = q[0], k[0], v[0]
    cu_q = torch.tensor([0, 50], dtype=torch.int32)
    cu_k = torch.tensor([0, 70], dtype=torch.int32)
    out_v = flashtune.attention_varlen(q3, k3, v3, cu_q, cu_k, 50, 70, causal=True,
                                       softcap=30.0, backend="emulator")
    assert out_v.shape == q3.shape
    torch.testing.assert_close(out_v, out[0], rtol=0, atol=0)


def test_head_dims_past_the_limit_are_refused() -> None:
    """Above 256 only 512 and 576 (the wide forward: test_fwd_wide_heads.py)."""
    q, k, v = qkv(1, 4, 4, 1, 1, 384)
    with pytest.raises(InvalidInput, match="head_dim=384 is not supported; the limit is 256"):
        flashtune.attention(q, k, v, backend="emulator")
    q, k, _ = qkv(1, 4, 4, 1, 1, 192)
    _, _, v = qkv(1, 4, 4, 1, 1, 264)
    with pytest.raises(InvalidInput, match="v has head dim 264; the limit is 256"):
        flashtune.attention(q, k, v, backend="emulator")


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher")
def test_gradients_flow_through_a_padded_head_dim() -> None:
    """The padding is differentiable: dQ, dK, dV of head dim 59 match float64 autograd of
    the reference."""
    q, k, v = qkv(1, 24, 24, 2, 2, 59, seed=7)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    loss = flashtune.attention(*inputs, causal=True, backend="emulator").float().square().sum()
    loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    rq, rk, rv = ref_inputs
    ref_o, _ = attention_reference(rq, rk, rv, True, 59 ** -0.5)
    ref_o.square().sum().backward()  # type: ignore[no-untyped-call]  # unannotated in torch
    for got, ref in zip(inputs, ref_inputs, strict=True):
        assert got.grad is not None and ref.grad is not None
        scale = float(ref.grad.abs().max())
        assert float((got.grad.double() - ref.grad).abs().max()) <= 2e-2 * scale


@pytest.mark.parametrize("name", FEATURES)
def test_the_sm90a_forward_serves_every_feature(name: str) -> None:
    """On an sm_90a device the warp-specialised forward serves plain problems and every
    feature (window, softcap, ALiBi, varlen, sinks, dropout)."""
    arch = get_arch("sm_90a")
    plain = Problem(64, DType.FP16)
    assert families.served_problem(plain, arch).op == "fwd90aws"
    featured = Problem(64, DType.FP16, **{name: True})  # type: ignore[arg-type]
    assert families.served_problem(featured, arch) == dataclasses.replace(featured,
                                                                          op="fwd90aws")
