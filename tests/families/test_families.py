"""Kernel families as the unit of extension: the registry, and the small row-wise LSE family
plugged in through the family interface alone (NVRTC, the emulator against float64, the
synthetic tuner, the command line), with no family-specific code in runtime, tuner or CLI."""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Any

import pytest
import torch
from sampling import seeded_part
from typer.testing import CliRunner

from flashtune import families
from flashtune.cli import app
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.errors import InvalidProblem
from flashtune.families.lse import LSE
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions, Schedule
from flashtune.runtime.launch import prepare, verify

runner = CliRunner()
SEED = int(os.environ["FLASHTUNE_TEST_SEED"])


def test_registry_lists_the_families_and_names_them_on_a_miss() -> None:
    ops = [f.op for f in families.all_families()]
    assert "fwd" in ops and "lse" in ops
    with pytest.raises(InvalidProblem, match=r"no kernel family serves op='nope'.*'lse'"):
        families.get("nope")
    with pytest.raises(InvalidProblem, match="already registered"):
        families.register(LSE)


def test_a_registered_family_serves_its_op_and_can_be_removed() -> None:
    @dataclasses.dataclass
    class Renamed(type(LSE)):  # type: ignore[misc]
        op = "lsetwo"

    families.register(Renamed())
    try:
        problem = Problem(64, DType.FP16, op="lsetwo")
        source = families.render(problem, KernelConfig(32, 64, 2, 1))
        assert "flashtune_lsetwo_d64_fp16_full_m32_n64_w2_s1" in source.code
    finally:
        families.unregister("lsetwo")
    with pytest.raises(InvalidProblem):
        families.get("lsetwo")


def test_unknown_knobs_are_ruled_out_by_the_family() -> None:
    problem = Problem(64, DType.FP16, op="lse")
    odd = KernelConfig(32, 64, 2, 1, extras={"swizzle": 1})
    reason = LSE.static_check(problem, odd, get_arch("sm_90"))
    assert reason is not None and "swizzle" in reason and "not knobs" in reason


def test_lse_space_default_and_rules() -> None:
    problem = Problem(128, DType.BF16, op="lse")
    arch = get_arch("sm_80")
    legal = LSE.search_space(problem)
    assert legal and all(c.block_m % (16 * c.num_warps) == 0 for c in legal)
    assert LSE.default_config(problem, arch) in LSE.candidates(problem, arch)
    too_many = KernelConfig(32, 64, 2, 2)
    assert "one K tile" in (LSE.static_check(problem, too_many, arch) or "")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_lse_default_compiles_with_nvrtc_without_spills(arch: str) -> None:
    from flashtune.toolchain.compiler import compile_source

    problem = Problem(128, DType.FP16, causal=True, op="lse")
    config = LSE.default_config(problem, get_arch(arch))
    kernel = compile_source(families.render(problem, config), arch)
    assert kernel.resources.spill_bytes == 0 and kernel.resources.registers > 0


LseCase = tuple[int, DType, bool, Shape, KernelConfig]


def _cases() -> list[Any]:
    """Defaults over head dims, dtypes and masks, plus a seeded sample of the space. The
    default run takes, of the 16 defaults, one seeded head dim per (dtype, mask) pair (every
    dtype and mask each run), and one of the three space configs; ``-m sweep`` all."""
    rng = random.Random(SEED)
    shapes = [Shape(1, 2, 1, 77, 77), Shape(2, 2, 2, 9, 4), Shape(1, 4, 1, 1, 130),
              Shape(1, 1, 1, 130, 33)]
    by_pair: dict[tuple[DType, bool], list[LseCase]] = {}
    for head_dim in (32, 64, 128, 256):
        for dtype in DType:
            for causal in (False, True):
                problem = Problem(head_dim, dtype, causal=causal, op="lse")
                config = LSE.default_config(problem, get_arch("sm_90"))
                by_pair.setdefault((dtype, causal), []).append(
                    (head_dim, dtype, causal, rng.choice(shapes), config))
    space = LSE.candidates(Problem(64, DType.FP16, op="lse"), get_arch("sm_90"))
    drawn = [(rng.choice((32, 64, 72)), rng.choice(list(DType)), rng.random() < 0.5,
              rng.choice(shapes), config) for config in rng.sample(space, 3)]
    cases: list[Any] = []
    for (dtype, causal), group in by_pair.items():
        cases += seeded_part(group, 1, f"lse-{dtype.value}-{causal}")
    return cases + seeded_part(drawn, 1, "lse-space")


@pytest.mark.emulator
@pytest.mark.parametrize("case", _cases(),
                         ids=lambda c: f"d{c[0]}-{c[1].value}-"
                         f"{'causal' if c[2] else 'full'}-{c[3].key()}-{c[4].key()}")
def test_lse_kernel_matches_float64_in_the_emulator(
        case: tuple[int, DType, bool, Shape, KernelConfig]) -> None:
    head_dim, dtype, causal, shape, config = case
    problem = Problem(head_dim, dtype, causal=causal, op="lse")
    source = families.render(problem, config)
    for schedule in Schedule:
        kernel = EmulatorBackend(options=LaunchOptions(schedule=schedule)).load(source)
        verdict = verify(kernel, shape, "cpu")
        assert verdict.ok, verdict.message


@pytest.mark.emulator
def test_lse_rows_that_see_no_key_get_inf_and_a_wrong_kernel_is_caught() -> None:
    problem = Problem(64, DType.FP16, causal=True, op="lse")
    shape = Shape(1, 1, 1, 9, 4)  # the first 5 rows see no key
    kernel = EmulatorBackend().load(families.render(problem, KernelConfig(16, 32, 1, 1)))
    launch = prepare(kernel, shape, "cpu", poison=True)
    launch.run()
    lse = launch.outputs["lse"][0, 0]
    assert torch.isposinf(lse[:5]).all() and torch.isfinite(lse[5:]).all()
    assert launch.verdict().ok
    launch.outputs["lse"][0, 0, 6] += 0.01  # what a wrong kernel would have written
    assert not launch.verdict().ok


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("config", LSE.candidates(Problem(64, DType.BF16, op="lse"),
                                                  get_arch("sm_90")), ids=KernelConfig.key)
def test_lse_full_space_in_the_emulator(config: KernelConfig) -> None:
    for causal in (False, True):
        problem = Problem(64, DType.BF16, causal=causal, op="lse")
        kernel = EmulatorBackend().load(families.render(problem, config))
        verdict = verify(kernel, Shape(2, 2, 1, 150, 200), "cpu")
        assert verdict.ok, verdict.message


#: The knobs the default run's ``compile --all`` holds (one kernel of the space, drawn from
#: the seed); ``-m sweep`` compiles the whole space (18 kernels, about 30 s).
_CLI_FIX = random.Random(f"{SEED}-cli").choice(
    LSE.candidates(Problem(64, DType.FP16, op="lse"), get_arch("sm_90")))


def test_cli_lists_shows_compiles_and_checks_the_second_family() -> None:
    listed = runner.invoke(app, ["families"])
    assert listed.exit_code == 0 and "lse" in listed.output and "fwd" in listed.output
    shown = runner.invoke(app, ["show", "--op", "lse", "--head-dim", "64"])
    assert shown.exit_code == 0, shown.output
    assert "ft::row_lse" in shown.output and "problem: lse_d64_fp16_full" in shown.output
    fixes = [arg for name, value in LSE.point(_CLI_FIX).items()
             for arg in ("--fix", f"{name}={value}")]
    compiled = runner.invoke(app, ["compile", "--op", "lse", "--head-dim", "64", "--all",
                                   "--arch", "sm_90", *fixes])
    assert compiled.exit_code == 0, compiled.output
    text = " ".join(compiled.output.split())
    assert "space of lse_d64_fp16_full on sm_90 with " in text, text
    assert "1 declared points, 1 legal configs, 1 pass the static rules" in text, text
    assert _CLI_FIX.key() in text and " ok " in compiled.output
    checked = runner.invoke(app, ["check", "--op", "lse", "--head-dim", "64", "--causal",
                                  "--seqlen-q", "40", "--seqlen-k", "70", "--no-compile"])
    assert checked.exit_code == 0, checked.output
    bad = runner.invoke(app, ["show", "--op", "nope"])
    assert bad.exit_code == 2 and "no kernel family" in " ".join(bad.output.split())


@pytest.mark.sweep
def test_cli_compiles_the_second_familys_whole_space() -> None:
    compiled = runner.invoke(app, ["compile", "--op", "lse", "--head-dim", "64", "--all",
                                   "--arch", "sm_90"])
    assert compiled.exit_code == 0, compiled.output
    assert "space of lse_d64_fp16_full on sm_90:" in " ".join(compiled.output.split())


def test_a_misnamed_knob_is_refused_not_an_empty_space() -> None:
    """A knob whose name no config can carry (an underscore) makes every point illegal; the
    space says so instead of being silently empty, and a well-named knob is served."""
    from flashtune.codegen.params import Param, ParamSpace
    from flashtune.errors import InvalidConfig
    from flashtune.families.lse import SPACE, RowLseFamily

    def family_with(knob: str) -> RowLseFamily:
        class WithKnob(RowLseFamily):
            def space(self, problem: Problem) -> ParamSpace:
                return ParamSpace((*SPACE.params, Param(knob, (0, 1))))
        return WithKnob()

    problem = Problem(64, DType.FP16, op="lse")
    with pytest.raises(InvalidConfig, match=r"'split_size' is illegal; expected lowercase"):
        family_with("split_size").search_space(problem)
    configs = family_with("splitsize").search_space(problem)
    assert len(configs) == 2 * len(LSE.search_space(problem))
    assert {c.extra("splitsize", -1) for c in configs} == {0, 1}
