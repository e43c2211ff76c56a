"""Attention sinks (gpt-oss) in the forward kernel and in the split combine, in the CPU
emulator against the float64 reference: each head's logit joins every row's softmax
denominator (LSE = log(exp(sink) + sum exp(s)), O = P V with P = exp(s - LSE)), alone and
with causal masks, sliding windows, softcaps, ALiBi, varlen and GQA, fp16 and bf16.

Every launch goes through the family (``random_inputs`` from a printed seed: the sinks are
drawn by ``variants.random_sinks``, one head's above most rows' LSE; NaN-poisoned outputs;
``compare`` against ``reference``). The default run checks a seeded sample (one case, one
dtype of the combine); ``-m sweep`` runs every case and the grid over head dims, dtypes and
feature sets. Rows that see no key (a narrow
window, a zero-length sequence) get O = 0 and LSE = sink.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch
from test_kernel_variants import HEAD_DIMS, Values, run_case

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families import render
from flashtune.families.base import Inputs
from flashtune.families.combine import COMBINE
from flashtune.families.fwd import FORWARD
from flashtune.families.fwd.variants import SOFTCAPS, WINDOW_SIZES
from flashtune.runtime.backends.emulator import EmulatorBackend
from flashtune.toolchain.compiler import compile_source

pytestmark = pytest.mark.emulator

_RNG = random.Random(f"sinks-{os.environ['FLASHTUNE_TEST_SEED']}")


def _seed() -> int:
    return _RNG.randrange(2**31)


def _window() -> tuple[int, int]:
    return _RNG.choice([p for p in itertools.product(WINDOW_SIZES, WINDOW_SIZES)
                        if p != (-1, -1)])


_C = KernelConfig(64, 32, 4, 2)
#: (problem, config, shape, values): sinks alone and with every other feature.
CASES: tuple[tuple[Problem, KernelConfig, Shape, Values], ...] = (
    # Sinks alone, fp16, GQA 4:2, lengths off the tile grid.
    (Problem(64, DType.FP16, sinks=True), _C, Shape(2, 4, 2, 100, 130), Values()),
    # Causal with Nq > Nk (rows that see no key: LSE = sink), bf16, one stage.
    (Problem(96, DType.BF16, causal=True, sinks=True), KernelConfig(64, 64, 4, 1),
     Shape(1, 3, 1, 150, 90), Values()),
    # A narrow window (whole blocks see no key) + softcap + ALiBi, fp16.
    (Problem(64, DType.FP16, window=True, softcap=True, alibi=True, sinks=True), _C,
     Shape(1, 4, 2, 200, 150), Values((_RNG.choice((0, 1, 3)), 0), _RNG.choice(SOFTCAPS))),
    # Varlen causal with drawn lengths (zero-length sequences included), bf16.
    (Problem(64, DType.BF16, causal=True, varlen=True, sinks=True), _C,
     Shape(5, 2, 1, 130, 160), Values()),
)


def _case_id(case: tuple[Problem, KernelConfig, Shape, Values]) -> str:
    return f"{case[0].key()}-{case[2].key()}"


@pytest.mark.parametrize("case", _RNG.sample(CASES, 1), ids=_case_id)
def test_sinks_match_reference(case: tuple[Problem, KernelConfig, Shape, Values]) -> None:
    """A seeded sample of the cases (all of them under -m sweep)."""
    run_case(*case, _seed())


@pytest.mark.sweep
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_sinks_case(case: tuple[Problem, KernelConfig, Shape, Values]) -> None:
    run_case(*case, _seed())


def test_a_row_with_no_key_gets_the_sink_as_its_lse() -> None:
    """Varlen sequences with no keys: O = 0 and LSE = the head's sink (not +inf)."""
    problem = Problem(32, DType.FP16, varlen=True, sinks=True)
    lens_q, lens_k = [40, 0, 7], [0, 5, 30]
    seed = _seed()
    drawn = FORWARD.random_inputs(problem, Shape(3, 2, 1, 40, 30), "cpu", seed)
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(drawn.tensors) | {
        "q": torch.randn(1, sum(lens_q), 2, 32, generator=gen).half(),
        "k": torch.randn(1, sum(lens_k), 1, 32, generator=gen).half(),
        "v": torch.randn(1, sum(lens_k), 1, 32, generator=gen).half(),
        "cu_seqlens_q": torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32),
        "cu_seqlens_k": torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32)}
    inputs = Inputs(tensors, dict(drawn.scalars) | {"max_seqlen_q": 40})
    shape = Shape(3, 2, 1, 40, 30)
    kernel = EmulatorBackend().load(render(problem, _C))
    outputs = FORWARD.empty_outputs(problem, shape, inputs, poison=True)
    plan = FORWARD.launch_plan(problem, _C, shape, inputs, outputs)
    kernel.launch(plan.grid, plan.args)
    verdict = FORWARD.compare(problem, shape, outputs, FORWARD.reference(problem, inputs))
    assert verdict.ok, f"seed={seed}: {verdict.message}"
    assert (outputs["o"][0, :40] == 0).all()
    assert torch.equal(outputs["lse"][0, :, :40],
                       tensors["sinks"][:, None].expand(2, 40))


_SWEEP_FEATURES: tuple[dict[str, bool], ...] = (
    {}, {"causal": True}, {"window": True}, {"softcap": True}, {"alibi": True},
    {"window": True, "softcap": True, "alibi": True}, {"varlen": True, "causal": True},
    {"varlen": True, "window": True, "softcap": True})
SWEEP = [(Problem(hd, dt, sinks=True, **flags), i)  # type: ignore[arg-type]
         for i, (hd, dt, flags) in enumerate(itertools.product(HEAD_DIMS, DType,
                                                               _SWEEP_FEATURES))]


@pytest.mark.sweep
@pytest.mark.parametrize(("problem", "index"), SWEEP, ids=[p.key() for p, _ in SWEEP])
def test_sinks_grid(problem: Problem, index: int) -> None:
    """Every head dim x dtype x feature set with sinks, windows and caps walking
    flash-attn's grids, lengths on and off the tiles (Nq > Nk: rows with no key)."""
    pairs = [p for p in itertools.product(WINDOW_SIZES, WINDOW_SIZES) if p != (-1, -1)]
    values = Values(pairs[index % len(pairs)] if problem.window else None,
                    SOFTCAPS[index % len(SOFTCAPS)] if problem.softcap else None,
                    slopes_per_batch=index % 2 == 0)
    lengths = ((128, 128), (77, 300), (300, 77), (1, 200), (200, 1))[index % 5]
    batch = 6 if problem.varlen else 2
    run_case(problem, KernelConfig(64, 32, 4, 1), Shape(batch, 4, 2, *lengths), values,
             index * 7919 + 3)


@pytest.mark.parametrize("dtype", [_RNG.choice(list(DType))])
def test_combine_joins_the_sink(dtype: DType) -> None:
    """The split combine with sinks against the float64 merge: rows whose splits are all
    empty get O = 0 and LSE = sink; the others' weights include the sink's share."""
    problem = Problem(64, dtype, op="combine", sinks=True)
    config = KernelConfig(64, 16, 4, 1)
    shape = Shape(2, 3, 3, 5, 1)
    seed = _seed()
    inputs = COMBINE.random_inputs(problem, shape, "cpu", seed, num_splits=7)
    kernel = EmulatorBackend().load(render(problem, config))
    outputs = COMBINE.empty_outputs(problem, shape, inputs, poison=True)
    plan = COMBINE.launch_plan(problem, config, shape, inputs, outputs)
    kernel.launch(plan.grid, plan.args)
    reference = COMBINE.reference(problem, inputs)
    verdict = COMBINE.compare(problem, shape, outputs, reference)
    assert verdict.ok, f"seed={seed}: {verdict.message}"
    sinks = inputs.tensors["sinks"]
    assert torch.equal(outputs["lse"][0, 0], sinks[0].expand(5))  # every split empty
    assert (outputs["o"][0, :, 0] == 0).all()
    # Without the sink the merge is another one: the check above can fail.
    plain = COMBINE.reference(Problem(64, dtype, op="combine"), inputs)
    assert not torch.allclose(plain["lse"], reference["lse"], atol=1e-3)


@pytest.mark.parametrize("problem", [Problem(128, DType.BF16, causal=True, sinks=True),
                                     Problem(128, DType.BF16, op="combine", sinks=True)],
                         ids=lambda p: p.key())
def test_sinks_compile_with_nvrtc_without_spills(problem: Problem) -> None:
    """The default config of the sinks kernel on sm_80 compiles through NVRTC with no spill
    and at most a few more registers than the same kernel without sinks."""
    family = families.get(problem.op)
    plain = Problem(problem.head_dim, problem.dtype, causal=problem.causal, op=problem.op)
    config = family.default_config(problem, get_arch("sm_80"))
    with_sinks = compile_source(render(problem, config), "sm_80").resources
    without = compile_source(render(plain, config), "sm_80").resources
    assert with_sinks.spill_bytes == 0 and with_sinks.registers > 0
    assert with_sinks.registers <= without.registers + 8
