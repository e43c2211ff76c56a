"""``flashtune profile`` end to end: compile, disassemble, occupancy, PREDICTED time."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.perf.model.algorithm import analytic_tile_mix
from flashtune.perf.model.costmodel import predict
from flashtune.perf.model.occupancy import occupancy

runner = CliRunner()


@pytest.fixture(scope="module")
def toolchain(compile_cubin: Callable[..., bytes]) -> None:
    """Skip this module when NVRTC or nvdisasm is missing (the fixture skips)."""


ARGS = ["profile", "--head-dim", "64", "--dtype", "bf16", "--config", "m64_n64_w4_s2",
        "--arch", "sm_80", "--gpu", "A100", "--batch", "2", "--heads", "8", "--seqlen", "1000"]


def test_profile_json(toolchain: None) -> None:
    result = runner.invoke(app, [*ARGS, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["config_key"] == "m64_n64_w4_s2" and data["arch"] == "sm_80"
    pred = data["prediction"]
    assert pred["kind"] == "PREDICTED" and pred["time_ms"] > 0 and pred["tflops"] > 0
    assert pred["bound"] in ("compute", "memory", "latency")
    loop = data["sass"]["main_loop"]
    problem = Problem(64, DType.BF16, False)
    config = KernelConfig(64, 64, 4, 2)
    expected = analytic_tile_mix(problem, config)
    assert loop["mma_flops"] == expected.mma_flops
    assert loop["mma_ops"] == {"HMMA.16816.F32.BF16": expected.mma_flops // 4096}
    assert loop["mufu_ops"]["MUFU.EX2"] == expected.mufu
    # Non-causal 64x64: the only main loop is the unmasked one, reported as the main loop.
    unmasked = data["sass"]["unmasked_loop"]
    assert data["sass"]["masked_loop"] is None
    assert (unmasked["start"], unmasked["static"]) == (loop["start"], loop["total"])
    assert unmasked["executed_min"] < unmasked["static"]
    assert unmasked["local_memory"] == {"loads": 0, "stores": 0, "in_mma_chain": 0}
    res = data["resources"]
    occ = occupancy("sm_80", threads=128, registers=res["registers"],
                    smem_bytes=res["static_smem"] + res["dynamic_smem"])
    assert data["occupancy"]["blocks_per_sm"] == occ.blocks_per_sm
    # The printed prediction is the library's for the same inputs.
    shape = Shape(2, 8, 8, 1000, 1000)

    class Res:
        registers = res["registers"]
        spill_stores = res["spill_stores"]
        spill_loads = res["spill_loads"]
        static_smem = res["static_smem"]
        dynamic_smem = res["dynamic_smem"]

    analytic = predict(problem, config, shape, "A100", resources=Res())
    assert pred["model_version"] == analytic.model_version
    assert pred["time_ms"] == pytest.approx(analytic.time_ms, rel=0.25)


def test_profile_table(toolchain: None) -> None:
    result = runner.invoke(app, ARGS)
    assert result.exit_code == 0, result.output
    assert "PREDICTED" in result.output
    assert "HMMA.16816.F32.BF16" in result.output
    assert "blocks/SM" in result.output
    assert "per main-loop iteration per warp" in result.output
    assert "unmasked loop" in result.output and "int/addr/pred" in result.output


def test_profile_rejects_a_gpu_of_another_arch(toolchain: None) -> None:
    result = runner.invoke(app, ["profile", "--head-dim", "64", "--arch", "sm_80",
                                 "--gpu", "H100"])
    assert result.exit_code == 1
    assert "sm_90" in result.output and "--arch" in result.output


def test_profile_of_the_backward_main_loop(toolchain: None) -> None:
    """The backward's SASS report: its main loop (one query tile per key tile) holds the
    five products, 10 * block_m * block_n * head_dim FLOPs over the block's warps, and no
    prediction (the cost model describes the forward only)."""
    config = "m64_n64_w4_s2_dqmode-atomic"
    result = runner.invoke(app, ["profile", "--op", "bwd", "--head-dim", "64", "--causal",
                                 "--config", config, "--arch", "sm_80", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["prediction"] is None and data["occupancy"]["blocks_per_sm"] >= 1
    loop = data["sass"]["main_loop"]
    assert loop["mma_flops"] * 4 == 10 * 64 * 64 * 64  # per warp, times 4 warps
    table = runner.invoke(app, ["profile", "--op", "bwd", "--head-dim", "64", "--config",
                                config, "--arch", "sm_80"])
    assert table.exit_code == 0 and "no PREDICTED time" in " ".join(table.output.split())
    counters = runner.invoke(app, ["profile", "--op", "bwd", "--head-dim", "64", "--config",
                                   config, "--arch", "sm_80", "--counters"])
    assert counters.exit_code == 1 and "forward" in counters.output


def test_profile_of_the_mla_tile_loop(toolchain: None) -> None:
    """MLA decoding's main loop is its K/V tile loop, which holds every MMA of the kernel
    (the scores over the 576-wide latent, P V over 512), not the loop of score steps
    inside it, which the report lists as an inner loop whose body is counted once."""
    result = runner.invoke(app, ["profile", "--op", "mla", "--head-dim", "64", "--dtype",
                                 "bf16", "--arch", "sm_80", "--json"])
    assert result.exit_code == 0, result.output
    sass = json.loads(result.output)["sass"]
    loop = sass["main_loop"]
    assert loop["mma_flops"] == sass["kernel"]["mma_flops"] > 0
    steps = [inner for inner in loop["inner_loops"] if inner["tensor_flops"] > 0]
    assert len(steps) == 1 and steps[0]["tensor_flops"] < loop["mma_flops"] / 8
    table = runner.invoke(app, ["profile", "--op", "mla", "--head-dim", "64", "--dtype",
                                "bf16", "--arch", "sm_80"])
    assert "the main loop holds" in table.output and "inner loop(s):" in table.output


def test_profile_of_mla_at_another_head_dim_says_which_one() -> None:
    result = runner.invoke(app, ["profile", "--op", "mla", "--head-dim", "128"])
    assert result.exit_code != 0
    said = " ".join(result.output.split())
    assert "got head_dim=128" in said and "--op mla --head-dim 64" in said, said
