"""What the cost model charges per tile with the kernel's SASS (perf.model.loopcost): executed
instructions per loop, masked tiles by count, the vote-skipped rescale by its chance,
issue slots, and which parameters came from which published table."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import cast

import pytest
from test_perf_loops import TWO_LOOPS

from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families import render
from flashtune.perf.model.algorithm import (
    TileMix,
    analytic_tile_mix,
    block_tiles,
    tiles_per_query_block,
)
from flashtune.perf.model.baselines import (
    FA2_D128_LOCAL_PER_TILE,
    fa2_local_per_tile,
    fa2_resources,
)
from flashtune.perf.model.costmodel import DEFAULT_PARAMS, predict
from flashtune.perf.model.loopcost import kernel_loops, rescale_probability
from flashtune.perf.sass.disasm import sass_listing
from flashtune.perf.sass.loops import main_loop
from flashtune.perf.sass.parse import parse_sass
from flashtune.toolchain.compiler import compile_source

D128 = Problem(128, DType.BF16)
TILE = KernelConfig(128, 32, 4, 2)


def test_rescale_probability() -> None:
    assert rescale_probability(1, 32) == 0.0
    # One row, two tiles: the second tile holds the new max half the time.
    assert rescale_probability(2, 1) == pytest.approx(0.5)
    # Three tiles, two rows: tile 2: 1 - (1/2)^2, tile 3: 1 - (2/3)^2.
    assert rescale_probability(3, 2) == pytest.approx(((1 - 0.25) + (1 - 4 / 9)) / 2)
    # More tiles: rarer; more rows: more often.
    assert rescale_probability(1000, 32) < rescale_probability(100, 32) < 1.0
    assert rescale_probability(100, 64) > rescale_probability(100, 16)


def _brute_masked(problem: Problem, config: KernelConfig, shape: Shape, m_block: int) -> int:
    """Tiles of a query block holding a key some of its rows may not see (or past Nk)."""
    nq, nk = shape.seqlen_q, shape.seqlen_k
    tiles = tiles_per_query_block(problem, config, shape)[m_block]
    rows = range(m_block * config.block_m, min(nq, (m_block + 1) * config.block_m))
    count = 0
    for t in range(tiles):
        keys = range(t * config.block_n, (t + 1) * config.block_n)
        visible = [(k < nk and (not problem.causal or k <= r + nk - nq)) for r in rows
                   for k in keys]
        count += not all(visible)
    return max(1, count) if tiles else 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("nq", "nk"), [(1000, 1000), (300, 777), (777, 300), (512, 512)])
def test_masked_tiles_match_a_brute_force_count(causal: bool, nq: int, nk: int) -> None:
    problem = Problem(64, DType.FP16, causal=causal)
    config = KernelConfig(64, 32, 4, 2)
    shape = Shape(1, 1, 1, nq, nk)
    for m_block, block in enumerate(block_tiles(problem, config, shape)):
        assert block.low == 0
        assert block.masked == _brute_masked(problem, config, shape, m_block), m_block


def test_loop_charges_from_sass() -> None:
    fn = parse_sass(TWO_LOOPS).function()
    # One 16 x 16 tile of d16 takes 4 HMMA (2 for Q K^T, 2 for P V); each loop of the
    # listing holds 2, half a tile, so its counts are doubled per tile.
    config = KernelConfig(16, 16, 1, 2)
    problem = Problem(16, DType.BF16, causal=True)
    analytic = analytic_tile_mix(problem, config)
    loops = kernel_loops(fn, problem, config, analytic)
    assert loops is not None and loops.masked is not None
    # The unmasked loop's vote-guarded block (3 FMUL) runs with the given chance.
    never, always = loops.tile_mix(False, 0.0), loops.tile_mix(False, 1.0)
    assert always.fp32 - never.fp32 == pytest.approx(2 * 3.0)
    assert loops.tile_mix(False, 0.25).fp32 - never.fp32 == pytest.approx(2 * 3.0 * 0.25)
    # A masked tile is charged the masked loop (no local memory), an unmasked one the
    # unmasked loop (3 LDL + 2 STL per pass).
    assert loops.tile_mix(True, 0.0).local == 0 and never.local == 2 * 5


def test_prediction_charges_executed_instructions_per_loop(compile_cubin: object) -> None:
    problem = replace(D128, causal=True)
    source = render(problem, TILE)
    kernel = compile_source(source, "sm_90")
    fn = sass_listing(kernel.cubin, "sm_90").function(source.entry)
    shape = Shape.square(4, 16, 4096)
    pred = predict(problem, TILE, shape, "H100", resources=kernel.resources, sass=fn)
    note = next(n for n in pred.notes if n.startswith("charged executed instructions"))
    assert "masked loop" in note and "O rescale" in note
    static_only = predict(problem, TILE, shape, "H100", resources=kernel.resources,
                          sass=fn.mix(main_loop(fn)))
    # Skipping most rescales of a 4k sequence makes the executed charge the smaller one.
    assert pred.time_ms < static_only.time_ms


def test_issue_slots_bound_a_tile() -> None:
    shape = Shape.square(4, 16, 4096)
    base = predict(D128, TILE, shape, "H100")
    assert base.cycles.issue_round > 0
    assert base.cycles.per_tile >= base.cycles.issue_round


def test_predictions_name_the_fitted_parameters() -> None:
    pred = predict(D128, TILE, Shape.square(1, 16, 1024), "H100")
    sources = {name: src for name, _, src in pred.parameters}
    assert set(sources) == set(DEFAULT_PARAMS.to_dict())
    assert "FlashAttention-2 H100" in sources["overlap"]
    assert "FlashAttention-2 H100" in sources["exposed_latency_ns"]
    assert "overlap, exposed_latency_ns" in pred.fitted_summary()
    tuned = predict(D128, TILE, Shape.square(1, 16, 1024), "H100",
                    params=replace(DEFAULT_PARAMS, overlap=0.2))
    assert dict((n, s) for n, _, s in tuned.parameters)["overlap"].startswith("set by")
    parameters = cast(list[dict[str, object]], pred.to_dict()["parameters"])
    assert parameters[0]["name"] == "overlap"


def test_fa2_baseline_spills_as_measured() -> None:
    res = fa2_resources(128, "sm_90")
    assert (res.spill_stores, res.spill_loads) == (176, 180)
    assert (fa2_resources(128, "sm_80", causal=True).spill_stores,
            fa2_resources(128, "sm_80", causal=True).spill_loads) == (224, 244)
    assert fa2_resources(64, "sm_90").spill_stores == 0  # not measured
    assert fa2_local_per_tile(128) == FA2_D128_LOCAL_PER_TILE == 12
    shape = Shape.square(4, 16, 4096)
    config = KernelConfig(128, 64, 4, 1)
    spilling = predict(D128, config, shape, "H100", resources=res, local_per_tile=12)
    assert spilling.mix.local == 12
    assert math.isfinite(spilling.time_ms)
    assert any("12 local-memory accesses" in n for n in spilling.notes)


def test_tile_mix_is_a_plain_record() -> None:
    mix = TileMix(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, "sass")
    assert mix.to_dict()["source"] == "sass"
