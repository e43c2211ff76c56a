"""Decoding at Q/K head dims 512 and 576 (Gemma 4's 512; DeepSeek's absorbed 576/512) and
with V's head dim other than Q/K's: the split-KV kernel with V's column chunk of at most 256
beside Q/K of 512 or 576 (``DecodeWithHeadDimV``), and ``attention_with_kvcache`` with V up
to 512 wide (column chunks of 256, one call each), on the emulator against float64.

Family cases are launched with outputs poisoned with NaN (paged and unpaged caches, GQA
packing, appended rows, splits, the default tiles of sm_80, sm_86 and sm_90, window /
softcap / ALiBi); API cases add sinks, and the caches after appending are compared too. The
default run takes a seeded sample (FLASHTUNE_TEST_SEED; the seed is printed and in the
ids); ``-m sweep`` the grids.
"""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import dataclass
from typing import Any, cast

import pytest
import torch
from decode_cases import call_api, run_emulated
from test_decode_sinks import join_sinks

import flashtune
from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, Problem, Shape
from flashtune.errors import InvalidInput
from flashtune.families.base import Inputs, close_enough
from flashtune.families.checks import LSE_TOLERANCE, O_TOLERANCE
from flashtune.families.decode import DECODE, DecodeCase
from flashtune.families.decode.reference import (
    attention_with_kvcache_reference,
    expected_caches,
)
from flashtune.families.fwd.variants import VariantValues

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
CAPACITY = 70
BATCH = 2

#: (Q/K head dim, V's head dim of one kernel).
KERNEL_DIMS = ((512, 256), (512, 128), (576, 256))
#: (window, softcap, slopes "": none, "h": (heads_q,), "bh": (batch, heads_q)).
FEATURES: tuple[tuple[tuple[int, int] | None, float | None, str], ...] = (
    (None, None, ""), ((20, 0), None, ""), ((5, 3), None, ""), (None, 30.0, ""),
    (None, None, "bh"), ((16, 0), 5.0, "h"))
PAGE_SIZES: tuple[int | None, ...] = (None, 1, 3, 16, 64)
#: (heads_q, heads_kv): GQA group 4, MQA group 8.
HEADS = ((8, 2), (8, 1))
ARCHS = ("sm_80", "sm_86", "sm_90")


@dataclass(frozen=True)
class WideCase:
    """One launch of the decode kernel at a wide Q/K head dim."""

    dims: tuple[int, int]
    features: tuple[tuple[int, int] | None, float | None, str]
    page_size: int | None
    heads: tuple[int, int]
    seqlen_q: int
    append: bool
    num_splits: int
    arch: str  # whose default tile runs
    seed: int

    @property
    def key(self) -> str:
        window, cap, slopes = self.features
        parts = [f"w{window[0]}_{window[1]}" if window else "", f"cap{cap:g}" if cap else "",
                 f"alibi_{slopes}" if slopes else ""]
        paged = "unpaged" if self.page_size is None else f"page{self.page_size}"
        return (f"d{self.dims[0]}v{self.dims[1]}-{'-'.join(p for p in parts if p) or 'plain'}"
                f"-{paged}-h{self.heads[0]}x{self.heads[1]}-q{self.seqlen_q}-"
                f"{'append' if self.append else 'noappend'}-s{self.num_splits}-{self.arch}")

    def problem(self) -> Problem:
        window, cap, slopes = self.features
        return Problem(self.dims[0], DType.BF16, op="decode", head_dim_v=self.dims[1],
                       window=window is not None, softcap=cap is not None, alibi=bool(slopes))

    def shape(self) -> Shape:
        return Shape(BATCH, self.heads[0], self.heads[1], self.seqlen_q, CAPACITY)


#: The archs' default tiles take turns (each case runs one).
GRID = tuple(
    WideCase(dims, feats, page, heads, nq, append, splits, ARCHS[i % len(ARCHS)], seed=i)
    for i, (dims, feats, page, heads, nq, append, splits) in enumerate(itertools.product(
        KERNEL_DIMS, FEATURES, PAGE_SIZES, HEADS, (1, 3), (False, True), (1, 3))))


def sample(seed: int) -> list[WideCase]:
    """Three cases: each pair of dims once, page sizes, features and archs drawn."""
    rng = random.Random(f"{seed}-decode-wide")
    return [rng.choice([c for c in GRID if c.dims == dims]) for dims in KERNEL_DIMS]


def case_inputs(case: WideCase) -> Inputs:
    """Drawn inputs (one sequence at the full room, one mid-way) and the case's features."""
    problem, shape = case.problem(), case.shape()
    new = case.seqlen_q if case.append else 0
    room = DecodeCase(case.page_size, (0,) * BATCH, 0, 1).capacity(shape) - new
    lengths = (room, random.Random(case.seed).randrange(0, room))
    seed = SEED * 100003 + case.seed
    print(f"seed={seed} (FLASHTUNE_TEST_SEED={SEED}) {case.key}")
    drawn = DECODE.random_inputs(problem, shape, "cpu", seed=seed,
                                 case=DecodeCase(case.page_size, lengths, new, case.num_splits))
    return with_features(drawn, case.features, seed, shape)


def with_features(inputs: Inputs, features: tuple[tuple[int, int] | None, float | None, str],
                  seed: int, shape: Shape) -> Inputs:
    window, cap, slopes = features
    scalars, tensors = dict(inputs.scalars), dict(inputs.tensors)
    if window is not None:
        scalars["window_left"], scalars["window_right"] = window
    if cap is not None:
        scalars["softcap"] = cap
    if slopes:
        size = (shape.heads_q,) if slopes == "h" else (shape.batch, shape.heads_q)
        tensors["alibi_slopes"] = torch.rand(size, generator=torch.Generator().manual_seed(seed))
    return Inputs(tensors, scalars)


def _check_kernel(case: WideCase) -> None:
    problem = case.problem()
    config = DECODE.default_config(problem, get_arch(case.arch))
    launch, _ = run_emulated(problem, case.shape(), case_inputs(case), config)
    verdict = launch.verdict()
    assert verdict.ok, f"{case.key} {config.key()} (seed {SEED}): {verdict.message}"


@pytest.mark.emulator
@pytest.mark.parametrize("case", sample(SEED), ids=lambda c: c.key)
def test_wide_decode_kernel_matches_float64(case: WideCase) -> None:
    _check_kernel(case)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("case", GRID, ids=lambda c: c.key)
def test_wide_decode_kernel_grid(case: WideCase) -> None:
    _check_kernel(case)


# ----------------------------------------------------------------------------- the API

#: (Q/K head dim, V's head dim) through attention_with_kvcache: V above 256 in chunks.
API_DIMS = ((512, 512), (512, 256), (576, 512), (128, 512))


def wide_inputs(d: int, dv: int, page: int | None, heads: tuple[int, int], seqlen_q: int,
                append: bool, seed: int, capacity: int = CAPACITY) -> Inputs:
    """Inputs with Q/K of ``d`` and V of ``dv`` (dead cache rows NaN, as drawn by the
    family): a V wider than one kernel's (256) gets its further columns drawn beside the
    first 256 (fresh values, the same dead rows)."""
    narrow = min(dv, 256)
    problem = Problem(d, DType.BF16, op="decode", head_dim_v=None if narrow == d else narrow)
    shape = Shape(BATCH, heads[0], heads[1], seqlen_q, capacity)
    new = seqlen_q if append else 0
    room = DecodeCase(page, (0,) * BATCH, 0, 1).capacity(shape) - new
    lengths = (room, random.Random(seed).randrange(0, room))
    drawn = DECODE.random_inputs(problem, shape, "cpu", seed=seed,
                                 case=DecodeCase(page, lengths, new, 1))
    t = dict(drawn.tensors)
    if dv > narrow:
        gen = torch.Generator().manual_seed(seed + 1)
        for name in ("v_cache", "v_new"):
            if name in t:
                x = t[name]
                extra = torch.randn(*x.shape[:3], dv - narrow, generator=gen).to(x.dtype)
                extra.masked_fill_(torch.isnan(x[..., :1]), float("nan"))
                t[name] = torch.cat([x, extra], dim=-1)
        t["v_cache_before"] = t["v_cache"].clone()
    return Inputs(t, drawn.scalars)


API_GRID = tuple(itertools.product(
    API_DIMS, FEATURES + (("sinks", None, ""),), (None, 3, 16), HEADS, (False, True), (1, 3),
    (None, 3)))


def _check_api(params: tuple[Any, ...]) -> None:
    (d, dv), feats, page, heads, causal, seqlen_q, splits = params
    seed = SEED * 7919 + API_GRID.index(params)
    print(f"seed={seed} (FLASHTUNE_TEST_SEED={SEED}) {params}")
    inputs = wide_inputs(d, dv, page, heads, seqlen_q, True, seed)
    sinks = None
    if feats[0] == "sinks":
        sinks = torch.randn(heads[0], generator=torch.Generator().manual_seed(seed)) * 3 + 1
        feats = (None, None, "")
    shape = Shape(BATCH, heads[0], heads[1], seqlen_q, CAPACITY)
    inputs = with_features(inputs, feats, seed, shape)
    window, cap, slopes = feats
    t = inputs.tensors
    kwargs: dict[str, Any] = {"sinks": sinks, "num_splits": splits}
    if window is not None:
        kwargs["window_size"] = window
    if cap is not None:
        kwargs["softcap"] = cap
    if slopes:
        kwargs["alibi_slopes"] = t["alibi_slopes"]
    out, lse = call_api(inputs, causal=causal, return_lse=True, backend="emulator", **kwargs)
    assert out.shape == (BATCH, seqlen_q, heads[0], dv)
    values = VariantValues((window[0], 0 if causal else window[1]) if window else (-1, -1),
                           cap or 0.0, t.get("alibi_slopes"))
    ref_o, ref_lse = attention_with_kvcache_reference(inputs, causal and window is None,
                                                      values)
    if sinks is not None:
        ref_o, ref_lse = join_sinks(ref_o, ref_lse, sinks)
    for name, got, want, tol in (("O", out, ref_o, O_TOLERANCE[DType.BF16]),
                                 ("LSE", lse, ref_lse, LSE_TOLERANCE)):
        _, _, wrong = close_enough(name, got, want, tol)
        assert not wrong, f"{params} seed {SEED}: {wrong}"
    for name, want in expected_caches(inputs).items():
        got = t[name]
        assert ((got == want) | (torch.isnan(got) & torch.isnan(want))).all(), name


def _api_sample() -> list[tuple[Any, ...]]:
    """Gemma 4's 512/512 (V in two chunks) with a drawn feature, and one drawn case of the
    other pairs."""
    rng = random.Random(f"{SEED}-decode-wide-api")
    return [rng.choice([c for c in API_GRID if c[0] == (512, 512)]),
            rng.choice([c for c in API_GRID if c[0] != (512, 512)])]


@pytest.mark.emulator
@pytest.mark.parametrize("params", _api_sample(), ids=str)
def test_attention_with_kvcache_at_wide_head_dims(params: tuple[Any, ...]) -> None:
    _check_api(params)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("params", API_GRID, ids=str)
def test_attention_with_kvcache_wide_grid(params: tuple[Any, ...]) -> None:
    _check_api(params)


def test_the_reference_sees_v_columns_past_the_first_chunk() -> None:
    """The float64 reference's O columns 256..511 are P times V's own columns there (a test
    of the chunked API would not fail if the reference ignored them)."""
    inputs = wide_inputs(512, 512, 16, (8, 2), 2, True, 1)
    o, _ = attention_with_kvcache_reference(inputs, False)
    assert o.shape[-1] == 512
    assert not torch.allclose(o[..., 256:], o[..., :256])


def _q_and_cache(d: int, dv: int, dtype: torch.dtype = torch.bfloat16
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.zeros(1, 1, 2, d, dtype=torch.bfloat16)
    k_cache = torch.zeros(1, 16, 2, d, dtype=dtype)
    v_cache = torch.zeros(1, 16, 2, dv, dtype=dtype)
    return q, k_cache, v_cache, torch.tensor([3], dtype=torch.int32)


@pytest.mark.parametrize("d, dv, match", [
    (520, 520, r"head_dim=520 \(q and k_cache\).*multiple of 8 <= 256 or one of \(512, 576\)"),
    (512, 520, r"v_cache's head dim 520.*multiple of 8 <= 512.*column chunks of 256"),
    (512, 1024, r"v_cache's head dim 1024.*<= 512"),
])
def test_head_dims_past_the_limits_are_refused_naming_them(d: int, dv: int, match: str
                                                           ) -> None:
    q, k_cache, v_cache, lens = _q_and_cache(d, dv)
    with pytest.raises(InvalidInput, match=match):
        flashtune.attention_with_kvcache(q, k_cache, v_cache, lens, backend="emulator")


def test_new_rows_must_take_the_caches_head_dims() -> None:
    q, k_cache, v_cache, lens = _q_and_cache(512, 256)
    k = torch.zeros(1, 1, 2, 512, dtype=torch.bfloat16)
    with pytest.raises(InvalidInput, match=r"head_dim 512 for k and 256 for v"):
        flashtune.attention_with_kvcache(q, k_cache, v_cache, lens, k=k, v=k.clone(),
                                         backend="emulator")


def test_an_e4m3_cache_at_a_wide_head_dim_is_refused_naming_the_kernel() -> None:
    q, k_cache, v_cache, lens = _q_and_cache(512, 512, torch.float8_e4m3fn)
    with pytest.raises(InvalidInput, match=r"e4m3 cache of head dims 512.*decode8.*at most "
                                           r"256.*16-bit cache"):
        flashtune.attention_with_kvcache(q, k_cache, v_cache, lens, backend="emulator")


def test_the_wide_defaults_fit_each_arch() -> None:
    """Every arch class has a default tile for 512 and 576 whose shared memory fits it (the
    defaults' registers were measured with NVRTC: the compile tests below)."""
    for d, arch in itertools.product((512, 576), ARCHS):
        problem = Problem(d, DType.BF16, op="decode", head_dim_v=256)
        config = DECODE.default_config(problem, get_arch(arch))
        assert DECODE.rules(problem, config, get_arch(arch)) is None


@pytest.mark.parametrize("arch, dims, switches", [
    ("sm_80", (512, 256), {}),
    pytest.param("sm_90", (512, 256), {}, marks=pytest.mark.sweep),
    pytest.param("sm_86", (512, 256), {}, marks=pytest.mark.sweep),
    pytest.param("sm_80", (576, 256), {}, marks=pytest.mark.sweep),
    pytest.param("sm_90", (576, 256), {"window": True, "softcap": True, "alibi": True},
                 marks=pytest.mark.sweep),
    pytest.param("sm_90", (512, 256), {"window": True, "softcap": True, "alibi": True},
                 marks=pytest.mark.sweep),
], ids=str)
def test_wide_defaults_compile_without_spills(arch: str, dims: tuple[int, int],
                                              switches: dict[str, bool]) -> None:
    from flashtune.toolchain.compiler import compile_source

    problem = Problem(dims[0], DType.BF16, op="decode", head_dim_v=dims[1],
                      **cast(dict[str, Any], switches))
    config = DECODE.default_config(problem, get_arch(arch))
    resources = compile_source(families.render(problem, config), arch).resources
    assert resources.spill_bytes == 0 and resources.registers > 0, (
        f"{problem.key()} {config.key()} on {arch}: {resources}")


def test_explain_kvcache_names_the_wide_kernels() -> None:
    """explain_kvcache of Gemma 4's 512 / 512 explains the first column chunk's kernels:
    decode at Q/K 512 beside V's 256, and the combine of 256 columns."""
    q, k_cache, v_cache, lens = _q_and_cache(512, 512)
    decode, combine = flashtune.explain_kvcache(q, k_cache, v_cache, lens, backend="emulator",
                                                arch="sm_90")
    assert decode.problem.key() == "decode_d512v256_bf16_full"
    assert combine.problem.head_dim == 256
    assert decode.config.block_m == 64 and decode.config.num_stages == 2


def test_flops_and_bytes_count_each_operand_at_its_own_head_dim() -> None:
    """Q K^T at Q/K's 512 and P V at V's 256: the FLOPs and the cache bytes of a split
    problem lie between those of the plain problems of either width."""
    shape = Shape(2, 8, 2, 1, 1024)
    wide = Problem(512, DType.BF16, op="decode", head_dim_v=256)
    narrow = Problem(256, DType.BF16, op="decode")
    assert DECODE.flops(wide, shape) == 2.0 * 2 * 1 * 1024 * 8 * (512 + 256)
    kv = 2 * 2 * 1024 * (512 + 256) * 2  # batch x kv heads x keys x (K + V dims) x bytes
    q_o = 2 * 8 * 1 * (512 * 2 + 256 * 2 + 4)
    assert DECODE.min_bytes(wide, shape) == kv + q_o > DECODE.min_bytes(narrow, shape)
