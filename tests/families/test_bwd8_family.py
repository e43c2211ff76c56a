"""The FP8 backward (``bwd8``): e4m3 or e5m2 Q, K, V with descale factors, a 16-bit dO; dK,
dV and the dQ accumulator against float64 autograd of the dequantised inputs (the 16-bit
backward's reference and tolerances of dO's type), on NaN-poisoned outputs and fresh inputs
(the emulator; both thread schedules). A seeded sample runs by default (the seed is in the
ids; every feature each run, a seeded one of the single softcap, ALiBi and varlen sets),
the grid of head dims, types, masks, features and configs under ``-m sweep``.

The measurement behind its precisions (16-bit P and dS) is
``tests/benchmarks/test_bench_fp8_backward_error.py``."""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
from typing import Any

import pytest
import torch
from sampling import seeded_part

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.dtypes import DType, Fp8Type
from flashtune.codegen.spec import KernelConfig, Problem, Shape
from flashtune.errors import InvalidConfig
from flashtune.families.base import Inputs
from flashtune.families.bwd8 import BACKWARD_FP8
from flashtune.families.fwd8 import DESCALES
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions, Schedule
from flashtune.runtime.launch import prepare
from flashtune.toolchain.compiler import compile_source

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
ARCH = get_arch("sm_89")
#: GQA with lengths off the tile grid; causal Nq > Nk (rows that see no key); Nq > Nk.
SHAPES = (Shape(1, 2, 1, 77, 70), Shape(2, 2, 2, 9, 4), Shape(1, 1, 1, 100, 33))
FEATURES: tuple[frozenset[str], ...] = (
    frozenset(), frozenset({"window"}), frozenset({"softcap"}), frozenset({"alibi"}),
    frozenset({"varlen"}), frozenset({"varlen", "softcap", "alibi"}))
CONFIGS = (None, KernelConfig(64, 64, 4, 2, extras={"dqmode": "split"}),
           KernelConfig(64, 32, 2, 1, extras={"dqmode": "atomic"}))


def problem(head_dim: int, fmt: Fp8Type, out: DType, causal: bool,
            features: frozenset[str] = frozenset()) -> Problem:
    return Problem(head_dim, fmt, causal=causal and "window" not in features, op="bwd8",
                   o_dtype=out, features=features)


Case = tuple[Problem, KernelConfig, Shape]


def _grid() -> list[Case]:
    cases = []
    for d, fmt, out, causal, feats, config, shape in itertools.product(
            (32, 64, 128), Fp8Type, DType, (False, True), FEATURES, CONFIGS, SHAPES):
        p = problem(d, fmt, out, causal, feats)
        chosen = config or BACKWARD_FP8.default_config(p, ARCH)
        if BACKWARD_FP8.static_check(p, chosen, ARCH) is None:
            cases.append((p, chosen, shape))
    return cases


GRID = _grid()


def _sample(seed: int) -> list[Any]:
    """One case per feature set, drawn with ``seed``: by default those without features, with
    the window and with the combined set (every feature among them), and a seeded one of
    the single softcap, ALiBi and varlen sets (the others under ``-m sweep``)."""
    rng = random.Random(seed)
    drawn = [rng.choice([c for c in GRID if frozenset(c[0].features) == f]) for f in FEATURES]
    singles = [c for c in drawn if frozenset(c[0].features) in FEATURES[2:5]]
    return [*(c for c in drawn if c not in singles),
            *seeded_part(singles, 1, "bwd8-features")]


def _id(case: Case) -> str:
    return f"{case[0].key()}-{case[1].key()}-{case[2].key()}"


def _check(case: Case, schedule: Schedule = Schedule.FORWARD, order_seed: int | None = None
           ) -> dict[str, torch.Tensor]:
    """The outputs of ``case``'s launch (NaN-poisoned, fresh inputs of the run's seed),
    asserted within the reference's tolerance; ``order_seed``: a shuffled block order."""
    p, config, shape = case
    kernel = EmulatorBackend(options=LaunchOptions(schedule=schedule,
                                                   block_order_seed=order_seed)).load(
        families.render(p, config))
    launch = prepare(kernel, shape, "cpu", seed=SEED, poison=True)
    launch.run()
    verdict = launch.verdict()
    assert verdict.ok, f"seed {SEED}, block order {order_seed}: {verdict.message}"
    return launch.outputs


@pytest.mark.emulator
@pytest.mark.parametrize("case", _sample(SEED), ids=_id)
def test_fp8_backward_matches_float64_of_the_dequantised_inputs(case: Case) -> None:
    print(f"FLASHTUNE_TEST_SEED={SEED}")
    _check(case, random.Random(SEED).choice(list(Schedule)))


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("case", GRID, ids=_id)
def test_fp8_backward_whole_grid(case: Case) -> None:
    _check(case)


@pytest.mark.emulator
def test_the_deterministic_family_is_bitwise_equal_over_shuffled_block_orders() -> None:
    """``bwd8det``: GQA, causal, a window and softcap, 7 key tiles in 2 slices; every block
    adds its key tiles into its own dQ slice whatever order the blocks run in."""
    p = dataclasses.replace(problem(32, Fp8Type.E4M3, DType.BF16, False,
                                    frozenset({"window", "softcap"})), op="bwd8det")
    config = KernelConfig(32, 32, 2, 2, extras={"dqmode": "split"})
    assert families.get("bwd8det").static_check(p, config, ARCH) is None
    case = (p, config, Shape(1, 4, 2, 150, 200))
    runs = [_check(case, order_seed=seed) for seed in (None, 1, 2, 3)]
    for other in runs[1:]:
        for name in ("dk", "dv", "dq_accum"):
            assert torch.equal(other[name], runs[0][name]), name


@pytest.mark.emulator
def test_each_descale_factor_reaches_the_gradients() -> None:
    """The kernel's outputs match the reference of its own descales and fail against the
    reference of any one descale doubled (a kernel that ignored one would pass the other)."""
    p = problem(64, Fp8Type.E4M3, DType.BF16, True)
    config = BACKWARD_FP8.default_config(p, ARCH)
    shape = Shape(1, 2, 1, 40, 50)
    kernel = EmulatorBackend().load(families.render(p, config))
    launch = prepare(kernel, shape, "cpu", seed=SEED, poison=True)
    launch.run()
    assert launch.verdict().ok, launch.verdict().message
    inputs = launch.inputs
    for name in DESCALES:
        changed = Inputs({**inputs.tensors, name: inputs.tensors[name] * 2}, inputs.scalars)
        verdict = BACKWARD_FP8.compare(p, shape, launch.outputs,
                                       BACKWARD_FP8.reference(p, changed))
        assert not verdict.ok, name


def test_dk_and_dv_take_dos_type_and_q_k_v_are_fp8() -> None:
    p = problem(64, Fp8Type.E5M2, DType.FP16, False)
    inputs = BACKWARD_FP8.random_inputs(p, SHAPES[0], "cpu", seed=SEED)
    assert {inputs.tensors[n].dtype for n in ("q", "k", "v")} == {torch.float8_e5m2}
    assert inputs.tensors["do"].dtype == torch.float16
    out = BACKWARD_FP8.empty_outputs(p, SHAPES[0], inputs, poison=True)
    assert out["dk"].dtype == out["dv"].dtype == torch.float16
    assert "fp8_format" in BACKWARD_FP8.template_params(p, BACKWARD_FP8.default_config(p, ARCH))


def test_archs_without_fp8_mma_and_odd_head_dims_are_refused() -> None:
    with pytest.raises(InvalidConfig, match="sm_80 has no FP8 tensor cores"):
        BACKWARD_FP8.default_config(problem(64, Fp8Type.E4M3, DType.BF16, False),
                                    get_arch("sm_80"))
    with pytest.raises(InvalidConfig, match="multiples of 32"):
        BACKWARD_FP8.default_config(problem(80, Fp8Type.E4M3, DType.BF16, False), ARCH)


@pytest.mark.parametrize("arch, head_dim", [
    case for arch in ("sm_89", "sm_90")
    for case in seeded_part([(arch, d) for d in (64, 128, 256)], 1, f"bwd8-nvrtc-{arch}",
                            several=True)])
def test_defaults_compile_without_spills(arch: str, head_dim: int) -> None:
    """Per arch, the default at a seeded one of the head dims (all under ``-m sweep``)."""
    p = problem(head_dim, Fp8Type.E4M3, DType.BF16, True)
    kernel = compile_source(families.render(p, BACKWARD_FP8.default_config(p, get_arch(arch))),
                            arch)
    print(arch, head_dim, kernel.resources)
    assert kernel.resources.spill_stores == 0 and kernel.resources.spill_loads == 0
