"""Split-KV decoding over an e4m3 KV cache (the ``decode8`` family) on the emulator against
float64: the reference is the 16-bit kernel's float64 attention over the dequantised caches
(each e4m3 byte times its (batch, KV head)'s descale) and the new rows as the kernel quantises
them, e4m3(x / descale) by torch's conversion; the caches after the call must equal, byte for
byte, the caches with those rows appended. Outputs are poisoned with NaN. Page sizes 1, 3, 16,
64, 100, 256 and unpaged, MHA/GQA/MQA, causal or not, appended rows, one to many splits, the
window/softcap/ALiBi features; a seeded sample by default (unpaged and two drawn page
sizes), the grid behind the sweep marker.
Also: the emulator's byte counters (the cache bytes are half the bf16 cache's on the same
problem), the saturation of appended rows, and NVRTC builds of the defaults without spills.
"""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import dataclass

import pytest
import torch
from decode_cases import run_emulated
from sampling import seeded_part

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.dtypes import Fp8Type
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.errors import InvalidConfig
from flashtune.families.base import Inputs
from flashtune.families.checks import O_TOLERANCE
from flashtune.families.decode import DECODE, O_BOUND, DecodeCase
from flashtune.families.decode.fp8 import DECODE_FP8, E4M3_MAX, dequantised, quantise_e4m3
from flashtune.runtime.backends.emulator import EmulatorLoadedKernel
from flashtune.runtime.launch import PreparedLaunch

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
CONFIG = KernelConfig(64, 64, 4, 2)
DIM = 64
CAPACITY = 260
BATCH = 2
PAGE_SIZES: tuple[int | None, ...] = (None, 1, 3, 16, 64, 100, 256)
#: (heads_q, heads_kv): MHA, GQA group 4, MQA group 4.
HEADS = ((2, 2), (8, 2), (4, 1))
SEQLEN_Q = (1, 3)
SPLITS = (1, 3, 16)
#: (window, softcap, ALiBi slopes): the features, each alone, or none.
FEATURES: tuple[tuple[tuple[int, int] | None, float | None, bool], ...] = (
    (None, None, False), ((20, 0), None, False), (None, 5.0, False), (None, None, True))


@dataclass(frozen=True)
class Fp8Case:
    page_size: int | None
    heads: tuple[int, int]
    seqlen_q: int
    causal: bool
    append: bool
    num_splits: int
    dtype: DType
    features: tuple[tuple[int, int] | None, float | None, bool]
    seed: int

    @property
    def key(self) -> str:
        window, cap, alibi = self.features
        extra = "".join([f"-w{window[0]}_{window[1]}" if window else "",
                         f"-cap{cap:g}" if cap else "", "-alibi" if alibi else ""])
        paged = "unpaged" if self.page_size is None else f"page{self.page_size}"
        return (f"{paged}-h{self.heads[0]}x{self.heads[1]}-q{self.seqlen_q}-"
                f"{'causal' if self.causal else 'full'}-"
                f"{'append' if self.append else 'noappend'}-s{self.num_splits}-"
                f"{self.dtype.value}{extra}")

    def problem(self) -> Problem:
        window, cap, alibi = self.features
        return Problem(DIM, self.dtype, causal=self.causal, op="decode8",
                       kv_dtype=Fp8Type.E4M3, window=window is not None,
                       softcap=cap is not None, alibi=alibi)

    def shape(self) -> Shape:
        return Shape(BATCH, self.heads[0], self.heads[1], self.seqlen_q, CAPACITY)


GRID = tuple(
    Fp8Case(page, heads, nq, causal, append, splits, dtype, features, seed=i)
    for i, (page, heads, nq, causal, append, splits, dtype, features) in enumerate(
        itertools.product(PAGE_SIZES, HEADS, SEQLEN_Q, (False, True), (False, True), SPLITS,
                          (DType.BF16, DType.FP16), FEATURES))
    if not (causal and features[0] is not None))


def sample(seed: int) -> list[Fp8Case]:
    """bf16 and plain: one unpaged case and two of page sizes drawn from ``seed``, one
    causal and one full (one kernel build each), the rest drawn too; then one fp16 case and
    one of each feature (every page size: the grid, under -m sweep)."""
    rng = random.Random(seed)
    plain = [c for c in GRID if c.features == FEATURES[0] and c.dtype is DType.BF16]
    causal = rng.random() < 0.5
    picked = [rng.choice([c for c in plain if c.page_size is None])]
    picked += [rng.choice([c for c in plain if c.page_size == page and c.causal == mask])
               for page, mask in zip(rng.sample(PAGE_SIZES[1:], 2), (causal, not causal),
                                     strict=True)]
    picked.append(rng.choice([c for c in GRID if c.dtype is DType.FP16
                              and c.features == FEATURES[0] and c.append]))
    picked += [rng.choice([c for c in GRID if c.features == f and c.dtype is DType.BF16])
               for f in FEATURES[1:]]
    return picked


def inputs_of(case: Fp8Case) -> Inputs:
    """Drawn inputs: one sequence at the full room, one drawn; the case's feature values."""
    shape = case.shape()
    new = case.seqlen_q if case.append else 0
    room = DecodeCase(case.page_size, (0,) * BATCH, 0, case.num_splits).capacity(shape) - new
    lengths = (room, random.Random(case.seed).randrange(0, room))
    seed = SEED * 100003 + case.seed
    print(f"seed={seed} (FLASHTUNE_TEST_SEED={SEED}) {case.key}")
    drawn = DECODE_FP8.random_inputs(case.problem(), shape, "cpu", seed=seed,
                                     case=DecodeCase(case.page_size, lengths, new,
                                                     case.num_splits))
    window, cap, alibi = case.features
    scalars, tensors = dict(drawn.scalars), dict(drawn.tensors)
    if window is not None:
        scalars["window_left"], scalars["window_right"] = window
    if cap is not None:
        scalars["softcap"] = cap
    if alibi:
        tensors["alibi_slopes"] = torch.rand(shape.heads_q,
                                             generator=torch.Generator().manual_seed(seed))
    return Inputs(tensors, scalars)


def _run(problem: Problem, shape: Shape, inputs: Inputs, counters: bool = False
         ) -> tuple[PreparedLaunch, EmulatorLoadedKernel]:
    return run_emulated(problem, shape, inputs, CONFIG, counters)


def _check(case: Fp8Case) -> None:
    launch, _ = _run(case.problem(), case.shape(), inputs_of(case))
    verdict = launch.verdict()
    assert verdict.ok, f"{case.key} (seed {SEED}): {verdict.message}"


@pytest.mark.emulator
@pytest.mark.parametrize("case", sample(SEED), ids=lambda c: c.key)
def test_fp8_cache_decode_matches_float64_on_a_sample(case: Fp8Case) -> None:
    _check(case)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("case", GRID, ids=lambda c: c.key)
def test_fp8_cache_decode_whole_grid(case: Fp8Case) -> None:
    _check(case)


def test_the_reference_applies_both_descales() -> None:
    """A test that cannot fail is no test: the reference with either descale set to 1
    differs from the real one (O for V's, the LSE for K's)."""
    case = Fp8Case(16, (8, 2), 3, False, True, 3, DType.BF16, FEATURES[0], seed=1)
    inputs = inputs_of(case)
    ref = DECODE_FP8.reference(case.problem(), inputs)
    finite = torch.isfinite(ref["lse_part"])
    for name, out in (("k_descale", "lse_part"), ("v_descale", "o_part")):
        t = {**inputs.tensors, name: torch.ones_like(inputs.tensors[name])}
        other = DECODE_FP8.reference(case.problem(), Inputs(t, inputs.scalars))
        mask = finite if out == "lse_part" else finite[..., None].expand_as(ref[out])
        assert not torch.allclose(other[out][mask], ref[out][mask]), name


@pytest.mark.emulator
def test_a_shared_prefix_page_is_dequantised_with_each_sequences_factors() -> None:
    """Two sequences read one e4m3 page (a shared prefix, no rows appended) with different
    descale factors: each sees it scaled by its own, as the reference does."""
    case = Fp8Case(16, (8, 2), 1, False, False, 3, DType.BF16, FEATURES[0], seed=5)
    inputs = inputs_of(case)
    t = dict(inputs.tensors)
    t["block_table"] = t["block_table"].clone()
    t["block_table"][1, 0] = t["block_table"][0, 0]
    t["cache_seqlens"] = torch.tensor([CAPACITY - 4, 40], dtype=torch.int32)
    assert not torch.equal(t["k_descale"][0], t["k_descale"][1])
    launch, _ = _run(case.problem(), case.shape(), Inputs(t, inputs.scalars))
    verdict = launch.verdict()
    assert verdict.ok, f"seed {SEED}: {verdict.message}"


@pytest.mark.emulator
def _saturating() -> tuple[Problem, Shape, Inputs]:
    """A GQA problem whose appended rows are 20 % far beyond 448 * descale (they saturate)
    and 20 % tiny (they round to e4m3 subnormals)."""
    case = Fp8Case(16, (8, 2), 3, False, True, 3, DType.BF16, FEATURES[0], seed=3)
    inputs = inputs_of(case)
    t = dict(inputs.tensors)
    gen = torch.Generator().manual_seed(SEED)
    for name in ("k_new", "v_new"):
        big = torch.rand(t[name].shape, generator=gen) < 0.2
        tiny = torch.rand(t[name].shape, generator=gen) < 0.2
        x = t[name].float()
        x = torch.where(big, x * 4000.0, torch.where(tiny, x * 2.0 ** -8, x))
        t[name] = x.to(t[name].dtype)
    return case.problem(), case.shape(), Inputs(t, inputs.scalars)


def test_appended_rows_saturate_and_round_as_torch_converts() -> None:
    """New rows far beyond 448 * descale saturate to +-448 and tiny ones round to e4m3
    subnormals, both byte for byte as torch's (x / descale).clamp(-448, 448).to(e4m3) (the
    verdict compares the caches as bytes); saturation is exercised."""
    problem, shape, inputs = _saturating()
    t = inputs.tensors
    scale = t["k_descale"][:, None, :, None]
    saturated = quantise_e4m3(t["k_new"], scale).float().abs() == E4M3_MAX
    assert saturated.any() and not (t["k_new"].float() / scale).abs().le(E4M3_MAX).all()
    launch, _ = _run(problem, shape, inputs)
    verdict = launch.verdict()
    assert verdict.ok, f"seed {SEED}: {verdict.message}"


def test_partial_o_is_allowed_p_rounding_times_p_abs_v_and_no_more() -> None:
    """Beyond the 16-bit tolerance, partial O may be off by one unit roundoff of q's type
    times P |V| (the kernel rounds P before P V; saturated V is up to 448 x 4, where that
    rounding dwarfs the tolerance), and no more: the reference passes as the kernel's output,
    its element of largest allowance moved 0.99x that allowance passes, 1.01x fails."""
    problem, shape, inputs = _saturating()
    ref = DECODE_FP8.reference(problem, inputs)
    bound, o = ref[O_BOUND], ref["o_part"]
    v = dequantised(inputs).tensors
    largest_v = max(float(v[n].abs().nan_to_num(0.0).max()) for n in ("v_cache_before", "v_new"))
    unit = 2.0 ** -8  # bf16's unit roundoff
    assert float(bound.max()) <= unit * largest_v * (1 + 1e-12)  # a split of one key: equal
    assert float(bound.max()) > 10 * O_TOLERANCE[DType.BF16].atol  # saturation matters here
    i = int(bound.argmax())
    tol = O_TOLERANCE[DType.BF16]
    allowed = tol.atol + tol.rtol * abs(float(o.flatten()[i])) + float(bound.flatten()[i])
    for factor, ok in ((0.0, True), (0.99, True), (1.01, False)):
        moved = o.clone()
        moved.view(-1)[i] += factor * allowed
        outputs = {**ref, "o_part": moved, "status": torch.zeros(1, dtype=torch.int32)}
        verdict = DECODE_FP8.compare(problem, shape, outputs, ref)
        assert verdict.ok == ok, (factor, verdict.message)


@pytest.mark.emulator
def test_cache_bytes_are_half_the_bf16_caches() -> None:
    """The emulator's counters on one problem (GQA group 4, page 16, 3 splits, 3 appended
    rows): the e4m3 kernel reads each cached K/V value once as one byte (read-only loads)
    and the new rows once as bf16; the bf16 kernel reads the cached values as two bytes
    (cp.async); Q's bytes are the same."""
    shape = Shape(BATCH, 8, 2, 3, CAPACITY)
    lengths = (CAPACITY - 3 - 4, 101)
    case = DecodeCase(16, lengths, 3, 3)
    fp8_problem = Problem(DIM, DType.BF16, op="decode8", kv_dtype=Fp8Type.E4M3)
    bf16_problem = Problem(DIM, DType.BF16, op="decode")
    counts = {}
    for problem, family in ((fp8_problem, DECODE_FP8), (bf16_problem, DECODE)):
        inputs = family.random_inputs(problem, shape, "cpu", seed=SEED, case=case)
        launch, kernel = _run(problem, shape, inputs, counters=True)
        verdict = launch.verdict()
        assert verdict.ok, f"seed {SEED}: {verdict.message}"
        counts[problem.op] = kernel.last_counters
    fp8, bf16 = counts["decode8"], counts["decode"]
    assert fp8 is not None and bf16 is not None
    values = 2 * shape.heads_kv * DIM  # K and V values of one row of every kv head
    cached, new = values * sum(lengths), values * 3 * BATCH
    q_bytes = fp8.cp_async_bytes
    assert fp8.ldg_bytes == cached * 1 + new * 2, (fp8.ldg_bytes, cached, new)
    assert bf16.cp_async_bytes == q_bytes + cached * 2 + new * 2, (bf16.cp_async_bytes,
                                                                   q_bytes)
    fp8_cache, bf16_cache = fp8.ldg_bytes - 2 * new, bf16.cp_async_bytes - q_bytes - 2 * new
    assert 2 * fp8_cache == bf16_cache
    print(f"cache bytes: e4m3 {fp8_cache}, bf16 {bf16_cache}")


def _compile_default(arch: str, head_dim: int) -> None:
    from flashtune.toolchain.compiler import compile_source

    problem = Problem(head_dim, DType.BF16, op="decode8", kv_dtype=Fp8Type.E4M3)
    config = DECODE_FP8.default_config(problem, get_arch(arch))
    kernel = compile_source(families.render(problem, config), arch)
    print(f"{arch} {problem.key()} {config.key()}: {kernel.resources.registers} registers")
    assert kernel.resources.spill_bytes == 0 and kernel.resources.registers > 0


@pytest.mark.parametrize("arch", seeded_part(["sm_89", "sm_90"], 1, "decode-fp8-nvrtc"))
def test_defaults_compile_with_nvrtc_without_spills(arch: str) -> None:
    """Head dim 128 by default (NVRTC 13: 170 registers on sm_89, 171 on sm_90), on one
    arch drawn with the run's seed (the other under -m sweep)."""
    _compile_default(arch, 128)


@pytest.mark.sweep
@pytest.mark.parametrize("arch", ["sm_89", "sm_90"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_other_head_dims_compile_with_nvrtc_without_spills(arch: str, head_dim: int) -> None:
    _compile_default(arch, head_dim)


def test_sm80_is_refused_naming_the_arch_and_the_fix() -> None:
    problem = Problem(128, DType.BF16, op="decode8", kv_dtype=Fp8Type.E4M3)
    with pytest.raises(InvalidConfig, match="sm_89 or later"):
        DECODE_FP8.default_config(problem, get_arch("sm_80"))
    assert "sm_89" in (DECODE_FP8.rules(problem, CONFIG, get_arch("sm_80")) or "")
    assert DECODE_FP8.rules(problem, CONFIG, get_arch("sm_89")) is None


def test_the_key_names_the_cache_type_and_16bit_problems_are_refused() -> None:
    problem = Problem(128, DType.BF16, op="decode8", kv_dtype=Fp8Type.E4M3)
    assert problem.key() == "decode8_d128_bf16-e4m3-bf16_full"
    with pytest.raises(Exception, match="element types"):
        DECODE_FP8.check_problem(Problem(128, DType.BF16, op="decode8"))
