"""``flashtune profile --counters``: the kernel runs in the CPU emulator on a sample shape and
its measured global bytes and bank-conflict factor feed the prediction."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.perf.model.costmodel import TrafficCounters, predict
from flashtune.perf.model.emulated import algorithm_read_bytes

pytestmark = pytest.mark.emulator


def test_profile_counters_feed_the_prediction(compile_cubin: Callable[..., bytes]) -> None:
    args = ["profile", "--head-dim", "64", "--dtype", "fp16", "--causal", "--config",
            "m64_n64_w4_s2", "--arch", "sm_80", "--gpu", "A100", "--batch", "2", "--heads",
            "4", "--seqlen", "1000", "--counters", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    emu = data["emulator_counters"]
    problem, config = Problem(64, DType.FP16, causal=True), KernelConfig(64, 64, 4, 2)
    sample = Shape(**emu["sample_shape"])
    assert (sample.seqlen_q, sample.seqlen_k) == (256, 256)
    counters = emu["counters"]
    # The kernel reads what the algorithm needs (the causal triangle of K/V tiles).
    assert counters["cp_async_bytes"] == algorithm_read_bytes(problem, config, sample)
    assert counters["coalescing_efficiency"] == 1.0
    assert counters["ldmatrix_conflicts"] == 0 and counters["cp_async_smem_conflicts"] == 0
    # Causal imbalance: query block i visits i + 1 tiles of 64 keys (256 / 64 = 4 blocks).
    per_tile = counters["block_mma"][0]
    assert counters["block_mma"] == [per_tile * (i + 1) for i in range(4)]
    shape = Shape(2, 4, 4, 1000, 1000)
    assert emu["global_read_bytes"] == algorithm_read_bytes(problem, config, shape)
    pred = data["prediction"]
    assert pred["traffic"]["source"] == "counters"

    class Res:
        registers = data["resources"]["registers"]
        spill_stores = data["resources"]["spill_stores"]
        spill_loads = data["resources"]["spill_loads"]
        static_smem = data["resources"]["static_smem"]
        dynamic_smem = data["resources"]["dynamic_smem"]

    fed = predict(problem, config, shape, "A100", resources=Res(), counters=TrafficCounters(
        global_read_bytes=emu["global_read_bytes"],
        smem_bank_conflict_factor=emu["smem_bank_conflict_factor"]))
    assert pred["traffic"]["l2_bytes"] == pytest.approx(fed.traffic.l2_bytes)
