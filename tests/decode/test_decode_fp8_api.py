"""``flashtune.attention_with_kvcache`` over an e4m3 KV cache with ``k_descale`` and
``v_descale`` (the ``decode8`` family, split + combine) on the emulator: O and the LSE against
float64 attention over the dequantised caches with the new rows as torch quantises them, the
caches appended in place byte for byte as torch's conversion; the tuning key names the cache
type; bad inputs are refused naming the argument and the expected value."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from decode_cases import assert_close_to_float64, call_api

from flashtune.api import decode as api_decode
from flashtune.codegen.dtypes import Fp8Type
from flashtune.codegen.spec import DType, Problem, Shape
from flashtune.errors import InvalidInput
from flashtune.families.base import Inputs, close_enough
from flashtune.families.checks import LSE_TOLERANCE, O_TOLERANCE
from flashtune.families.decode import DecodeCase
from flashtune.families.decode.fp8 import DECODE_FP8, dequantised, expected_e4m3_caches
from flashtune.runtime import plans

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
SHAPE = Shape(2, 8, 2, 3, 150)


def _inputs(dtype: DType, case: DecodeCase, seed: int = SEED) -> Inputs:
    problem = Problem(64, dtype, op="decode8", kv_dtype=Fp8Type.E4M3)
    return DECODE_FP8.random_inputs(problem, SHAPE, "cpu", seed=seed, case=case)


def _call(inputs: Inputs, **kwargs: Any) -> Any:
    t = inputs.tensors
    return call_api(inputs, k_descale=t["k_descale"], v_descale=t["v_descale"],
                    backend="emulator", **kwargs)


@pytest.mark.emulator
@pytest.mark.parametrize("dtype, page, causal, splits, invariant", [
    (DType.BF16, 16, True, 3, False), (DType.FP16, None, False, None, True),
    (DType.BF16, 100, False, 1, False)])
def test_fp8_cache_call_matches_float64_and_appends_quantised_rows(
        dtype: DType, page: int | None, causal: bool, splits: int | None,
        invariant: bool) -> None:
    """Paged (16, 100) and unpaged, GQA group 4, three appended rows, fixed splits or the
    batch-invariant split table: O and the LSE against float64 of the dequantised caches,
    and the caches after the call byte for byte (e4m3(x / descale) by torch)."""
    print(f"seed={SEED} {dtype.value} page={page} causal={causal} splits={splits} "
          f"batch_invariant={invariant}")
    inputs = _inputs(dtype, DecodeCase(page, (147, 61), 3, splits or 1))
    want_caches = expected_e4m3_caches(inputs)
    out, lse = _call(inputs, causal=causal, num_splits=splits, return_lse=True,
                     batch_invariant=invariant)
    assert out.dtype == inputs.tensors["q"].dtype
    assert_close_to_float64(dequantised(inputs), causal, out, lse)
    for name, want in want_caches.items():
        got = inputs.tensors[name]
        assert got.dtype == torch.float8_e4m3fn
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.emulator
def test_fp8_cache_call_with_sinks_and_softcap() -> None:
    """Sinks join in the combine, softcap in the kernel, over the dequantised keys."""
    from flashtune.families.decode.reference import attention_with_kvcache_reference
    from flashtune.families.fwd.variants import VariantValues

    inputs = _inputs(DType.BF16, DecodeCase(3, (120, 7), 3, 2))
    gen = torch.Generator().manual_seed(SEED)
    sinks = torch.randn(SHAPE.heads_q, generator=gen)
    out, lse = _call(inputs, softcap=5.0, sinks=sinks, num_splits=2, return_lse=True)
    ref = dequantised(inputs)
    ref_o, ref_lse = attention_with_kvcache_reference(ref, False,
                                                      VariantValues((-1, -1), 5.0, None))
    # The sink's logit joins each row's denominator: O scales by exp(lse - lse'), the LSE
    # becomes log(exp(lse) + exp(sink)).
    sink = sinks.to(torch.float64)[None, :, None]
    new_lse = torch.logaddexp(ref_lse, sink)
    ref_o = ref_o * torch.exp(ref_lse - new_lse).permute(0, 2, 1)[..., None]
    for name, got, want, tol in (("O", out, ref_o, O_TOLERANCE[DType.BF16]),
                                 ("LSE", lse, new_lse, LSE_TOLERANCE)):
        _, _, wrong = close_enough(name, got, want, tol)
        assert not wrong, f"seed {SEED}: {wrong}"


@pytest.mark.sweep  # a traced modification's kernel takes long to build for the emulator
@pytest.mark.emulator
def test_a_traced_mask_mod_over_an_fp8_cache_is_the_causal_mask() -> None:
    """mask_mod q_idx >= kv_idx (the row's absolute position) is decoding's causal mask:
    bitwise the causal call's result over the same e4m3 cache, and a full call differs."""
    case = DecodeCase(16, (140, 33), 3, 2)
    causal = _call(_inputs(DType.BF16, case), causal=True, num_splits=2)
    masked = _call(_inputs(DType.BF16, case), num_splits=2,
                   mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    full = _call(_inputs(DType.BF16, case), num_splits=2)
    assert torch.equal(masked, causal)
    assert not torch.equal(full, causal)


def test_the_tuning_key_names_the_cache_type() -> None:
    q = torch.empty(2, 1, 8, 128, dtype=torch.bfloat16)
    bucket, combine = api_decode.decode_problems(
        q, False, 4096, "", plans.Operands(kv_dtype=torch.float8_e4m3fn))
    assert bucket.problem.key() == "decode8_d128_bf16-e4m3-bf16_full"
    assert combine.problem.key().startswith("combine_d128_bf16_")
    plain, _ = api_decode.decode_problems(q, False, 4096)
    assert plain.problem.key() == "decode_d128_bf16_full"


def test_the_cost_model_counts_one_byte_per_cached_value() -> None:
    from flashtune.codegen.spec import KernelConfig
    from flashtune.perf.model.decode import decode_traffic

    shape = Shape(4, 32, 8, 1, 8192)
    config = KernelConfig(64, 64, 4, 2)
    fp8 = decode_traffic(Problem(128, DType.BF16, op="decode8", kv_dtype=Fp8Type.E4M3),
                         config, shape, 2)
    bf16 = decode_traffic(Problem(128, DType.BF16, op="decode"), config, shape, 2)
    assert 2 * fp8.kv == bf16.kv == 2 * 4 * 8 * 8192 * 128 * 2
    assert (fp8.q, fp8.partials, fp8.out) == (bf16.q, bf16.partials, bf16.out)


def test_explain_names_the_fp8_cache_family() -> None:
    import flashtune

    t = _inputs(DType.BF16, DecodeCase(16, (20, 9), 0, 1), seed=2).tensors
    decode, _ = flashtune.explain_kvcache(t["q"], t["k_cache"], t["v_cache"],
                                          t["cache_seqlens"], block_table=t["block_table"],
                                          backend="emulator", arch="sm_90")
    assert decode.problem.key() == "decode8_d64_bf16-e4m3-bf16_full"
    assert decode.problem.op == "decode8"


def _base() -> dict[str, Any]:
    inputs = _inputs(DType.BF16, DecodeCase(16, (20, 9), 1, 1), seed=1)
    t = inputs.tensors
    return {"q": t["q"], "k_cache": t["k_cache"], "v_cache": t["v_cache"],
            "cache_seqlens": t["cache_seqlens"], "block_table": t["block_table"],
            "k": t["k_new"], "v": t["v_new"], "k_descale": t["k_descale"],
            "v_descale": t["v_descale"]}


def _refused(match: str, **change: Any) -> None:
    import flashtune

    args = {**_base(), **change}
    positional = [args.pop(n) for n in ("q", "k_cache", "v_cache", "cache_seqlens")]
    with pytest.raises(InvalidInput, match=match):
        flashtune.attention_with_kvcache(*positional, backend="emulator", **args)


@pytest.mark.parametrize("name", ["k_descale", "v_descale"])
def test_a_descale_of_the_wrong_shape_or_dtype_is_refused_by_name(name: str) -> None:
    good = _base()[name]
    _refused(rf"{name} has shape \(2, 1\); expected a float32 tensor of shape "
             rf"\(batch, heads_kv\) = \(2, 2\)", **{name: good[:, :1]})
    _refused(rf"{name} has dtype torch.float16; expected a float32 tensor",
             **{name: good.half()})


def test_fp8_q_e5m2_caches_fp8_new_rows_and_descales_on_16bit_caches_are_refused() -> None:
    base = _base()
    _refused(r"q has dtype torch.float8_e4m3fn; expected torch.float16 or torch.bfloat16",
             q=base["q"].to(torch.float8_e4m3fn))
    for name in ("k_cache", "v_cache"):
        _refused(rf"{name} has dtype torch.float8_e5m2; expected torch.bfloat16 .* or "
                 r"torch.float8_e4m3fn", **{name: base[name].to(torch.float8_e5m2)})
    _refused(r"v_cache has dtype torch.bfloat16; expected torch.float8_e4m3fn \(like k_cache",
             v_cache=base["v_cache"].to(torch.bfloat16))
    _refused(r"k \(the new rows\) has dtype torch.float8_e4m3fn; expected torch.bfloat16",
             k=base["k"].to(torch.float8_e4m3fn))
    sixteen = {n: base[n].to(torch.bfloat16) for n in ("k_cache", "v_cache")}
    _refused(r"k_descale is given but k_cache has dtype torch.bfloat16: descale factors are "
             r"for an e4m3 cache", **sixteen)
