"""The FP8 forward (``fwd8``: e4m3 Q, K, V with descale factors, a 16-bit O) in the CPU
emulator against float64, its refusals, and NVRTC builds for sm_89 and sm_90.

The bound: the reference is float64 attention of the dequantised inputs (each e4m3 value,
exactly as torch decodes it, times its (batch, KV head) descale factor). The kernel's
differences from it are the 16-bit forward's own (fp32 sums of exact products in Q K^T,
exp2 in fp32, P rounded to O's type, fp32 P V sums, O rounded to its type), so the check is
the 16-bit forward's of O's type (``families.checks.O_TOLERANCE``: |err| <= atol + rtol |ref|
with atol = rtol = 4e-3 for fp16, 2.5e-2 for bf16; the LSE 1e-3 + 2e-6 |ref|), O's widened by
P's rounding (one unit roundoff of O's type times P |V|), on every element, with outputs
poisoned with NaN before the launch. Inputs: standard normal values rounded to e4m3,
descales drawn from [0.25, 4). The default run takes a seeded sample (the
seed in each id replays it; of the feature sets, the two combined ones and a seeded single
one); ``-m sweep`` the grid.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch
import typer
from hopper_sample import param_id
from sampling import seeded_part

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.dtypes import DType, Fp8Type
from flashtune.codegen.spec import KernelConfig, Problem, Shape
from flashtune.errors import FeatureNotSupported, InvalidConfig, InvalidProblem
from flashtune.families.checks import O_TOLERANCE
from flashtune.families.fwd8 import FORWARD_FP8, O_BOUND, RANDOM_DESCALE
from flashtune.perf.sass.parse import categorize
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions
from flashtune.toolchain.compiler import compile_source
from flashtune.toolchain.disasm import disassemble

HEAD_DIMS = (32, 64, 96, 128, 256)
#: (batch, heads_q, heads_kv, seqlen_q, seqlen_k): GQA 4:2 with lengths off the tile grid,
#: MQA with Nq < Nk, causal Nq > Nk (rows that see no key: O = 0, LSE = +inf).
SHAPES = (Shape(2, 4, 2, 100, 77), Shape(1, 3, 1, 33, 150), Shape(1, 2, 2, 90, 20))
#: Configs with each structure knob the forward has (swizzled rows, Q in registers,
#: pipelined Q K^T, one to three stages).
CONFIGS = (KernelConfig(64, 32, 4, 2), KernelConfig(64, 64, 4, 1),
           KernelConfig(128, 32, 4, 3, extras=(("swizzle", 1),)),
           KernelConfig(64, 32, 4, 2, extras=(("qregs", 1), ("pipeline", 1))),
           KernelConfig(16, 16, 1, 2))


def problem(head_dim: int, out: DType, causal: bool, fmt: Fp8Type = Fp8Type.E4M3) -> Problem:
    return Problem(head_dim, fmt, causal=causal, op="fwd8", o_dtype=out)


def run(p: Problem, config: KernelConfig, shape: Shape, seed: int) -> None:
    kernel = EmulatorBackend(options=LaunchOptions()).load(families.render(p, config))
    inputs = FORWARD_FP8.random_inputs(p, shape, "cpu", seed)
    assert inputs.tensors["q"].dtype == getattr(torch, p.dtypes.q.element.torch)
    outputs = FORWARD_FP8.empty_outputs(p, shape, inputs, poison=True)
    assert outputs["o"].dtype == getattr(torch, p.dtypes.o.element.torch)
    assert torch.isnan(outputs["o"]).all() and torch.isnan(outputs["lse"]).all()
    plan = FORWARD_FP8.launch_plan(p, config, shape, inputs, outputs)
    kernel.launch(plan.grid, plan.args)
    verdict = FORWARD_FP8.compare(p, shape, outputs, FORWARD_FP8.reference(p, inputs))
    assert verdict.ok, f"{p.key()} {config.key()} {shape} seed={seed}: {verdict.message}"


def _grid() -> list[tuple[int, DType, bool, KernelConfig, Shape]]:
    return [(d, o, causal, c, s) for d, o, causal, c, s in itertools.product(
        HEAD_DIMS, DType, (False, True), CONFIGS, SHAPES)
        if FORWARD_FP8.static_check(problem(d, o, causal), c, get_arch("sm_89")) is None]


#: The session's seed (tests/conftest.py sets FLASHTUNE_TEST_SEED, fresh unless given).
_SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
_GRID = _grid()
#: The default run: two rows of the grid (one per O type), chosen by the session's seed,
#: which the ids carry (rows that see no key: the test after it).
SAMPLE = [(*random.Random(_SEED + i).choice([r for r in _GRID if r[1] is o]), _SEED + i)
          for i, o in enumerate(DType)]


@pytest.mark.emulator
@pytest.mark.parametrize("head_dim, out, causal, config, shape, seed", SAMPLE,
                         ids=param_id)
def test_fp8_forward_matches_float64_of_the_dequantised_inputs(
        head_dim: int, out: DType, causal: bool, config: KernelConfig, shape: Shape,
        seed: int) -> None:
    print(f"seed={seed}")
    run(problem(head_dim, out, causal), config, shape, seed)


@pytest.mark.emulator
def test_fp8_forward_rows_that_see_no_key_and_gqa() -> None:
    """Causal with Nq > Nk (the first rows see no key: O = 0, LSE = +inf), GQA 2:1."""
    run(problem(64, DType.BF16, True), KernelConfig(64, 32, 4, 2), Shape(1, 2, 1, 70, 20),
        _SEED)


@pytest.mark.emulator
@pytest.mark.sweep
@pytest.mark.parametrize("head_dim, out, causal, config, shape", _GRID, ids=param_id)
def test_fp8_forward_grid(head_dim: int, out: DType, causal: bool, config: KernelConfig,
                          shape: Shape) -> None:
    run(problem(head_dim, out, causal), config, shape, _SEED)


#: e5m2 inputs: a seeded row of the grid by default (both O types over the run's seeds), the
#: grid's first two configs under -m sweep.
E5M2_SAMPLE = [(*random.Random(f"{_SEED}e5m2").choice(_GRID), _SEED)]


@pytest.mark.emulator
@pytest.mark.parametrize("head_dim, out, causal, config, shape, seed", E5M2_SAMPLE,
                         ids=param_id)
def test_e5m2_forward_matches_float64_of_the_dequantised_inputs(
        head_dim: int, out: DType, causal: bool, config: KernelConfig, shape: Shape,
        seed: int) -> None:
    """e5m2 Q, K and V (Q K^T on the e5m2 mma, V dequantised exactly): the same bound as
    e4m3's, against float64 of the e5m2-rounded inputs."""
    print(f"seed={seed}")
    run(problem(head_dim, out, causal, Fp8Type.E5M2), config, shape, seed)


@pytest.mark.emulator
@pytest.mark.sweep
@pytest.mark.parametrize("head_dim, out, causal, config, shape",
                         [r for r in _GRID if r[3] in CONFIGS[:2]], ids=param_id)
def test_e5m2_forward_grid(head_dim: int, out: DType, causal: bool, config: KernelConfig,
                           shape: Shape) -> None:
    run(problem(head_dim, out, causal, Fp8Type.E5M2), config, shape, _SEED)


def test_descale_factors_reach_the_reference() -> None:
    """The reference scales each operand by its own factor: doubling v_descale doubles O,
    doubling q_descale changes the softmax (not O's scale)."""
    p = problem(64, DType.FP16, False)
    shape = Shape(1, 2, 1, 5, 7)
    inputs = FORWARD_FP8.random_inputs(p, shape, "cpu", 3)
    lo, hi = RANDOM_DESCALE
    for name in ("q_descale", "k_descale", "v_descale"):
        t = inputs.tensors[name]
        assert t.shape == (1, 1) and t.dtype == torch.float32
        assert bool(((t >= lo) & (t < hi)).all())
    ref = FORWARD_FP8.reference(p, inputs)["o"]
    doubled = {**inputs.tensors, "v_descale": 2 * inputs.tensors["v_descale"]}
    ref2 = FORWARD_FP8.reference(p, type(inputs)(doubled, inputs.scalars))["o"]
    torch.testing.assert_close(ref2, 2 * ref)
    sharper = {**inputs.tensors, "q_descale": 2 * inputs.tensors["q_descale"]}
    ref3 = FORWARD_FP8.reference(p, type(inputs)(sharper, inputs.scalars))["o"]
    assert not torch.allclose(ref3, ref)


@pytest.mark.emulator
def test_v_far_from_unit_scale_passes_within_p_rounding() -> None:
    """With V at 64x its drawn descale (values up to about 1,000), the kernel's O is off by
    more than the fixed bf16 tolerance (P rounded to bf16 before P V; measured 3-7x that
    tolerance) and within it plus P's rounding bound (about 0.4 of it)."""
    p, config = problem(64, DType.BF16, True), KernelConfig(64, 32, 4, 2)
    shape = Shape(1, 2, 1, 70, 50)
    inputs = FORWARD_FP8.random_inputs(p, shape, "cpu", _SEED)
    inputs = type(inputs)({**inputs.tensors, "v_descale": 64 * inputs.tensors["v_descale"]},
                          inputs.scalars)
    kernel = EmulatorBackend(options=LaunchOptions()).load(families.render(p, config))
    outputs = FORWARD_FP8.empty_outputs(p, shape, inputs, poison=True)
    plan = FORWARD_FP8.launch_plan(p, config, shape, inputs, outputs)
    kernel.launch(plan.grid, plan.args)
    ref = FORWARD_FP8.reference(p, inputs)
    err = (outputs["o"].double() - ref["o"]).abs()
    tol = O_TOLERANCE[DType.BF16]
    fixed = tol.atol + tol.rtol * ref["o"].abs()
    print(f"seed {_SEED}: max |err| / fixed tolerance {float((err / fixed).max()):.3g}, "
          f"/ (fixed + bound) {float((err / (fixed + ref[O_BOUND])).max()):.3g}")
    verdict = FORWARD_FP8.compare(p, shape, outputs, ref)
    assert verdict.ok, f"seed {_SEED}: {verdict.message}"


def test_o_is_allowed_p_rounding_times_p_abs_v_and_no_more() -> None:
    """Beyond the 16-bit tolerance, O may be off by one unit roundoff of O's type times
    P |V| (the kernel rounds P before P V; with V at 64x descale that rounding dwarfs the
    tolerance, which assumes V of unit scale), and no more: the reference passes as the
    kernel's output, its element of largest allowance moved 0.99x that allowance passes,
    1.01x fails."""
    p = problem(64, DType.BF16, True)
    shape = Shape(1, 4, 2, 40, 50)
    inputs = FORWARD_FP8.random_inputs(p, shape, "cpu", _SEED)
    t = {**inputs.tensors, "v_descale": 64 * inputs.tensors["v_descale"]}
    inputs = type(inputs)(t, inputs.scalars)
    ref = FORWARD_FP8.reference(p, inputs)
    bound, o = ref[O_BOUND], ref["o"]
    largest_v = float((t["v"].double() * t["v_descale"].double()[:, None, :, None]).abs().max())
    assert float(bound.max()) <= 2.0 ** -8 * largest_v * (1 + 1e-12)  # bf16's unit roundoff
    tol = O_TOLERANCE[DType.BF16]
    assert float(bound.max()) > 10 * tol.atol, f"seed {_SEED}"  # the bound matters here
    i = int(bound.argmax())
    allowed = tol.atol + tol.rtol * abs(float(o.flatten()[i])) + float(bound.flatten()[i])
    for factor, ok in ((0.0, True), (0.99, True), (1.01, False)):
        moved = o.clone(memory_format=torch.contiguous_format)
        moved.view(-1)[i] += factor * allowed
        verdict = FORWARD_FP8.compare(p, shape, {**ref, "o": moved}, ref)
        assert verdict.ok == ok, (factor, _SEED, verdict.message)


def test_archs_without_fp8_mma_are_refused_naming_the_arch() -> None:
    p = problem(128, DType.BF16, True)
    config = FORWARD_FP8.default_config(p, get_arch("sm_89"))
    for arch in ("sm_80", "sm_86"):
        why = FORWARD_FP8.static_check(p, config, get_arch(arch))
        assert why is not None and arch in why and "sm_89 or sm_90" in why
        with pytest.raises(InvalidConfig, match=arch):
            FORWARD_FP8.default_config(p, get_arch(arch))
    for arch in ("sm_89", "sm_90"):
        assert FORWARD_FP8.static_check(p, config, get_arch(arch)) is None


def test_head_dims_off_the_k32_step_and_16bit_inputs_are_refused() -> None:
    why = FORWARD_FP8.static_check(problem(80, DType.BF16, False), KernelConfig(64, 32, 4, 2),
                                   get_arch("sm_89"))
    assert why is not None and "head_dim=80" in why and "96" in why
    with pytest.raises(InvalidProblem, match=r"does not take the element types bf16.*"
                                             r"q=e4m3 kv=e4m3 o=bf16"):
        FORWARD_FP8.check_problem(Problem(64, DType.BF16, op="fwd8"))
    with pytest.raises(InvalidProblem, match="does not take the element types"):
        families.get("fwd").check_problem(Problem(64, Fp8Type.E4M3, o_dtype=DType.BF16))


#: The e4m3 defaults compiled per arch: a seeded one of two head dims (O types) each run.
_E4M3_DEFAULTS = [case for arch in ("sm_89", "sm_90") for case in seeded_part(
    [(arch, 64, DType.BF16), (arch, 128, DType.FP16)], 1, f"fwd8-nvrtc-{arch}", several=True)]


@pytest.mark.parametrize("arch, head_dim, out", _E4M3_DEFAULTS, ids=param_id)
def test_default_kernels_compile(arch: str, head_dim: int, out: DType) -> None:
    """NVRTC and ptxas accept the m16n8k32 e4m3 mma and the FP8 conversions for both
    archs; on sm_89 the default configs hold their registers and Q K^T is the native QMMA
    (sm_90's ptxas emulates the FP8 mma.sync with more registers: some defaults spill
    there). Each run compiles one of two head dims per arch (drawn from the seed)."""
    p = problem(head_dim, out, True)
    config = FORWARD_FP8.default_config(p, get_arch(arch))
    kernel = compile_source(families.render(p, config), arch)
    if arch == "sm_89":
        assert kernel.resources.spill_stores == 0 and kernel.resources.spill_loads == 0
        # Ada's FP8 tensor-core instruction, counted as 16 x 8 x 32 mma work; sm_90's
        # ptxas lowers the same mma.sync to conversions and HMMA.16816 pairs.
        sass = disassemble(kernel.cubin)
        assert "QMMA.16832.F32.E4M3.E4M3" in sass
        assert categorize("QMMA.16832.F32.E4M3.E4M3") == "mma"


@pytest.mark.parametrize("arch", ["sm_89", "sm_90"])
def test_e5m2_default_kernels_compile(arch: str) -> None:
    """The e5m2 default for both archs; on sm_89 without spills, Q K^T the native QMMA."""
    p = problem(128, DType.BF16, True, Fp8Type.E5M2)
    kernel = compile_source(families.render(p, FORWARD_FP8.default_config(p, get_arch(arch))),
                            arch)
    if arch == "sm_89":
        assert kernel.resources.spill_stores == 0 and kernel.resources.spill_loads == 0
        assert "QMMA.16832.F32.E5M2.E5M2" in disassemble(kernel.cubin)


def test_the_command_line_names_the_fp8_problem_by_its_output_type() -> None:
    """``--op fwd8 --dtype bf16``: e4m3 Q, K, V and a bf16 O (show, compile, check, space,
    profile); the 16-bit families keep one type for every operand."""
    from flashtune.commands.codegen import parse_problem

    assert parse_problem("fwd8", 128, DType.BF16, True).key() == (
        "fwd8_d128_e4m3-e4m3-bf16_causal")
    assert parse_problem("fwd", 128, DType.BF16, True).key() == "fwd_d128_bf16_causal"
    assert parse_problem("fwd8", 64, DType.FP16, False, "e5m2").key() == (
        "fwd8_d64_e5m2-e5m2-fp16_full")
    assert parse_problem("fwd", 64, DType.FP16, False, "fp16").key() == "fwd_d64_fp16_full"
    for op, wrong in (("fwd8", "e3m4"), ("fwd", "e5m2")):
        with pytest.raises(typer.BadParameter, match="--input-dtype|takes"):
            parse_problem(op, 64, DType.FP16, False, wrong)



#: The features the FP8 forward compiles with the 16-bit forward's hooks: each alone and all
#: together (softcap and ALiBi take the dequantised scores' scale, flash_fwd.cuh's qk_scale).
FEATURE_SETS = (frozenset({"window"}), frozenset({"softcap"}), frozenset({"alibi"}),
                frozenset({"window", "softcap", "alibi"}), frozenset({"varlen"}),
                frozenset({"sinks"}), frozenset({"varlen", "sinks", "alibi", "softcap"}))


def feature_problem(head_dim: int, out: DType, causal: bool, features: frozenset[str]
                    ) -> Problem:
    return Problem(head_dim, Fp8Type.E4M3, causal=causal, op="fwd8", o_dtype=out,
                   features=features)


def _feature_grid() -> list[tuple[int, DType, bool, frozenset[str], KernelConfig, Shape]]:
    return [(d, o, causal, f, c, s) for d, o, causal, f, c, s in itertools.product(
        (64, 128), DType, (False, True), FEATURE_SETS, CONFIGS[:2], SHAPES)
        if not (causal and "window" in f)  # a causal window is the window (left, 0)
        and FORWARD_FP8.static_check(feature_problem(d, o, causal, f), c,
                                    get_arch("sm_89")) is None]


_FEATURE_GRID = _feature_grid()
#: One row per feature set, chosen by the session's seed (in the id). The default run takes
#: the two combined sets (every feature among them) and a seeded one of the single ones;
#: ``-m sweep`` every set's row (and the grid).
_FEATURE_ROWS = [(*random.Random(_SEED + 10 + i).choice(
    [r for r in _FEATURE_GRID if r[3] == f]), _SEED + 10 + i)
    for i, f in enumerate(FEATURE_SETS)]
_COMBINED = [r for r in _FEATURE_ROWS if len(r[3]) > 1]
assert frozenset().union(*(r[3] for r in _COMBINED)) == frozenset().union(*FEATURE_SETS)
FEATURE_SAMPLE = [*_COMBINED, *seeded_part([r for r in _FEATURE_ROWS if len(r[3]) == 1], 1,
                                           "fwd8-features", several=True)]


@pytest.mark.emulator
@pytest.mark.parametrize("head_dim, out, causal, features, config, shape, seed",
                         FEATURE_SAMPLE, ids=lambda v: "+".join(sorted(v))
                         if isinstance(v, frozenset) else param_id(v))
def test_fp8_forward_with_window_softcap_alibi_matches_float64(
        head_dim: int, out: DType, causal: bool, features: frozenset[str],
        config: KernelConfig, shape: Shape, seed: int) -> None:
    print(f"seed={seed}")
    run(feature_problem(head_dim, out, causal, features), config, shape, seed)


@pytest.mark.emulator
@pytest.mark.sweep
@pytest.mark.parametrize("head_dim, out, causal, features, config, shape", _FEATURE_GRID,
                         ids=lambda v: "+".join(sorted(v))
                         if isinstance(v, frozenset) else param_id(v))
def test_fp8_forward_features_grid(head_dim: int, out: DType, causal: bool,
                                   features: frozenset[str], config: KernelConfig,
                                   shape: Shape) -> None:
    run(feature_problem(head_dim, out, causal, features), config, shape, 7)


@pytest.mark.parametrize("feature, words", [("dropout", "attention dropout")])
def test_features_without_an_fp8_path_are_refused(feature: str, words: str) -> None:
    with pytest.raises(FeatureNotSupported, match=rf"'fwd8' kernel family .* does not "
                       rf"implement {words}"):
        families.render(feature_problem(64, DType.BF16, False, frozenset({feature})),
                        KernelConfig(64, 32, 4, 2))
