"""The backward families: ``bwd`` (main kernel, atomic or split dQ), ``bwddet`` (split only),
``bwdpre`` (D and the zeroed accumulator) and ``bwdsum`` (the dQ convert).

Each is verified on its own through the family interface: NaN-poisoned outputs, fresh
random inputs, the float64 reference, both emulator thread schedules. The default run covers
a seeded two of the table's distinct default configs (at one head dim it serves, dtype and
mask drawn from the run's seed; every distinct config under ``-m sweep``) and a seeded
sample of the space; ``-m sweep`` also runs the whole table and the whole space. The split
dQ mode is bitwise equal over shuffled block orders; the atomic mode is not (the emulator's
shuffles show it) but stays within tolerance.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch
from sampling import seeded_part

from flashtune import families
from flashtune.codegen.arch import ARCHS, ArchClass, get_arch
from flashtune.codegen.spec import (
    COMPILED_HEAD_DIMS,
    MAX_HEAD_DIM,
    DType,
    KernelConfig,
    Problem,
    Shape,
)
from flashtune.families.bwd import BACKWARD, BACKWARD_DETERMINISTIC, defaults, space
from flashtune.families.bwd.rows import CONVERT, PREPROCESS
from flashtune.families.defaults import DefaultEntry
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions, Schedule
from flashtune.runtime.launch import prepare, verify

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
#: One arch per default-table class.
CLASS_ARCH = {ArchClass.SM80: "sm_80", ArchClass.SM86: "sm_86", ArchClass.SM90: "sm_90"}
ATOMIC = {"dqmode": "atomic"}
SPLIT = {"dqmode": "split"}

#: Small shapes that cover the features: GQA with lengths off the tile grid; causal Nq > Nk
#: (rows that see no key); MQA with one query row; Nq > Nk with several key tiles.
SHAPES = (Shape(1, 2, 1, 77, 70), Shape(2, 2, 2, 9, 4), Shape(1, 4, 1, 1, 100),
          Shape(1, 1, 1, 100, 33))


def _problem(head_dim: int, dtype: DType, causal: bool, op: str = "bwd") -> Problem:
    return Problem(head_dim, dtype, causal=causal, op=op)


# ------------------------------------------------------------------ registry and rules


def test_the_backward_families_are_registered() -> None:
    ops = {f.op for f in families.all_families()}
    assert {"bwd", "bwddet", "bwdpre", "bwdsum"} <= ops
    assert families.get("bwddet") is BACKWARD_DETERMINISTIC


def test_the_deterministic_family_only_has_split_configs() -> None:
    problem = _problem(64, DType.FP16, True, "bwddet")
    arch = get_arch("sm_90")
    configs = BACKWARD_DETERMINISTIC.candidates(problem, arch)
    assert configs and all(space.dq_mode(c) == "split" for c in configs)
    atomic = KernelConfig(64, 64, 4, 1, extras=ATOMIC)
    reason = BACKWARD_DETERMINISTIC.static_check(problem, atomic, arch)
    assert reason is not None and "deterministic" in reason
    modes = {space.dq_mode(c) for c in BACKWARD.candidates(_problem(64, DType.FP16, True),
                                                           arch)}
    assert modes == {"atomic", "split"}


def test_rules_name_their_reasons() -> None:
    sm86, sm90 = get_arch("sm_86"), get_arch("sm_90")
    # 8 warps over 32 keys leave 4 warps for the head dim; 40 -> 48 columns = 6 n8 tiles.
    split = BACKWARD.static_check(_problem(40, DType.FP16, False),
                                  KernelConfig(128, 32, 8, 1, extras=ATOMIC), sm90)
    assert split is not None and "n8 tiles" in split
    smem = BACKWARD.static_check(_problem(256, DType.FP16, False),
                                 KernelConfig(128, 32, 8, 2, extras=ATOMIC), sm86)
    assert smem is not None and "shared memory" in smem
    regs = BACKWARD.static_check(_problem(128, DType.FP16, False),
                                 KernelConfig(128, 128, 8, 1, extras=ATOMIC), sm90)
    assert regs is not None and "registers" in regs
    unknown = BACKWARD.static_check(_problem(64, DType.FP16, False),
                                    KernelConfig(64, 64, 4, 1, extras={"swizzle": 1}), sm90)
    assert unknown is not None and "swizzle" in unknown


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_defaults_pass_the_rules_for_every_problem(arch: str) -> None:
    spec = get_arch(arch)
    for head_dim in range(8, MAX_HEAD_DIM + 1, 8):
        for causal in (False, True):
            for family in (BACKWARD, BACKWARD_DETERMINISTIC):
                problem = _problem(head_dim, DType.FP16, causal, family.op)
                config = family.default_config(problem, spec)
                assert family.static_check(problem, config, spec) is None, (problem, config)
                assert space.dq_mode(config) == ("split" if family.deterministic else "atomic")
            for row_family in (PREPROCESS, CONVERT):
                problem = _problem(head_dim, DType.BF16, False, row_family.op)
                assert row_family.static_check(problem, row_family.default_config(problem, spec),
                                               spec) is None


def test_default_table_is_complete_with_reasons() -> None:
    keys = [e.key for e in defaults.DEFAULT_TABLE]
    assert len(keys) == len(set(keys))
    assert {(hd, c) for _, hd, c in keys} == {(hd, c) for hd in COMPILED_HEAD_DIMS
                                              for c in (False, True)}
    for entry in defaults.DEFAULT_TABLE:
        assert len(entry.reason) > 20, entry
        problem = _problem(entry.head_dim, DType.FP16, entry.causal)
        assert entry.config in BACKWARD.search_space(problem)


def test_flops_follow_the_field_convention() -> None:
    shape = Shape(2, 8, 2, 1024, 1024)
    fwd = families.get("fwd")
    for causal in (False, True):
        bwd = _problem(128, DType.BF16, causal)
        ratio = BACKWARD.flops(bwd, shape) / fwd.flops(_problem(128, DType.BF16, causal,
                                                                "fwd"), shape)
        assert ratio == 2.5


# ------------------------------------------------------------------ NVRTC


@pytest.mark.parametrize("head_dim, arch", [
    *seeded_part([(64, "sm_80"), (256, "sm_80")], 1, "bwd-nvrtc-sm_80", several=True),
    *seeded_part([(64, "sm_90"), (256, "sm_90")], 1, "bwd-nvrtc-sm_90", several=True)])
def test_main_default_compiles_without_spills(arch: str, head_dim: int) -> None:
    from flashtune.toolchain.compiler import compile_source

    problem = _problem(head_dim, DType.FP16, True)
    config = BACKWARD.default_config(problem, get_arch(arch))
    kernel = compile_source(families.render(problem, config), arch)
    assert kernel.resources.spill_bytes == 0 and kernel.resources.registers > 0
    assert kernel.resources.dynamic_smem == BACKWARD.smem_bytes(problem, config)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_row_kernels_compile_without_spills(arch: str) -> None:
    from flashtune.toolchain.compiler import compile_source

    for family in (PREPROCESS, CONVERT):
        problem = _problem(256, DType.BF16, False, family.op)
        config = family.default_config(problem, get_arch(arch))
        kernel = compile_source(families.render(problem, config), arch)
        assert kernel.resources.spill_bytes == 0


@pytest.mark.sweep
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
def test_every_default_compiles_without_spills(arch: str) -> None:
    from flashtune.toolchain.compiler import compile_source

    spec = get_arch(arch)
    for head_dim in COMPILED_HEAD_DIMS:
        for dtype in DType:
            problem = _problem(head_dim, dtype, dtype is DType.FP16)
            kernel = compile_source(families.render(problem, BACKWARD.default_config(
                problem, spec)), arch)
            assert kernel.resources.spill_bytes == 0, (problem.key(), arch)


# ------------------------------------------------------------------ the emulator


def _check(problem: Problem, config: KernelConfig, shape: Shape,
           schedules: tuple[Schedule, ...] = tuple(Schedule)) -> None:
    source = families.render(problem, config)
    for schedule in schedules:
        kernel = EmulatorBackend(options=LaunchOptions(schedule=schedule)).load(source)
        verdict = verify(kernel, shape, "cpu")
        assert verdict.ok, verdict.message


def _distinct_defaults() -> list[tuple[KernelConfig, list[int]]]:
    """Every distinct config of the default table and the compiled head dims it serves."""
    served: dict[KernelConfig, set[int]] = {}
    for entry in defaults.DEFAULT_TABLE:
        served.setdefault(entry.config, set()).add(entry.head_dim)
    return [(c, sorted(hds)) for c, hds in sorted(served.items(), key=lambda kv: kv[0].key())]


def _cases() -> list[Any]:
    """Every distinct default config (head dim it serves, dtype, mask and shape drawn from
    the seed; all of them atomic): a seeded two by default, the rest under ``-m sweep``;
    and a seeded config of the space."""
    rng = random.Random(SEED)
    table = []
    for config, head_dims in _distinct_defaults():
        problem = _problem(rng.choice(head_dims), rng.choice(list(DType)), rng.random() < 0.5)
        table.append((problem, config, rng.choice(SHAPES)))
    cases: list[Any] = seeded_part(table, 2, "bwd-defaults")
    # A sample of the space: a padded head dim or not, either dQ mode, one or two stages.
    problem = _problem(64, DType.FP16, True)
    sample = rng.sample(BACKWARD.candidates(problem, get_arch("sm_90")), 1)
    for config in sample:
        head_dim = rng.choice([hd for hd in (40, 64, 72) if BACKWARD.static_check(
            _problem(hd, DType.FP16, True), config, get_arch("sm_90")) is None])
        cases.append((_problem(head_dim, rng.choice(list(DType)), rng.random() < 0.5), config,
                      rng.choice(SHAPES)))
    return cases


@pytest.mark.emulator
@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"{c[0].key()}-{c[1].key()}-"
                                                        f"{c[2].key()}")
def test_main_kernel_matches_float64(case: tuple[Problem, KernelConfig, Shape]) -> None:
    _check(*case)


@pytest.mark.emulator
@pytest.mark.parametrize("family", [PREPROCESS, CONVERT], ids=lambda f: f.op)
def test_row_kernels_match_float64(family: families.KernelFamily) -> None:
    rng = random.Random(SEED)
    problem = _problem(rng.choice((40, 128)), rng.choice(list(DType)), False, family.op)
    _check(problem, family.default_config(problem, get_arch("sm_90")), Shape(2, 3, 1, 77, 5))


def _run(problem: Problem, config: KernelConfig, shape: Shape, order_seed: int | None
         ) -> dict[str, torch.Tensor]:
    kernel = EmulatorBackend(options=LaunchOptions(block_order_seed=order_seed)).load(
        families.render(problem, config))
    launch = prepare(kernel, shape, "cpu", seed=SEED, poison=True)
    launch.run()
    verdict = launch.verdict()
    assert verdict.ok, f"block order {order_seed}: {verdict.message}"
    return launch.outputs


@pytest.mark.emulator
def test_split_mode_is_bitwise_equal_over_shuffled_block_orders() -> None:
    """GQA, causal, 7 key tiles in 2 slices (4 SMs over 2 kv heads): each block adds several
    key tiles into its own slice, whatever order the blocks run in."""
    problem = _problem(32, DType.BF16, True, "bwddet")
    config = KernelConfig(32, 32, 2, 2, extras=SPLIT)
    shape = Shape(1, 4, 2, 150, 200)
    runs = [_run(problem, config, shape, seed) for seed in (None, 1, 2, 3)]
    assert runs[0]["dq_accum"].shape[0] == 2
    for other in runs[1:]:
        for name in ("dk", "dv", "dq_accum"):
            assert torch.equal(other[name], runs[0][name]), name


@pytest.mark.emulator
def test_atomic_mode_depends_on_block_order_within_tolerance() -> None:
    """Float32 atomics land in block order: the shuffles change dQ's last bits (which shows
    that the shuffle reaches the sum), every order within tolerance (checked in _run)."""
    problem = _problem(32, DType.FP16, True)
    config = KernelConfig(32, 32, 2, 1, extras=ATOMIC)
    shape = Shape(1, 2, 1, 64, 256)
    runs = [_run(problem, config, shape, seed) for seed in (None, 1, 2)]
    assert any(not torch.equal(r["dq_accum"], runs[0]["dq_accum"]) for r in runs[1:])
    for r in runs[1:]:
        assert torch.equal(r["dk"], runs[0]["dk"]) and torch.equal(r["dv"], runs[0]["dv"])


@pytest.mark.emulator
def test_rows_without_keys_and_a_wrong_result_are_caught() -> None:
    problem = _problem(32, DType.FP16, True)  # the kernel of the block-order test
    kernel = EmulatorBackend().load(families.render(problem, KernelConfig(32, 32, 2, 1,
                                                                          extras=ATOMIC)))
    shape = Shape(1, 1, 1, 9, 4)  # causal: rows 0..4 see no key
    launch = prepare(kernel, shape, "cpu", poison=True)
    launch.run()
    assert torch.isposinf(launch.inputs.tensors["lse"][0, 0, :5]).all()
    assert (launch.outputs["dq_accum"][:, 0, 0, :5] == 0).all()
    assert launch.verdict().ok
    launch.outputs["dv"][0, 1, 0, 3] += 0.05  # what a wrong kernel would have written
    assert not launch.verdict().ok


# ------------------------------------------------------------------ sweeps


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("entry", defaults.DEFAULT_TABLE,
                         ids=lambda e: f"{e.arch_class.value}-d{e.head_dim}-"
                                       f"{'causal' if e.causal else 'full'}")
def test_every_default_entry_in_the_emulator(entry: DefaultEntry) -> None:
    for dtype in DType:
        for family in (BACKWARD, BACKWARD_DETERMINISTIC):
            problem = _problem(entry.head_dim, dtype, entry.causal, family.op)
            config = defaults.default_config(problem, CLASS_ARCH[entry.arch_class],
                                             deterministic=family.deterministic)
            _check(problem, config, Shape(1, 2, 1, 77, 130), (Schedule.FORWARD,))


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("config", BACKWARD.candidates(_problem(64, DType.BF16, True),
                                                       get_arch("sm_90")),
                         ids=KernelConfig.key)
def test_full_space_in_the_emulator(config: KernelConfig) -> None:
    for causal in (False, True):
        _check(_problem(64, DType.BF16, causal), config, Shape(2, 2, 1, 150, 200),
               (Schedule.FORWARD,))


# ------------------------------------------------------------------ command line


@pytest.mark.emulator
def test_cli_shows_profiles_and_checks_the_backward() -> None:
    from typer.testing import CliRunner

    from flashtune.cli import app

    runner = CliRunner()
    listed = runner.invoke(app, ["families"])
    assert listed.exit_code == 0
    assert all(op in listed.output for op in ("bwd", "bwddet", "bwdpre", "bwdsum"))
    shown = runner.invoke(app, ["show", "--op", "bwddet", "--head-dim", "64", "--causal"])
    assert shown.exit_code == 0, shown.output
    assert "ft::flash_bwd" in shown.output and "kDqSplit = true" in shown.output
    checked = runner.invoke(app, ["check", "--op", "bwd", "--head-dim", "32", "--causal",
                                  "--config", "m32_n32_w2_s1_dqmode-atomic", "--seqlen-q", "40",
                                  "--seqlen-k", "70", "--no-compile"])
    assert checked.exit_code == 0, checked.output
