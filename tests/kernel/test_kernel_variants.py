"""The forward kernel's attention features in the CPU emulator against the float64 reference:
sliding windows, softcap, ALiBi, varlen (packed sequences), and their combinations with
causal masks and GQA.

Every launch goes through the forward family (``random_inputs`` from a printed seed, the
feature values set here, NaN-poisoned outputs, ``compare`` against ``reference``). Window
sizes and caps are drawn from flash-attn's test grids (``variants.WINDOW_SIZES``,
``SOFTCAPS``). The default run checks a seeded sample (FLASHTUNE_TEST_SEED picks the values);
``-m sweep`` runs the grid over head dims, dtypes, windows and caps. A counter test checks
that key tiles outside every row's window are skipped, not masked.
"""

from __future__ import annotations

import itertools
import os
import random
from dataclasses import dataclass

import pytest
import torch

from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families import render
from flashtune.families.base import Inputs
from flashtune.families.fwd import FORWARD
from flashtune.families.fwd.variants import SOFTCAPS, WINDOW_SIZES
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions
from flashtune.runtime.backends.emulator.counters import EmulatorCounters

pytestmark = pytest.mark.emulator

_RNG = random.Random(int(os.environ["FLASHTUNE_TEST_SEED"]))


@dataclass(frozen=True)
class Values:
    """The run-time feature values of one case (None: drawn by the family)."""

    window: tuple[int, int] | None = None
    softcap: float | None = None
    slopes_per_batch: bool = True

    def label(self) -> str:
        parts = [f"w{self.window[0]}_{self.window[1]}" if self.window else "",
                 f"cap{self.softcap:g}" if self.softcap else "",
                 "" if self.slopes_per_batch else "slopesH"]
        return "-".join(p for p in parts if p) or "drawn"


def _inputs(problem: Problem, shape: Shape, values: Values, seed: int) -> Inputs:
    inputs = FORWARD.random_inputs(problem, shape, "cpu", seed)
    scalars = dict(inputs.scalars)
    tensors = dict(inputs.tensors)
    if values.window is not None:
        scalars.update(window_left=values.window[0], window_right=values.window[1])
    if values.softcap is not None:
        scalars["softcap"] = values.softcap
    if problem.alibi and not values.slopes_per_batch:
        tensors["alibi_slopes"] = tensors["alibi_slopes"][0].contiguous()  # (heads_q,)
    return Inputs(tensors, scalars)


def run_case(problem: Problem, config: KernelConfig, shape: Shape, values: Values,
             seed: int, options: LaunchOptions | None = None) -> EmulatorCounters | None:
    """Launch on the family's random inputs (from ``seed``) with poisoned outputs; assert
    that the outputs match the float64 reference. Returns the launch's counters."""
    inputs = _inputs(problem, shape, values, seed)
    kernel = EmulatorBackend(options=options or LaunchOptions()).load(render(problem, config))
    outputs = FORWARD.empty_outputs(problem, shape, inputs, poison=True)
    plan = FORWARD.launch_plan(problem, config, shape, inputs, outputs)
    kernel.launch(plan.grid, plan.args)
    verdict = FORWARD.compare(problem, shape, outputs, FORWARD.reference(problem, inputs))
    where = (f"{problem.key()} {config.key()} {shape.key()} {dict(inputs.scalars)} "
             f"seed={seed}")
    assert verdict.ok, f"{where}: {verdict.message}"
    counters: EmulatorCounters | None = getattr(kernel, "last_counters", None)
    return counters


def _seed() -> int:
    return _RNG.randrange(2**31)


def _window() -> tuple[int, int]:
    pairs = [p for p in itertools.product(WINDOW_SIZES, WINDOW_SIZES) if p != (-1, -1)]
    return _RNG.choice(pairs)


_C = KernelConfig(64, 32, 4, 2)
#: (problem, config, shape, values): each feature alone and in combination, seeded values.
CASES: tuple[tuple[Problem, KernelConfig, Shape, Values], ...] = (
    # softcap alone, fp16, lengths off the tile grid.
    (Problem(64, DType.FP16, softcap=True), _C, Shape(1, 2, 2, 100, 130),
     Values(softcap=_RNG.choice(SOFTCAPS))),
    # softcap with causal, bf16, a padded head dim (72 -> 96), one stage.
    (Problem(72, DType.BF16, causal=True, softcap=True), KernelConfig(64, 64, 4, 1),
     Shape(2, 2, 1, 77, 150), Values(softcap=_RNG.choice(SOFTCAPS))),
    # ALiBi alone with one slope per head (shared by the batch), Nq > Nk.
    (Problem(64, DType.BF16, alibi=True), _C, Shape(2, 3, 1, 150, 90),
     Values(slopes_per_batch=False)),
    # ALiBi with causal, per-(batch, head) slopes.
    (Problem(32, DType.FP16, causal=True, alibi=True), KernelConfig(64, 32, 4, 3),
     Shape(2, 2, 2, 130, 200), Values()),
    # A window from flash-attn's grid, square lengths.
    (Problem(64, DType.FP16, window=True), _C, Shape(1, 2, 1, 300, 300), Values(_window())),
    # A narrow causal window (left, 0) over long keys: most tiles are skipped; Nq < Nk.
    (Problem(128, DType.BF16, window=True), KernelConfig(128, 64, 4, 2),
     Shape(1, 2, 2, 130, 700), Values((_RNG.choice((1, 3, 16, 64)), 0))),
    # Window + softcap + ALiBi + GQA 4:2 with Nq > Nk (rows that see no key).
    (Problem(96, DType.FP16, window=True, softcap=True, alibi=True), _C,
     Shape(1, 4, 2, 200, 150), Values(_window(), _RNG.choice(SOFTCAPS))),
    # Window + softcap + GQA, bf16, one warp, tiles of 16.
    (Problem(64, DType.BF16, window=True, softcap=True), KernelConfig(16, 16, 1, 2),
     Shape(2, 2, 1, 60, 70), Values(_window(), _RNG.choice(SOFTCAPS))),
    # Varlen self-attention: many short sequences, a few long, lengths drawn by the family.
    (Problem(64, DType.FP16, varlen=True), _C, Shape(8, 2, 1, 200, 200), Values()),
    # Varlen causal with other key lengths per sequence (bottom-right per sequence), bf16.
    (Problem(32, DType.BF16, causal=True, varlen=True), KernelConfig(64, 32, 4, 3),
     Shape(6, 2, 2, 130, 180), Values()),
    # Varlen + window + softcap + ALiBi + GQA 4:2.
    (Problem(64, DType.FP16, window=True, softcap=True, alibi=True, varlen=True), _C,
     Shape(5, 4, 2, 160, 160), Values(_window(), _RNG.choice(SOFTCAPS))),
)


@pytest.mark.parametrize(("problem", "config", "shape", "values"), CASES,
                         ids=[f"{p.key()}-{c.key()}-{s.key()}-{v.label()}"
                              for p, c, s, v in CASES])
def test_feature_matches_reference(problem: Problem, config: KernelConfig, shape: Shape,
                                   values: Values) -> None:
    run_case(problem, config, shape, values, _seed())


def _mma_per_tile(problem: Problem, config: KernelConfig) -> int:
    """mma.sync m16n8k16 of one key tile per block: Q K^T and P V of every warp."""
    mma_dim = -(-problem.head_dim // 16) * 16
    m_tiles = config.rows_per_warp // 16
    qk = m_tiles * (config.block_n // 8) * (mma_dim // 16)
    pv = m_tiles * (mma_dim // 8) * (config.block_n // 16)
    return config.num_warps * (qk + pv)


def _visited_tiles(m_block: int, config: KernelConfig, nq: int, nk: int,
                   window: tuple[int, int]) -> int:
    """Key tiles holding a key some row of query block ``m_block`` sees (0: none)."""
    left, right = window
    rows = range(m_block * config.block_m, min(nq, (m_block + 1) * config.block_m))
    keys = [j for i in rows for j in range(nk)
            if (left < 0 or j >= i + nk - nq - left) and (right < 0 or j <= i + nk - nq + right)]
    if not keys:
        return 0
    return max(keys) // config.block_n - min(keys) // config.block_n + 1


@pytest.mark.parametrize("window", [(16, 0), (3, 40), (-1, 5), (100, -1)])
def test_tiles_outside_the_window_are_skipped(window: tuple[int, int]) -> None:
    """Each block runs Q K^T and P V on exactly the key tiles its rows' windows touch."""
    problem, config = Problem(32, DType.FP16, window=True), KernelConfig(64, 32, 4, 2)
    shape = Shape(1, 1, 1, 256, 320)
    counters = run_case(problem, config, shape, Values(window), _seed(),
                        LaunchOptions(counters=True))
    assert counters is not None
    per_tile = _mma_per_tile(problem, config)
    expected = [per_tile * _visited_tiles(m, config, 256, 320, window) for m in range(4)]
    assert list(counters.block_mma) == expected


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_with_empty_sequences(causal: bool) -> None:
    """Sequences with no queries (no rows written), no keys (O = 0, LSE = +inf), both, and
    a long one, in a packed batch; the grid is sized by the longest query sequence."""
    problem = Problem(64, DType.BF16, causal=causal, varlen=True)
    lens_q, lens_k = [0, 70, 5, 0, 130, 9], [3, 0, 5, 0, 100, 200]
    seed = _seed()
    drawn = FORWARD.random_inputs(problem, Shape(len(lens_q), 2, 1, 130, 200), "cpu", seed)
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "q": torch.randn(1, sum(lens_q), 2, 64, generator=gen).bfloat16(),
        "k": torch.randn(1, sum(lens_k), 1, 64, generator=gen).bfloat16(),
        "v": torch.randn(1, sum(lens_k), 1, 64, generator=gen).bfloat16(),
        "cu_seqlens_q": torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32),
        "cu_seqlens_k": torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32)}
    inputs = Inputs(tensors, dict(drawn.scalars) | {"max_seqlen_q": 130})
    shape = Shape(len(lens_q), 2, 1, 130, 200)
    config = KernelConfig(64, 32, 4, 2)
    kernel = EmulatorBackend().load(render(problem, config))
    outputs = FORWARD.empty_outputs(problem, shape, inputs, poison=True)
    plan = FORWARD.launch_plan(problem, config, shape, inputs, outputs)
    assert plan.grid == (3, 2, 6)
    kernel.launch(plan.grid, plan.args)
    reference = FORWARD.reference(problem, inputs)
    verdict = FORWARD.compare(problem, shape, outputs, reference)
    assert verdict.ok, f"seed={seed}: {verdict.message}"
    no_keys = slice(0, 70)  # rows of the second sequence (70 queries, no keys)
    assert (outputs["o"][0, no_keys] == 0).all()
    assert torch.isposinf(outputs["lse"][0, :, no_keys]).all()


HEAD_DIMS = (32, 64, 72, 96, 128, 160, 192, 224, 256)
_SWEEP_FEATURES = ({"window": True}, {"softcap": True}, {"alibi": True},
                   {"window": True, "softcap": True, "alibi": True},
                   {"varlen": True, "causal": True},
                   {"varlen": True, "window": True, "softcap": True},
                   {"causal": True, "softcap": True, "alibi": True})
SWEEP = [(Problem(hd, dt, **flags), i)  # type: ignore[arg-type]
         for i, (hd, dt, flags) in enumerate(itertools.product(HEAD_DIMS, DType,
                                                               _SWEEP_FEATURES))]


@pytest.mark.sweep
@pytest.mark.parametrize(("problem", "index"), SWEEP, ids=[p.key() for p, _ in SWEEP])
def test_feature_grid(problem: Problem, index: int) -> None:
    """Every head dim x dtype x feature set, on a config that fits every head dim, with
    window sizes and caps walking flash-attn's grids."""
    pairs = [p for p in itertools.product(WINDOW_SIZES, WINDOW_SIZES) if p != (-1, -1)]
    values = Values(pairs[index % len(pairs)] if problem.window else None,
                    SOFTCAPS[index % len(SOFTCAPS)] if problem.softcap else None,
                    slopes_per_batch=index % 2 == 0)
    lengths = ((128, 128), (77, 300), (300, 77), (1, 200), (200, 1))[index % 5]
    batch = 6 if problem.varlen else 2
    run_case(problem, KernelConfig(64, 32, 4, 1), Shape(batch, 2, 1, *lengths), values,
             index * 7919 + 1)


@pytest.mark.sweep
@pytest.mark.parametrize("window", [p for p in itertools.product(WINDOW_SIZES, WINDOW_SIZES)
                                    if p != (-1, -1)])
def test_every_window_pair(window: tuple[int, int]) -> None:
    """Every window pair of the grid on lengths that put the window across block edges."""
    problem = Problem(64, DType.FP16, window=True)
    run_case(problem, KernelConfig(64, 32, 4, 2), Shape(1, 2, 1, 190, 260), Values(window),
             window[0] * 1000 + window[1] + 2)


def test_cases_exercise_every_feature() -> None:
    seen = {name for p, _, _, _ in CASES for name in p.features}
    assert seen == {"window", "softcap", "alibi", "varlen"}
    assert any(p.window and p.softcap and s.heads_q > s.heads_kv for p, _, s, _ in CASES)
    assert torch.float32  # the slopes' dtype is the family's (checked in the API tests)
