"""The MLA family's contract beyond numerics: its static rules name their reasons (shared
memory per arch, registers, the column-warp split), defaults per arch, refusals of a wrong
head dim and of a bad block table (the kernel's status, never followed), and the CLI's
``show`` / ``compile --op mla``."""

from __future__ import annotations

import os
import random

import pytest
import torch
from mla_cases import MlaCase
from typer.testing import CliRunner

from flashtune import families
from flashtune.cli import app
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.errors import InvalidProblem
from flashtune.families.decode import DecodeCase
from flashtune.families.mla import MLA
from flashtune.families.mla.space import COL_WARPS, smem_bytes
from flashtune.runtime.backends.emulator import EmulatorBackend
from flashtune.runtime.launch import prepare

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
PROBLEM = Problem(64, DType.BF16, op="mla")


def test_family_is_registered_and_refuses_other_head_dims() -> None:
    assert families.get("mla") is MLA
    with pytest.raises(InvalidProblem, match="head_dim=64"):
        MLA.check_problem(Problem(128, DType.BF16, op="mla"))


def test_defaults_fit_each_arch_and_rules_name_their_reasons() -> None:
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90"):
        config = MLA.default_config(PROBLEM, get_arch(arch))
        assert MLA.rules(PROBLEM, config, get_arch(arch)) is None
        assert smem_bytes(PROBLEM, config) <= get_arch(arch).max_smem_per_block
    assert MLA.default_config(PROBLEM, get_arch("sm_90")).block_m == 64
    big = KernelConfig(64, 32, 4, 2, extras={COL_WARPS: 2})
    reason = MLA.rules(PROBLEM, big, get_arch("sm_86"))
    assert reason is not None and "shared memory 164368 B" in reason and "101376" in reason
    many = KernelConfig(64, 64, 4, 1, extras={COL_WARPS: 1})
    reason = MLA.rules(PROBLEM, many, get_arch("sm_90"))
    assert reason is not None and "registers" in reason and COL_WARPS in reason
    # Two m16 tiles per warp at 144 accumulators: 255 registers and a spill on sm_80 (NVRTC).
    spills = KernelConfig(32, 64, 1, 1, extras={COL_WARPS: 4})
    reason = MLA.rules(PROBLEM, spills, get_arch("sm_80"))
    assert reason is not None and "144 registers" in reason
    odd = KernelConfig(16, 16, 1, 1, extras={COL_WARPS: 4})
    reason = MLA.rules(PROBLEM, odd, get_arch("sm_90"))
    assert reason is not None and "multiple of 32" in reason
    few = KernelConfig(64, 32, 1, 1, extras={COL_WARPS: 1})
    reason = MLA.rules(PROBLEM, few, get_arch("sm_90"))
    assert reason is not None and "softmax thread" in reason


@pytest.mark.emulator
def test_a_bad_block_table_entry_is_refused_not_followed() -> None:
    case = MlaCase(DType.BF16, 16, 1, 16, 1)
    problem, shape = case.problem, case.shape
    rng = random.Random(SEED)
    inputs = MLA.random_inputs(problem, shape, "cpu", seed=rng.randrange(1 << 30),
                               case=DecodeCase(16, (150, 40, 0), 0, 1))
    table = inputs.tensors["block_table"]
    table[1, 1] = 10_000  # a page the second sequence reads (keys 16..31)
    kernel = EmulatorBackend().load(
        families.render(problem, MLA.default_config(problem, get_arch("sm_90"))))
    launch = prepare(kernel, shape, "cpu", inputs=inputs, poison=True)
    launch.run()
    status = launch.outputs["status"].tolist()
    assert status == [3, 1, 1, 10_000]  # (page index, batch, slot, value)
    # The status is judged before any reference (which could not follow the table either).
    verdict = MLA.compare(problem, shape, launch.outputs, launch.outputs)
    assert not verdict.ok
    assert "block_table[1, 1] = 10000" in verdict.message
    assert bool(torch.isnan(launch.outputs["o_part"][0, 1]).all())


def test_cli_shows_and_compiles_the_mla_kernel() -> None:
    shown = CliRunner().invoke(app, ["show", "--op", "mla", "--head-dim", "64", "--dtype",
                                     "bf16", "--bindings"])
    assert shown.exit_code == 0, shown.output
    assert "ft::mla_decode<Traits>" in shown.output
    compiled = CliRunner().invoke(app, ["compile", "--op", "mla", "--head-dim", "64",
                                        "--dtype", "bf16", "--causal", "--arch", "sm_80",
                                        "--arch", "sm_90"])
    assert compiled.exit_code == 0, compiled.output
    rows = [line for line in compiled.output.splitlines() if "colwarps" in line]
    assert len(rows) == 2 and all("ok" in row for row in rows), compiled.output


def test_grid_covers_the_packed_rows_and_splits() -> None:
    from flashtune.families.mla.args import mla_grid
    assert mla_grid(3, 32, 2, 64, 5) == (5, 1, 3)
    assert mla_grid(3, 128, 2, 64, 1) == (1, 4, 3)
    assert MLA.min_bytes(PROBLEM, Shape(1, 16, 1, 1, 100)) == (
        100 * 576 * 2 + 16 * 576 * 2 + 16 * (512 * 2 + 4))
