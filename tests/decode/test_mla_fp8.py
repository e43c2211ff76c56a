"""MLA decoding over FlashMLA's FP8 latent cache (656 bytes per token: 512 e4m3 values, 4
float32 scales, 64 bf16 RoPE values) in the emulator.

* Numerics: the kernel's partial O and LSE, merged in float64, against float64 attention of
  the latent dequantised here from the cache's bytes (test_mla_decode.dequantise_rows: the
  kernel's documented order), and each split against the family's reference; outputs
  poisoned with NaN, unreadable cache rows NaN codes, NaN scales and NaN RoPE values; half
  the scales are off powers of two. A seeded sample by default (page sizes none, 1, 3, 16,
  64; 1 and 2 query rows; 16 and 32 heads; 1 and 3 splits), the grid (also page sizes 100
  and 256, up to 128 heads) under sweep.
* Configs: sm_80's default (one buffer of raw rows) by default, every config that passes
  sm_90's rules under sweep.
* Bytes: each cache byte (656 per token) is read once per sequence and row block, plus Q.
* The quantisation helper against an independent float64 quantisation (nearest e4m3 from a
  table of every finite value, ties to even; the smallest power-of-two scale that fits).
* The API (``attention_with_kvcache(q, kv_cache, None, ..., head_dim_v=512)``) with a
  float8_e4m3fn and a uint8 cache, and its refusals naming the argument and what is
  expected.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
from mla_cases import FP8_GRID, MlaCase, fp8_sample
from test_mla_bytes import check_bytes
from test_mla_configs import check_config
from test_mla_decode import check_case, dense_reference, dequantise_rows, e4m3_value

import flashtune
from flashtune.api.mla import mla_with_kvcache
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.errors import InvalidInput, InvalidProblem
from flashtune.families.base import close_enough
from flashtune.families.checks import LSE_TOLERANCE, O_TOLERANCE
from flashtune.families.decode import DecodeCase
from flashtune.families.mla import MLA
from flashtune.families.mla.space import config_splits, smem_bytes

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
PROBLEM = Problem(64, DType.BF16, kv_dtype="e4m3", op="mla")


@pytest.mark.emulator
@pytest.mark.parametrize("case", fp8_sample(SEED + 23), ids=lambda c: c.key)
def test_fp8_cache_matches_float64_on_a_sample(case: MlaCase) -> None:
    check_case(case)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("case", FP8_GRID, ids=lambda c: c.key)
def test_fp8_cache_matches_float64_grid(case: MlaCase) -> None:
    check_case(case)


#: The case other configs run: paged (3-row pages), causal rows, 32 heads, 3 splits.
CONFIG_CASE = MlaCase(DType.BF16, 3, 2, 32, 3, True)
#: Every config of the space that passes sm_90's rules for the FP8 cache (heuristic splits).
FP8_CONFIGS = tuple(c for c in MLA.search_space(PROBLEM) if config_splits(c) == 0
                    and MLA.rules(PROBLEM, c, get_arch("sm_90")) is None)



@pytest.mark.emulator
def test_fp8_cache_sm80_default_matches_float64() -> None:
    """sm_80's default (one buffer of raw rows: refilled after each step) on its own case."""
    config = MLA.default_config(PROBLEM, get_arch("sm_80"))
    assert config.num_stages == 1
    check_config(config, CONFIG_CASE)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("config", FP8_CONFIGS, ids=lambda c: c.key())
def test_fp8_cache_every_config_matches_float64(config: KernelConfig) -> None:
    check_config(config, CONFIG_CASE)


@pytest.mark.emulator
@pytest.mark.parametrize("case", fp8_sample(SEED + 29)[:3], ids=lambda c: c.key)
def test_fp8_cache_bytes_read_once_on_a_sample(case: MlaCase) -> None:
    check_bytes(case)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("case", FP8_GRID, ids=lambda c: c.key)
def test_fp8_cache_bytes_read_once_grid(case: MlaCase) -> None:
    check_bytes(case)


def _nearest_e4m3(x: float) -> int:
    """The e4m3 code nearest ``x`` (|x| <= 448), ties to the even code, from a table of every
    finite code's value."""
    best = min(FINITE, key=lambda code: (abs(FINITE[code] - x), code & 1))
    if FINITE[best] == 0.0:  # the sign of zero follows x (0x80 is -0)
        return 0x80 if math.copysign(1.0, x) < 0 else 0x00
    return best


FINITE = {code: float(e4m3_value(torch.tensor([code], dtype=torch.uint8))[0])
          for code in range(256) if code & 0x7F != 0x7F}


def _quantise_float64(row: list[float]) -> tuple[list[int], list[float]]:
    """Codes and scales of one 576-value row, in float64 from the definition."""
    codes, scales = [], []
    for g in range(4):
        group = row[128 * g: 128 * g + 128]
        amax = max(abs(v) for v in group)
        scale = 1.0 if amax == 0 else 2.0 ** math.ceil(math.log2(amax / 448.0))
        while amax > 0 and amax / (scale / 2) <= 448.0:  # log2's rounding: the smallest
            scale /= 2
        while amax / scale > 448.0:
            scale *= 2
        scales.append(scale)
        codes += [_nearest_e4m3(v / scale) for v in group]
    return codes, scales


def test_quantize_mla_latent_matches_float64_quantisation() -> None:
    gen = torch.Generator().manual_seed(SEED)
    latent = torch.randn(2, 3, 1, 576, generator=gen) * torch.tensor([1e-3, 1.0, 300.0])[
        None, :, None, None]
    latent[0, 0, 0, :128] = 0.0  # an all-zero group: scale 1
    latent[1, 1, 0, 130] = 448.0 * 4  # amax exactly 448 x a power of two
    latent = latent.to(torch.bfloat16)
    rows = flashtune.quantize_mla_latent(latent)
    assert rows.dtype == torch.float8_e4m3fn and rows.shape == (2, 3, 1, 656)
    raw = rows.view(torch.uint8).reshape(-1, 656)
    flat = latent.reshape(-1, 576)
    for r in range(flat.shape[0]):
        values = [float(v) for v in flat[r].to(torch.float64)]
        codes, scales = _quantise_float64(values)
        assert raw[r, :512].tolist() == codes, r
        assert raw[r, 512:528].contiguous().view(torch.float32).tolist() == scales, r
        assert torch.equal(raw[r, 528:].contiguous().view(torch.bfloat16), flat[r, 512:])
    assert raw[0, 512:516].contiguous().view(torch.float32).item() == 1.0
    assert raw[4, 512 + 4:520].contiguous().view(torch.float32).item() == 4.0
    # Power-of-two scales: dequantisation gives back e4m3 x scale exactly.
    again = dequantise_rows(raw)
    error = (again[:, :512] - flat[:, :512].to(torch.float64)).abs()
    bound = torch.tensor([s for r in range(flat.shape[0])
                          for s in _quantise_float64([float(v) for v in flat[r]])[1]]
                         ).repeat_interleave(128).view(-1, 512) * 16  # half an ulp at 448
    assert bool((error <= bound).all())
    with pytest.raises(InvalidInput, match="576"):
        flashtune.quantize_mla_latent(latent[..., :512])
    with pytest.raises(InvalidInput, match="torch.bfloat16"):
        flashtune.quantize_mla_latent(latent.to(torch.float16))


def _api_inputs(page_size: int | None, seqlen_q: int, splits: int, seed: str
                ) -> tuple[MlaCase, tuple[int, ...], dict[str, torch.Tensor]]:
    case = MlaCase(DType.BF16, page_size, seqlen_q, 16, splits, True)
    rng = random.Random(seed)
    lengths = (150, rng.randrange(seqlen_q, 150), 0)
    inputs = MLA.random_inputs(case.problem, case.shape, "cpu", seed=rng.randrange(1 << 30),
                               case=DecodeCase(page_size, lengths, 0, splits))
    return case, lengths, dict(inputs.tensors)


@pytest.mark.emulator
@pytest.mark.parametrize("page_size,seqlen_q,splits,as_bytes",
                         [(64, 2, 3, False), (None, 1, 1, True)])
def test_api_fp8_cache_matches_float64(page_size: int | None, seqlen_q: int, splits: int,
                                       as_bytes: bool) -> None:
    case, lengths, t = _api_inputs(page_size, seqlen_q, splits,
                                   f"{SEED}-fp8-api-{page_size}-{seqlen_q}")
    cache = t["kv_cache"].view(torch.uint8) if as_bytes else t["kv_cache"]
    out, lse = flashtune.attention_with_kvcache(
        t["q"], cache, None, t["cache_seqlens"], block_table=t.get("block_table"),
        causal=case.causal, num_splits=splits, return_lse=True, head_dim_v=512,
        backend="emulator")
    assert out.shape == (3, seqlen_q, 16, 512) and out.dtype == torch.bfloat16
    table = t.get("block_table")
    for b, length in enumerate(lengths):
        pos = torch.arange(length)
        rows = (cache[b, pos, 0] if table is None else
                cache[table[b, pos // cache.shape[1]].long(), pos % cache.shape[1], 0])
        want_o, want_lse = dense_reference(t["q"][b], dequantise_rows(rows), 576 ** -0.5,
                                           case.causal)
        for name, got, want, tol in (("O", out[b], want_o, O_TOLERANCE[DType.BF16]),
                                     ("LSE", lse[b], want_lse, LSE_TOLERANCE)):
            _, _, wrong = close_enough(f"sequence {b} {name}", got, want, tol)
            assert not wrong, wrong
    assert bool((out[2] == 0).all()) and bool(torch.isposinf(lse[2]).all())


def test_api_refuses_bad_fp8_caches_naming_the_expected_value() -> None:
    _, _, t = _api_inputs(16, 1, 1, f"{SEED}-fp8-refusals")
    q, cache, lengths, table = t["q"], t["kv_cache"], t["cache_seqlens"], t["block_table"]
    with pytest.raises(InvalidInput, match=r"640 bytes per token.*expected 656"):
        mla_with_kvcache(q, cache[..., :640].contiguous(), lengths, block_table=table,
                         backend="emulator")
    with pytest.raises(InvalidInput, match=r"q has dtype torch.float16.*expected "
                                           r"torch.bfloat16"):
        mla_with_kvcache(q.to(torch.float16), cache, lengths, block_table=table,
                         backend="emulator")
    with pytest.raises(InvalidInput, match=r"float8_e5m2.*float8_e4m3fn or torch.uint8"):
        mla_with_kvcache(q, cache.view(torch.float8_e5m2), lengths, block_table=table,
                         backend="emulator")
    with pytest.raises(InvalidInput, match=r"k_cache has strides .* multiples of 16"):
        wide = torch.zeros(*cache.shape[:-1], 664, dtype=torch.uint8)
        mla_with_kvcache(q, wide[..., 4:660], lengths, block_table=table,
                         backend="emulator")
    with pytest.raises(InvalidInput, match=r"FP8 rows of 656 bytes"):
        flashtune.attention_with_kvcache(q, cache[..., :576].contiguous(), None, lengths,
                                         block_table=table, backend="emulator")


def test_fp8_cache_problem_key_defaults_and_rules() -> None:
    assert PROBLEM.key() == "mla_d64_bf16-e4m3-bf16_full"
    from flashtune.commands.codegen import parse_problem  # the CLI's --input-dtype
    assert parse_problem("mla", 64, DType.BF16, False, "e4m3") == PROBLEM
    assert parse_problem("mla", 64, DType.BF16, False).key() == "mla_d64_bf16_full"
    with pytest.raises(InvalidProblem, match="element types"):
        MLA.check_problem(Problem(64, DType.FP16, kv_dtype="e4m3", op="mla"))
    for arch, stages in (("sm_80", 1), ("sm_86", 1), ("sm_90", 2)):
        config = MLA.default_config(PROBLEM, get_arch(arch))
        assert MLA.rules(PROBLEM, config, get_arch(arch)) is None
        assert config.num_stages == stages, (arch, config)
        assert smem_bytes(PROBLEM, config) <= get_arch(arch).max_smem_per_block
        # The 16-bit problem keeps its defaults (the one-stage entry is FP8's on sm_80).
        assert MLA.default_config(Problem(64, DType.BF16, op="mla"), get_arch(arch)) != (
            config) or arch == "sm_90"
    # sm_80: the two-stage default's raw rows do not fit beside the dequantised tile.
    assert smem_bytes(PROBLEM, MLA.default_config(PROBLEM, get_arch("sm_90"))) == 168976
    # Each cache byte once per sequence: 656 per token, Q 16-bit, O and the LSE.
    assert MLA.min_bytes(PROBLEM, Shape(1, 16, 1, 1, 100)) == (
        100 * 656 + 16 * 576 * 2 + 16 * (512 * 2 + 4))
