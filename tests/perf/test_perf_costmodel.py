"""The cost model's physics: labels, wave quantisation, scaling, bounds, inputs."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from flashtune import families
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.errors import InvalidConfig, InvalidInput
from flashtune.perf.model.algorithm import (
    analytic_tile_mix,
    analytic_traffic,
    tiles_per_query_block,
)
from flashtune.perf.model.baselines import Fa2Resources
from flashtune.perf.model.costmodel import (
    DEFAULT_PARAMS,
    MODEL_NAME,
    ModelParams,
    TrafficCounters,
    predict,
    rank,
)
from flashtune.perf.model.gpus import GPUS, get_gpu
from flashtune.perf.sass.parse import InstructionMix

D128 = Problem(128, DType.FP16, False)
D128_CAUSAL = Problem(128, DType.FP16, True)
CFG = KernelConfig(128, 64, 4, 2)
FA2_LIKE = Fa2Resources(registers=255, dynamic_smem=64 * 1024)


def test_predictions_are_labelled_and_versioned() -> None:
    pred = predict(D128, CFG, Shape.square(4, 16, 4096), "H100")
    assert pred.summary().startswith("PREDICTED")
    data = pred.to_dict()
    assert data["kind"] == "PREDICTED" and data["model_version"] == pred.model_version
    assert pred.model_version.startswith(MODEL_NAME + "/")
    assert pred.bound in ("compute", "memory", "latency")
    assert pred.tflops == pytest.approx(families.of(D128).flops(D128, Shape.square(4, 16, 4096))
                                        / (pred.time_ms * 1e-3) / 1e12)
    other = replace(DEFAULT_PARAMS, overlap=0.1)
    assert other.version != DEFAULT_PARAMS.version
    assert ModelParams.from_dict(DEFAULT_PARAMS.to_dict()) == DEFAULT_PARAMS


def test_gpu_table_facts() -> None:
    assert get_gpu("a100").tensor_flops_per_clk_sm == pytest.approx(2048, rel=0.01)
    assert get_gpu("H100").tensor_flops_per_clk_sm == pytest.approx(4096, rel=0.01)
    assert get_gpu("A100").mma_sync_cycles == pytest.approx(8.0, rel=0.01)
    assert get_gpu("rtx-4090").arch == "sm_89"
    assert get_gpu("H200").hbm_gbps > get_gpu("H100").hbm_gbps
    assert set(GPUS) == {"A100", "H100", "H200", "L40S", "RTX4090", "RTX3090"}
    with pytest.raises(InvalidConfig, match="not in the cost model's table"):
        get_gpu("B200")


def test_wave_quantisation() -> None:
    # 2 blocks/SM on 132 SMs: 264 blocks fill one wave exactly; 8 query blocks per head.
    one = predict(D128, CFG, Shape.square(1, 33, 1024), "H100", resources=FA2_LIKE)
    two = predict(D128, CFG, Shape.square(1, 34, 1024), "H100", resources=FA2_LIKE)
    assert one.occupancy.blocks_per_sm == 2
    assert one.waves == pytest.approx(1.0) and two.waves > 1.0
    assert two.schedule_ms == pytest.approx(2 * one.schedule_ms, rel=1e-9)


def test_time_scales_with_work_and_causal_halves_it() -> None:
    small = predict(D128, CFG, Shape.square(8, 16, 8192), "A100")
    large = predict(D128, CFG, Shape.square(16, 16, 8192), "A100")
    assert large.time_ms / small.time_ms == pytest.approx(2.0, rel=0.02)
    causal = predict(D128_CAUSAL, CFG, Shape.square(8, 16, 8192), "A100")
    assert 0.5 <= causal.time_ms / small.time_ms <= 0.6


def test_faster_gpu_is_faster_and_memory_follows_bandwidth() -> None:
    shape = Shape.square(4, 16, 4096)
    single = KernelConfig(128, 64, 4, 1)  # fits sm_86's 99 KiB of shared memory
    assert (predict(D128, single, shape, "H100").time_ms
            < predict(D128, single, shape, "A100").time_ms
            < predict(D128, single, shape, "RTX3090").time_ms)
    # Many tiny heads: each block moves its Q/O tiles and does one K/V tile.
    tiny = Shape(64, 32, 8, 64, 64)
    h100 = predict(D128, CFG, tiny, "H100")
    h200 = predict(D128, CFG, tiny, "H200")
    assert h100.bound == h200.bound == "memory"
    assert h200.time_ms < h100.time_ms


def test_small_grid_is_latency_bound() -> None:
    pred = predict(D128, CFG, Shape.square(1, 1, 4096), "H100")
    assert pred.bound == "latency"
    assert pred.utilisation < 0.5


def test_counters_replace_analytic_traffic() -> None:
    shape = Shape.square(2, 16, 2048)
    base = predict(D128, CFG, shape, "A100")
    assert base.traffic.source == "analytic"
    huge = base.traffic.l2_bytes * 50
    pred = predict(D128, CFG, shape, "A100",
                   counters=TrafficCounters(global_read_bytes=int(huge)))
    assert pred.traffic.source == "counters"
    assert pred.bound == "memory"
    expected_ms = (pred.traffic.l2_bytes / (0.9 * get_gpu("A100").l2_gbps * 1e9) * 1e3
                   + DEFAULT_PARAMS.launch_overhead_us * 1e-3)
    assert pred.time_ms == pytest.approx(expected_ms)
    conflicted = predict(D128, CFG, shape, "A100",
                         counters=TrafficCounters(smem_bank_conflict_factor=4.0))
    assert conflicted.cycles.smem_round == pytest.approx(4 * base.cycles.smem_round)
    assert conflicted.time_ms >= base.time_ms
    with pytest.raises(InvalidInput, match="bank_conflict"):
        TrafficCounters(smem_bank_conflict_factor=0.5)


def _analytic_like_mix(mma_flops: float, extra_ldl: int = 0) -> InstructionMix:
    cats = {c: 0 for c in ("mma", "wgmma", "ldsm", "ldgsts", "ldg", "stg", "lds", "sts",
                           "ldl", "stl", "bar", "mufu", "fp32", "convert", "shfl", "int",
                           "control", "other")}
    cats.update(mma=int(mma_flops // 4096), ldsm=64, ldgsts=16, bar=2, mufu=68, fp32=300,
                convert=32, shfl=8, int=250, ldl=extra_ldl)
    return InstructionMix(cats, {"HMMA.16816.F32": cats["mma"]}, {}, {}, int(mma_flops),
                          64 * 512)


def test_sass_mix_is_normalised_per_tile_and_spills_cost_time() -> None:
    shape = Shape.square(4, 16, 4096)
    one_tile = 2 * 32 * 64 * 128 * 2.0  # per-warp MMA FLOPs of one K/V tile
    once = predict(D128, CFG, shape, "H100", sass=_analytic_like_mix(one_tile))
    assert once.mix.source == "sass"
    doubled = _analytic_like_mix(2 * one_tile)
    twice_counts = {k: 2 * v for k, v in doubled.by_category.items()}
    unrolled = InstructionMix(twice_counts, {}, {}, {}, doubled.mma_flops, 2 * 64 * 512)
    twice = predict(D128, CFG, shape, "H100", sass=unrolled)
    assert twice.time_ms == pytest.approx(once.time_ms)
    assert any("2 K/V tiles" in note for note in twice.notes)
    spilling = predict(D128, CFG, shape, "H100", sass=_analytic_like_mix(one_tile, 40))
    assert spilling.time_ms > once.time_ms
    assert spilling.mix.local == 40


def test_rank_sorts_and_skips_configs_that_do_not_fit() -> None:
    problem = Problem(256, DType.FP16, False)
    # Shared memory: (264 B rows) x (block_m + 2 x stages x block_n); sm_86 allows 99 KiB.
    configs = [KernelConfig(64, 32, 4, 1), KernelConfig(128, 128, 8, 3),
               KernelConfig(64, 32, 4, 2), KernelConfig(128, 32, 8, 1)]
    ranked = rank(problem, configs, Shape.square(2, 8, 4096), "RTX3090")
    kept = [cfg for cfg, _ in ranked]
    assert KernelConfig(128, 128, 8, 3) not in kept  # 199 KiB of smem on a 99 KiB sm_86
    assert len(kept) == 3
    times = [pred.time_ms for _, pred in ranked]
    assert times == sorted(times)
    assert all(pred.summary().startswith("PREDICTED") for _, pred in ranked)


def test_causal_tiles_follow_the_bottom_right_diagonal() -> None:
    rng = np.random.default_rng()
    for _ in range(50):
        nq, nk = (int(x) for x in rng.integers(1, 700, size=2))
        bm, bn = (int(x) for x in rng.choice([16, 32, 64, 128], size=2))
        problem = Problem(64, DType.BF16, True)
        config = KernelConfig(bm, bn, 1, 1)
        rows = np.arange(nq)[:, None]
        keys = np.arange(nk)[None, :]
        visible = keys <= rows + nk - nq
        expected = []
        for m in range(math.ceil(nq / bm)):
            block = visible[m * bm:(m + 1) * bm]
            last = np.nonzero(block.any(axis=0))[0]
            expected.append(0 if last.size == 0 else math.ceil((last[-1] + 1) / bn))
        assert tiles_per_query_block(problem, config, Shape(1, 1, 1, nq, nk)) == expected


def test_analytic_traffic_counts_q_once_kv_per_query_block_o_once() -> None:
    problem = Problem(64, DType.FP16, False)
    config = KernelConfig(64, 32, 4, 1)
    shape = Shape(3, 8, 2, 1000, 777)
    got = analytic_traffic(problem, config, shape, l2_bytes=50 << 20, resident_blocks=264)
    rows = 3 * 8 * 1000
    m_blocks = math.ceil(1000 / 64)
    kv_rows = m_blocks * math.ceil(777 / 32) * 32
    kv_rows = min(kv_rows, m_blocks * 777)
    expected_l2 = rows * 64 * 2 * 2 + rows * 4 + 3 * 8 * kv_rows * 64 * 2 * 2
    assert got.l2_bytes == expected_l2
    # Everything fits in L2: K and V come from DRAM once per kv head.
    assert got.dram_bytes == rows * 64 * 2 * 2 + rows * 4 + 3 * 2 * 777 * 64 * 2 * 2


def test_v_head_dim_counts_in_flops_instructions_and_traffic() -> None:
    """DeepSeek's 192 / 128: Q K^T over 192 columns, P V, the O rescale, V's tile and O
    over 128, against the counts written out here; the prediction lies between the
    unsplit problems of either head dim."""
    split, wide, narrow = (Problem(192, DType.BF16, head_dim_v=128),
                           Problem(192, DType.BF16), Problem(128, DType.BF16))
    config = KernelConfig(128, 64, 8, 2)
    split_mix, wide_mix = analytic_tile_mix(split, config), analytic_tile_mix(wide, config)
    rows, n = config.rows_per_warp, config.block_n
    assert split_mix.mma_flops == 2 * rows * n * (192 + 128)
    assert wide_mix.mma_flops - split_mix.mma_flops == 2 * rows * n * 64
    assert wide_mix.fp32 - split_mix.fp32 == rows // 16 * 64 / 2  # fewer O columns
    shape = Shape(2, 16, 16, 1024, 1024)
    got = analytic_traffic(split, config, shape, l2_bytes=1 << 40, resident_blocks=264)
    q_rows = 2 * 16 * 1024
    assert got.dram_bytes == (q_rows * (192 + 128) * 2 + q_rows * 4
                              + 2 * 16 * 1024 * (192 + 128) * 2)
    times = [predict(p, config, shape, "H100").time_ms for p in (narrow, split, wide)]
    assert times[0] < times[1] < times[2], times


def test_parameter_validation() -> None:
    with pytest.raises(InvalidConfig, match="overlap"):
        ModelParams(overlap=1.0)
    with pytest.raises(InvalidConfig, match="finite"):
        ModelParams(exposed_latency_ns=float("inf"))
    with pytest.raises(InvalidConfig, match="unknown ModelParams"):
        ModelParams.from_dict({"speed": 1.0})
    with pytest.raises(InvalidInput, match="heads_q"):
        predict(D128, CFG, Shape(1, 8, 3, 64, 64), "H100")
