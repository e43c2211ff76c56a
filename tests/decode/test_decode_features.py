"""Decoding with the forward's features (sliding window, softcap, ALiBi) in the split-KV
kernel, on the emulator against the float64 reference (``decode.reference`` over
``fwd.reference.scaled_scores``): paged (page sizes 1, 3, 16) and unpaged caches, MHA and
GQA, appended rows, several splits, outputs poisoned with NaN; a seeded sample in the
default run, the whole grid behind the sweep marker; and the key tiles a window skips. The
API's features and the NVRTC builds of the defaults run each feature every run, their
repetitions (another arch, a feature alone that a combined case also passes) drawn with the
run's seed, the rest under -m sweep."""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import dataclass
from typing import Any, cast

import pytest
import torch
from decode_cases import call_api, run_emulated
from sampling import seeded_part

from flashtune import families
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families.base import Inputs, close_enough
from flashtune.families.checks import LSE_TOLERANCE, O_TOLERANCE
from flashtune.families.decode import DECODE, DecodeCase
from flashtune.families.decode.reference import (
    attention_with_kvcache_reference,
    expected_caches,
)
from flashtune.families.fwd.variants import VariantValues
from flashtune.runtime.backends.emulator import EmulatorLoadedKernel
from flashtune.runtime.launch import PreparedLaunch

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
CONFIG = KernelConfig(64, 64, 4, 2)
CAPACITY = 200
BATCH = 2

#: (window, softcap, slopes shape): None/"" for a feature that is off; "h" slopes of shape
#: (heads_q,), "bh" of (batch, heads_q).
FEATURES: tuple[tuple[tuple[int, int] | None, float | None, str], ...] = (
    ((3, 5), None, ""), ((20, 0), None, ""), ((0, 0), None, ""), ((70, -1), None, ""),
    ((-1, 2), None, ""), (None, 5.0, ""), (None, 30.0, ""), (None, None, "h"),
    (None, None, "bh"), ((16, 0), 30.0, "bh"), ((5, 3), 5.0, "h"),
)
PAGE_SIZES: tuple[int | None, ...] = (None, 1, 3, 16)
#: (heads_q, heads_kv): MHA, GQA group 4.
HEADS = ((2, 2), (8, 2))
SEQLEN_Q = (1, 3)
SPLITS = (1, 3)


@dataclass(frozen=True)
class FeatureCase:
    window: tuple[int, int] | None
    softcap: float | None
    slopes: str
    page_size: int | None
    heads: tuple[int, int]
    seqlen_q: int
    append: bool
    num_splits: int
    seed: int

    @property
    def key(self) -> str:
        parts = [f"w{self.window[0]}_{self.window[1]}" if self.window else "",
                 f"cap{self.softcap:g}" if self.softcap else "",
                 f"alibi_{self.slopes}" if self.slopes else ""]
        paged = "unpaged" if self.page_size is None else f"page{self.page_size}"
        return (f"{'-'.join(p for p in parts if p)}-{paged}-h{self.heads[0]}x{self.heads[1]}"
                f"-q{self.seqlen_q}-{'append' if self.append else 'noappend'}"
                f"-s{self.num_splits}")

    def problem(self) -> Problem:
        return Problem(64, DType.FP16, op="decode", window=self.window is not None,
                       softcap=self.softcap is not None, alibi=bool(self.slopes))

    def shape(self) -> Shape:
        return Shape(BATCH, self.heads[0], self.heads[1], self.seqlen_q, CAPACITY)


GRID = tuple(
    FeatureCase(*features, page, heads, nq, append, splits, seed=i)
    for i, (features, page, heads, nq, append, splits) in enumerate(itertools.product(
        FEATURES, PAGE_SIZES, HEADS, SEQLEN_Q, (False, True), SPLITS)))


def sample(seed: int) -> list[FeatureCase]:
    """One case of every feature combination, page sizes cycling, the rest drawn."""
    rng = random.Random(seed)
    return [rng.choice([c for c in GRID if c.window == w and c.softcap == cap
                        and c.slopes == sl and c.page_size == PAGE_SIZES[i % len(PAGE_SIZES)]])
            for i, (w, cap, sl) in enumerate(FEATURES)]


def inputs_of(case: FeatureCase) -> Inputs:
    """Drawn inputs (lengths: one sequence at the full room, one mid-way) with the case's
    own feature values."""
    problem, shape = case.problem(), case.shape()
    new = case.seqlen_q if case.append else 0
    probe = DecodeCase(case.page_size, (0,) * BATCH, 0, case.num_splits)
    room = probe.capacity(shape) - new
    lengths = (room, random.Random(case.seed).randrange(0, room))
    decode_case = DecodeCase(case.page_size, lengths, new, case.num_splits)
    seed = SEED * 100003 + case.seed
    print(f"seed={seed} (FLASHTUNE_TEST_SEED={SEED}) {case.key}")
    drawn = DECODE.random_inputs(problem, shape, "cpu", seed=seed, case=decode_case)
    scalars = dict(drawn.scalars)
    tensors = dict(drawn.tensors)
    if case.window is not None:
        scalars["window_left"], scalars["window_right"] = case.window
    if case.softcap is not None:
        scalars["softcap"] = case.softcap
    if case.slopes:
        gen = torch.Generator().manual_seed(seed)
        size = (shape.heads_q,) if case.slopes == "h" else (BATCH, shape.heads_q)
        tensors["alibi_slopes"] = torch.rand(size, generator=gen)
    return Inputs(tensors, scalars)


def _run(problem: Problem, shape: Shape, inputs: Inputs, counters: bool = False
         ) -> tuple[PreparedLaunch, EmulatorLoadedKernel]:
    return run_emulated(problem, shape, inputs, CONFIG, counters)


def _check(case: FeatureCase) -> None:
    launch, _ = _run(case.problem(), case.shape(), inputs_of(case))
    verdict = launch.verdict()
    assert verdict.ok, f"{case.key} (seed {SEED}): {verdict.message}"


@pytest.mark.emulator
@pytest.mark.parametrize("case", sample(SEED), ids=lambda c: c.key)
def test_decode_features_match_float64_on_a_sample(case: FeatureCase) -> None:
    _check(case)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("case", GRID, ids=lambda c: c.key)
def test_decode_features_whole_grid(case: FeatureCase) -> None:
    _check(case)


def test_the_reference_sees_the_features() -> None:
    """The reference with a feature differs from the plain one (a test that cannot fail is
    no test): each feature alone changes the partial outputs."""
    base = FeatureCase(None, None, "", 16, (8, 2), 3, True, 3, seed=1)
    plain = DECODE.reference(base.problem(), inputs_of(base))
    for window, cap, slopes in (((3, 0), None, ""), (None, 5.0, ""), (None, None, "bh")):
        case = FeatureCase(window, cap, slopes, 16, (8, 2), 3, True, 3, seed=1)
        got = DECODE.reference(case.problem(), inputs_of(case))
        finite = torch.isfinite(plain["lse_part"]) & torch.isfinite(got["lse_part"])
        assert not torch.allclose(got["lse_part"][finite], plain["lse_part"][finite]), case.key


@pytest.mark.emulator
@pytest.mark.parametrize("splits", [1, 4])
def test_a_narrow_window_skips_key_tiles(splits: int) -> None:
    """One query row over 256 keys in tiles of 64 with the window (10, 0): only keys
    [245, 255] are seen, in the last tile, so a quarter of the unbounded window's
    tensor-core work; with 4 splits of 64 keys, three splits see nothing and write the
    empty partial (LSE -inf, O 0) the reference and the combine expect."""
    shape = Shape(1, 4, 1, 1, 256)
    counts = {}
    for window in ((10, 0), (-1, -1)):
        case = FeatureCase(window, None, "", None, (4, 1), 1, False, splits, seed=0)
        problem = case.problem()
        inputs = DECODE.random_inputs(problem, shape, "cpu", seed=SEED,
                                      case=DecodeCase(None, (256,), 0, splits))
        inputs = Inputs(inputs.tensors, {**inputs.scalars, "window_left": window[0],
                                         "window_right": window[1]})
        launch, kernel = _run(problem, shape, inputs, counters=True)
        verdict = launch.verdict()
        assert verdict.ok, f"seed {SEED}: {verdict.message}"
        got = kernel.last_counters
        assert got is not None
        counts[window] = got.mma_count
    assert counts[(10, 0)] * 4 == counts[(-1, -1)], counts


#: The API's features: a window under the causal mask, (heads,) slopes and all three
#: together (bh slopes) every run; a window alone and a softcap alone (each also inside the
#: three) one of the two drawn with the run's seed, the other under -m sweep.
API_CASES = [((20, 5), None, "", True, 16), (None, None, "h", False, 1),
             ((16, 0), 5.0, "bh", False, 16),
             *seeded_part([((7, 2), None, "", False, None), (None, 30.0, "", False, 3)], 1,
                          "decode-features-api", several=True)]


@pytest.mark.emulator
@pytest.mark.parametrize("window, softcap, slopes, causal, page", API_CASES)
def test_attention_with_kvcache_with_features_matches_float64(
        window: tuple[int, int] | None, softcap: float | None, slopes: str, causal: bool,
        page: int | None) -> None:
    """The API's window_size, softcap and alibi_slopes (split + combine) against float64
    attention over each sequence's keys; causal with a window is the window (left, 0)."""
    case = FeatureCase(window, softcap, slopes, page, (8, 2), 3, True, 3, seed=7)
    inputs = inputs_of(case)
    t = inputs.tensors
    kwargs: dict[str, Any] = {}
    if window is not None:
        kwargs["window_size"] = window
    if softcap is not None:
        kwargs["softcap"] = softcap
    if slopes:
        kwargs["alibi_slopes"] = t["alibi_slopes"]
    out, lse = call_api(inputs, causal=causal, return_lse=True, backend="emulator",
                        num_splits=case.num_splits, **kwargs)
    values = VariantValues((window[0], 0 if causal else window[1]) if window else (-1, -1),
                           softcap or 0.0, t.get("alibi_slopes"))
    ref_o, ref_lse = attention_with_kvcache_reference(inputs, False, values)
    for name, got, want, tol in (("O", out, ref_o, O_TOLERANCE[DType.FP16]),
                                 ("LSE", lse, ref_lse, LSE_TOLERANCE)):
        _, _, wrong = close_enough(name, got, want, tol)
        assert not wrong, f"seed {SEED}: {wrong}"
    for name, want in expected_caches(inputs).items():
        got = t[name]
        assert ((got == want) | (torch.isnan(got) & torch.isnan(want))).all(), name


# Not yet without spills (ptxas keeps these at 168 registers): softcap on sm_90 (16 bytes)
# and all three features on sm_80 (8 bytes); they compile and are verified above.
# Every feature each run: window and ALiBi on an arch drawn with the run's seed (the other
# under -m sweep).
@pytest.mark.parametrize("arch, switches", [
    *seeded_part([("sm_80", {"window": True}), ("sm_90", {"window": True})], 1,
                 "decode-features-nvrtc-window", several=True),
    ("sm_80", {"softcap": True}),
    *seeded_part([("sm_80", {"alibi": True}), ("sm_90", {"alibi": True})], 1,
                 "decode-features-nvrtc-alibi", several=True),
    ("sm_90", {"window": True, "softcap": True, "alibi": True})],
    ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_feature_defaults_compile_with_nvrtc_without_spills(arch: str,
                                                            switches: dict[str, bool]) -> None:
    from flashtune.codegen.arch import get_arch
    from flashtune.toolchain.compiler import compile_source

    problem = Problem(128, DType.BF16, op="decode", **cast(dict[str, Any], switches))
    config = DECODE.default_config(problem, get_arch(arch))
    kernel = compile_source(families.render(problem, config), arch)
    assert kernel.resources.spill_bytes == 0 and kernel.resources.registers > 0
