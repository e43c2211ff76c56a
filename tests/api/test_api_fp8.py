"""``flashtune.attention`` on torch.float8_e4m3fn q, k, v (the FP8 forward, in the emulator
as a virtual sm_90) against float64, and its refusals.

The bound: float64 attention of the dequantised inputs (each e4m3 value as torch decodes it
times its (batch, KV head) descale factor), within the 16-bit forward's tolerance of O's type
(``families.checks.O_TOLERANCE``: atol = rtol = 2.5e-2 for bf16, 4e-3 for fp16) and the
LSE's (1e-3 + 2e-6 |ref|): the kernel's roundings are the 16-bit forward's (P and O in O's
type, fp32 sums), on every element. The call allocates its outputs itself: the
NaN-poisoned launches of the same kernels are tests/families/test_fwd8_family.py's.
"""

from __future__ import annotations

import os

import pytest
import torch

import flashtune
from flashtune.codegen.dtypes import DType
from flashtune.errors import FeatureNotSupported, InvalidConfig, InvalidInput
from flashtune.families.checks import LSE_TOLERANCE, O_TOLERANCE
from flashtune.families.fwd.reference import attention_reference
from flashtune.families.fwd8 import RANDOM_DESCALE
from flashtune.runtime import plans

E4M3 = torch.float8_e4m3fn
SEED = int(os.environ["FLASHTUNE_TEST_SEED"])


@pytest.fixture(autouse=True)
def _sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHTUNE_EMULATOR_ARCH", "sm_90")


def inputs(batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_kv: int, dim: int,
           seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, n, h, dim, generator=gen).to(E4M3)
               for n, h in ((seqlen_q, heads_q), (seqlen_k, heads_kv), (seqlen_k, heads_kv)))
    lo, hi = RANDOM_DESCALE
    scales = tuple(lo + (hi - lo) * torch.rand(batch, heads_kv, generator=gen)
                   for _ in range(3))
    return (q, k, v, *scales)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qd: torch.Tensor,
              kd: torch.Tensor, vd: torch.Tensor, causal: bool, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    group = q.shape[2] // k.shape[2]
    per_q = qd.double().repeat_interleave(group, dim=1)
    return attention_reference(q.double() * per_q[:, None, :, None],
                               k.double() * kd.double()[:, None, :, None],
                               v.double() * vd.double()[:, None, :, None], causal, scale)


def assert_within(o: torch.Tensor, lse: torch.Tensor, ref_o: torch.Tensor,
                  ref_lse: torch.Tensor, seed: int) -> None:
    tol = O_TOLERANCE[DType.BF16 if o.dtype == torch.bfloat16 else DType.FP16]
    err = (o.double() - ref_o).abs()
    assert not torch.isnan(err).any(), f"seed={seed}"
    assert bool((err <= tol.atol + tol.rtol * ref_o.abs()).all()), (seed, float(err.max()))
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"seed={seed}"
    lse_err = (lse.double() - ref_lse)[finite].abs()
    bound = LSE_TOLERANCE.atol + LSE_TOLERANCE.rtol * ref_lse[finite].abs()
    assert bool((lse_err <= bound).all()), (seed, float(lse_err.max()))


@pytest.mark.emulator
def test_fp8_attention_matches_float64_gqa_causal_bf16() -> None:
    """GQA 4:2, causal with Nq > Nk (rows that see no key: O = 0, LSE = +inf), lengths off
    the tile grid, O in bf16 (the default)."""
    q, k, v, qd, kd, vd = inputs(2, 70, 45, 4, 2, 64, SEED)
    o, lse = flashtune.attention(q, k, v, causal=True, q_descale=qd, k_descale=kd,
                                 v_descale=vd, return_lse=True, backend="emulator")
    assert o.dtype == torch.bfloat16 and o.shape == q.shape and lse.shape == (2, 4, 70)
    assert_within(o, lse, *reference(q, k, v, qd, kd, vd, True, 64 ** -0.5), SEED)


@pytest.mark.emulator
def test_fp8_attention_fp16_out_mqa_default_descales() -> None:
    """MQA, no mask, fp16 O, a custom scale and no descale factors (1.0 each)."""
    q, k, v, *_ = inputs(1, 33, 80, 3, 1, 32, SEED + 1)
    ones = torch.ones(1, 1)
    o, lse = flashtune.attention(q, k, v, softmax_scale=0.3, out_dtype=torch.float16,
                                 return_lse=True, backend="emulator")
    assert o.dtype == torch.float16
    assert_within(o, lse, *reference(q, k, v, ones, ones, ones, False, 0.3), SEED + 1)


def _fp8(dim: int = 64) -> tuple[torch.Tensor, ...]:
    return inputs(2, 8, 8, 4, 2, dim, 0)


@pytest.mark.parametrize("bad, match", [
    (torch.ones(2, 4), r"q_descale has shape \(2, 4\); expected a float32 tensor of shape "
                       r"\(batch, heads_kv\) = \(2, 2\)"),
    (torch.ones(2, 2, dtype=torch.float16), r"q_descale has dtype torch.float16; expected a "
                                            r"float32 tensor"),
    (torch.ones(2, 2, dtype=torch.float64), r"q_descale has dtype torch.float64"),
    (2.0, r"q_descale is a float; expected a float32 tensor of shape"),
    (torch.ones(2, 4)[:, ::2], r"q_descale has strides \(4, 2\); expected a contiguous"),
])
def test_bad_descale_is_refused_naming_it(bad: object, match: str) -> None:
    q, k, v, *_ = _fp8()
    with pytest.raises(InvalidInput, match=match):
        flashtune.attention(q, k, v, q_descale=bad, backend="emulator")  # type: ignore[call-overload]


def test_bad_out_dtype_and_fp8_arguments_on_16bit_inputs_are_refused() -> None:
    q, k, v, qd, *_ = _fp8()
    with pytest.raises(InvalidInput, match=r"out_dtype=torch.float32 .* expected "
                                           r"torch.bfloat16 \(the default\) or torch.float16"):
        flashtune.attention(q, k, v, out_dtype=torch.float32, backend="emulator")
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    with pytest.raises(InvalidInput, match=r"k_descale is given but q has dtype "
                                           r"torch.bfloat16: descale factors are for "
                                           r"FP8 q, k and v \(torch.float8_e4m3fn"):
        flashtune.attention(qb, kb, vb, k_descale=qd, backend="emulator")
    with pytest.raises(InvalidInput, match=r"out_dtype=torch.float16 with torch.bfloat16 "
                                           r"inputs"):
        flashtune.attention(qb, kb, vb, out_dtype=torch.float16, backend="emulator")


def test_fp8_beside_16bit_tensors_and_odd_head_dims_are_refused() -> None:
    q, k, v, *_ = _fp8()
    with pytest.raises(InvalidInput, match=r"v has dtype torch.bfloat16 but the FP8 forward "
                                           r"takes torch.float8_e4m3fn \(or "
                                           r"torch.float8_e5m2\) q, k and v; convert "
                                           r"it with v.to\(torch.float8_e4m3fn\)"):
        flashtune.attention(q, k, v.to(torch.bfloat16), backend="emulator")
    with pytest.raises(InvalidInput, match=r"k has dtype torch.float8_e5m2 but q has "
                                           r"torch.float8_e4m3fn: .* one FP8 format"):
        flashtune.attention(q, k.float().to(torch.float8_e5m2), v, backend="emulator")
    q48, k48, v48, *_ = _fp8(48)
    with pytest.raises(InvalidInput, match=r"head_dim=48 .* multiple of 32: pad q, k and v "
                                           r"with zeros to 64"):
        flashtune.attention(q48, k48, v48, backend="emulator")
    strided = torch.zeros(2, 8, 4, 72).to(E4M3)[..., :64]
    with pytest.raises(InvalidInput, match=r"q has strides .* multiples of 16 elements"):
        flashtune.attention(strided, k, v, backend="emulator")


@pytest.mark.parametrize("feature", [{"dropout_p": 0.1}])
def test_features_the_fp8_forward_lacks_are_refused(feature: dict[str, object]) -> None:
    q, k, v, *_ = _fp8()
    name = next(iter(feature))
    with pytest.raises(FeatureNotSupported, match=rf"alibi_slopes and sinks, "
                                                  rf"not {name}"):
        flashtune.attention(q, k, v, backend="emulator", **feature)  # type: ignore[call-overload]


@pytest.mark.emulator
def test_fp8_attention_with_window_softcap_alibi_matches_float64() -> None:
    """GQA 4:2, a window (20, 5), softcap 30, sinks and per-(batch, head) ALiBi slopes on the
    dequantised scores (the descales, drawn away from 1, would show if softcap or ALiBi saw
    the raw ones), O in fp16."""
    q, k, v, qd, kd, vd = inputs(2, 70, 45, 4, 2, 64, SEED)
    slopes = torch.rand(2, 4, generator=torch.Generator().manual_seed(SEED + 1))
    sinks = torch.tensor([0.5, 8.0, -2.0, 3.0])
    o, lse = flashtune.attention(q, k, v, window_size=(20, 5), softcap=30.0,
                                 alibi_slopes=slopes, sinks=sinks, q_descale=qd, k_descale=kd,
                                 v_descale=vd, out_dtype=torch.float16, return_lse=True,
                                 backend="emulator")
    group = q.shape[2] // k.shape[2]
    per_q = qd.double().repeat_interleave(group, dim=1)
    ref_o, ref_lse = attention_reference(
        q.double() * per_q[:, None, :, None], k.double() * kd.double()[:, None, :, None],
        v.double() * vd.double()[:, None, :, None], False, 64 ** -0.5, window=(20, 5),
        softcap=30.0, alibi_slopes=slopes, sinks=sinks)
    assert_within(o, lse, ref_o, ref_lse, SEED)


def test_an_arch_without_fp8_mma_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHTUNE_EMULATOR_ARCH", "sm_86")
    plans.clear_caches()
    q, k, v, *_ = _fp8()
    try:
        with pytest.raises(InvalidConfig, match=r"sm_86 has no FP8 tensor cores \(mma.sync "
                                                r"e4m3/e5m2 needs sm_89 or later\)"):
            flashtune.attention(q, k, v, backend="emulator")
    finally:
        plans.clear_caches()


@pytest.mark.emulator
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_fp8_attention_varlen_matches_float64_per_sequence(causal: bool) -> None:
    """``attention_varlen`` of e4m3 packs: four sequences (one without queries, one without
    keys: O = 0, LSE = +inf there), GQA 4:2, descales per (sequence, KV head), causal aligned
    to each sequence's bottom-right corner; every row against float64 of its own sequence."""
    seed = SEED + 7 + causal
    gen = torch.Generator().manual_seed(seed)
    lens_q, lens_k, heads_q, heads_kv, dim = [5, 0, 40, 9], [20, 7, 33, 0], 4, 2, 64
    q, k, v = (torch.randn(sum(lens), heads, dim, generator=gen).to(E4M3)
               for lens, heads in ((lens_q, heads_q), (lens_k, heads_kv), (lens_k, heads_kv)))
    lo, hi = RANDOM_DESCALE
    qd, kd, vd = (lo + (hi - lo) * torch.rand(len(lens_q), heads_kv, generator=gen)
                  for _ in range(3))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
                  for lens in (lens_q, lens_k))
    o, lse = flashtune.attention_varlen(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, q_descale=qd,
        k_descale=kd, v_descale=vd, return_lse=True, backend="emulator")
    assert o.dtype == torch.bfloat16 and o.shape == q.shape and lse.shape == (heads_q, len(q))
    scale = dim ** -0.5
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k, strict=True)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if sq == 0:
            continue
        if sk == 0:
            assert bool((o[rows] == 0).all()) and bool((lse[:, rows] == float("inf")).all())
            continue
        ref_o, ref_lse = reference(q[None, rows], k[None, keys], v[None, keys], qd[b:b + 1],
                                   kd[b:b + 1], vd[b:b + 1], causal, scale)
        assert_within(o[None, rows], lse[None, :, rows], ref_o, ref_lse, seed)


def test_fp8_attention_varlen_refusals_name_the_fix() -> None:
    """Descales of the batch's shape instead of (num_sequences, heads_kv), a score_mod, and
    FP8 arguments beside 16-bit packs are refused naming the argument."""
    q, k, v = (torch.randn(12, h, 64).to(E4M3) for h in (4, 2, 2))
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    with pytest.raises(InvalidInput, match=r"q_descale has shape \(1, 2\); expected a float32 "
                                           r"tensor of shape \(num_sequences, heads_kv\) = "
                                           r"\(2, 2\) \(one factor per sequence"):
        flashtune.attention_varlen(q, k, v, cu, cu, 8, 8, q_descale=torch.ones(1, 2),
                                   backend="emulator")
    with pytest.raises(FeatureNotSupported, match="score_mod"):
        flashtune.attention_varlen(q, k, v, cu, cu, 8, 8, score_mod=lambda s, b, h, i, j: s,
                                   backend="emulator")
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    with pytest.raises(InvalidInput, match=r"out_dtype=torch.float16 with torch.bfloat16"):
        flashtune.attention_varlen(qb, kb, vb, cu, cu, 8, 8, out_dtype=torch.float16,
                                   backend="emulator")


@pytest.mark.emulator
def test_e5m2_attention_matches_float64() -> None:
    """torch.float8_e5m2 q, k and v (the e5m2 mma): GQA 4:2, causal, fp16 O, against
    float64 of the e5m2 inputs times their descales."""
    q, k, v, qd, kd, vd = inputs(1, 50, 70, 4, 2, 64, SEED + 3)
    q, k, v = (t.float().to(torch.float8_e5m2) for t in (q, k, v))
    o, lse = flashtune.attention(q, k, v, causal=True, q_descale=qd, k_descale=kd,
                                 v_descale=vd, out_dtype=torch.float16, return_lse=True,
                                 backend="emulator")
    assert o.dtype == torch.float16
    served = [p.source.problem.key() for p in plans.cached().values()]
    assert "fwd8_d64_e5m2-e5m2-fp16_causal" in served, served
    assert_within(o, lse, *reference(q, k, v, qd, kd, vd, True, 64 ** -0.5), SEED + 3)
