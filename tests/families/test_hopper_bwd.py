"""The sm_90a backward family (``bwd90a``: wgmma, all-thread cp.async loads): registry, space
and rules with reasons, NVRTC for sm_90a (no spills; HGMMA in the SASS), and numerics in the
emulator: against the family's float64 reference (NaN-poisoned outputs, both thread orders)
and against float64 autograd through plain PyTorch (flash-attn's error rule), over head dims
64, 128 and 256, fp16 and bf16, causal and not, GQA/MQA and odd lengths; the deterministic dQ mode
bitwise equal over the linear and three shuffled block orders. The default run takes a seeded
sample (the seed is printed by the run; ``FLASHTUNE_TEST_SEED`` replays it; NVRTC, the
default's numerics and the autograd check each at a seeded head dim); ``-m sweep`` the full
grid."""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import re

import pytest
import torch
from grad_helpers import attention_reference, error_ratios, gradients, within_rule
from hopper_sample import hgmma_shapes
from sampling import seeded_part

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.errors import InvalidConfig, InvalidProblem
from flashtune.families.base import torch_dtype
from flashtune.families.bwd90a import HOPPER_BACKWARD, space
from flashtune.runtime import plans
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions, Schedule
from flashtune.runtime.launch import prepare, verify
from flashtune.toolchain.compiler import compile_source

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
SM90A = get_arch("sm_90a")
HEAD_DIMS = space.HEAD_DIMS
#: GQA with lengths off the tile grid; causal Nq > Nk (rows that see no key); MQA with one
#: query row; Nq > Nk over several key tiles; several query and key tiles of equal lengths.
SHAPES = (Shape(1, 4, 2, 77, 150), Shape(2, 2, 2, 9, 4), Shape(1, 4, 1, 1, 100),
          Shape(1, 1, 1, 150, 33), Shape(1, 2, 1, 130, 130))


def _problem(head_dim: int, dtype: DType, causal: bool) -> Problem:
    return Problem(head_dim, dtype, causal=causal, op=HOPPER_BACKWARD.op)


def _config(block_n: int, dqmode: str = space.DQ_ATOMIC) -> KernelConfig:
    return HOPPER_BACKWARD.config({"block_m": 64, "block_n": block_n, "num_stages": 1,
                                   "dqmode": dqmode})


# ------------------------------------------------------------------ registry and rules


def test_registered_as_sm90a_families_serving_the_backward() -> None:
    """bwd90a serves ``bwd`` and its deterministic restriction bwd90adet serves ``bwddet``
    (the split dQ mode only: the atomic mode is refused naming why)."""
    assert families.get("bwd90a") is HOPPER_BACKWARD
    assert HOPPER_BACKWARD.target_arch == "sm_90a" and HOPPER_BACKWARD.serves == "bwd"
    det = families.get("bwd90adet")
    assert det.target_arch == "sm_90a" and det.serves == "bwddet"
    problem = _problem(128, DType.BF16, True)
    assert {space.dq_mode(c) for c in det.candidates(problem, SM90A)} == {space.DQ_SPLIT}
    assert space.dq_mode(det.default_config(problem, SM90A)) == space.DQ_SPLIT
    why = det.static_check(problem, _config(128, space.DQ_ATOMIC), SM90A)
    assert why is not None and "deterministic backward needs dqmode='split'" in why
    source = families.render(_problem(128, DType.BF16, True), _config(128))
    assert source.target == "sm_90a" and source.threads == 256
    assert families.render(_problem(64, DType.FP16, False), _config(64)).threads == 128
    assert families.render(_problem(256, DType.BF16, False), _config(64)).threads == 256
    with pytest.raises(InvalidProblem, match=r"head dims \(64, 128, 256\).*'bwd'"):
        families.render(_problem(96, DType.FP16, False), _config(64))


def test_space_rules_name_their_reasons() -> None:
    assert space.SPACE.names == ("block_m", "block_n", "num_stages", "dqmode")
    small, large = _problem(64, DType.FP16, True), _problem(128, DType.FP16, True)
    assert len(HOPPER_BACKWARD.candidates(small, SM90A)) == 4
    assert HOPPER_BACKWARD.candidates(large, SM90A) == [_config(128, space.DQ_ATOMIC),
                                                        _config(128, space.DQ_SPLIT)]
    spills = HOPPER_BACKWARD.static_check(large, _config(64), SM90A)
    assert spills is not None and "accumulators need 288 registers" in spills
    # Head dim 256: two warpgroups per 64 keys; four (block_n 128) overflow the register file.
    widest = _problem(256, DType.BF16, False)
    assert HOPPER_BACKWARD.candidates(widest, SM90A) == [_config(64, space.DQ_ATOMIC),
                                                         _config(64, space.DQ_SPLIT)]
    regfile = HOPPER_BACKWARD.static_check(widest, _config(128), SM90A)
    assert regfile is not None and "512 threads x 255 registers" in regfile, regfile
    assert "65536" in regfile and "expected block_n 64" in regfile, regfile
    cases = {
        KernelConfig(64, 128, 4, 2): "num_stages=2",
        KernelConfig(64, 128, 2, 1): "num_warps=2",
        KernelConfig(128, 128, 4, 1): "block_m=128, block_n=128",
        KernelConfig(64, 128, 4, 1, extras=(("dqmode", "tree"),)): "dqmode='tree'",
        KernelConfig(64, 128, 4, 1, extras=(("pingpong", 1),)): "not knobs of the 'bwd90a'",
    }
    for config, reason in cases.items():
        found = HOPPER_BACKWARD.static_check(small, config, SM90A)
        assert found is not None and reason in found, (config, found)
    assert HOPPER_BACKWARD.candidates(small, get_arch("sm_89")) == []
    with pytest.raises(InvalidConfig, match="sm_90a"):
        HOPPER_BACKWARD.default_config(small, get_arch("sm_80"))


def test_defaults_pass_the_rules() -> None:
    for head_dim, dtype, causal in itertools.product(HEAD_DIMS, DType, (False, True)):
        problem = _problem(head_dim, dtype, causal)
        config = HOPPER_BACKWARD.default_config(problem, SM90A)
        assert config == _config(64 if head_dim > 128 else 128), config
        assert config in HOPPER_BACKWARD.candidates(problem, SM90A)
        assert HOPPER_BACKWARD.smem_bytes(problem, config) <= SM90A.max_smem_per_block


# ------------------------------------------------------------------ NVRTC for sm_90a


def _compiled(head_dim: int, dtype: DType, causal: bool, config: KernelConfig) -> None:
    source = families.render(_problem(head_dim, dtype, causal), config)
    kernel = compile_source(source, "sm_90")  # what a cc 9.0 GPU asks for
    assert kernel.arch == "sm_90a" and kernel.resources.spill_bytes == 0, kernel.resources
    assert kernel.resources.dynamic_smem == source.smem_bytes
    found = hgmma_shapes(kernel.cubin)
    if found is None:
        return
    # S^T and dP^T: N = 64 query rows; dV and dK: N = the warpgroup's share of the head dim;
    # dQ: its share of columns (64 at a time where the head dim is split).
    problem = _problem(head_dim, dtype, causal)
    dkv_cols = head_dim // space.dim_groups(problem)
    dq_cols = 64 if space.dim_groups(problem) > 1 else head_dim * 64 // config.block_n
    assert found["64"] >= 2 * head_dim // 16, found
    assert found[str(dkv_cols)] >= 2 * 64 // 16, found
    assert found[str(dq_cols)] >= config.block_n // 16, found


@pytest.mark.parametrize("head_dim", seeded_part(HEAD_DIMS, 1, "bwd90a-nvrtc"))
def test_nvrtc_compiles_the_default_for_sm90a_without_spills(head_dim: int) -> None:
    """At a seeded head dim (every head dim under ``-m sweep``)."""
    dtype = random.Random(f"{SEED}nvrtc{head_dim}").choice(list(DType))
    _compiled(head_dim, dtype, True, HOPPER_BACKWARD.default_config(
        _problem(head_dim, dtype, True), SM90A))


@pytest.mark.sweep
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_nvrtc_compiles_every_passing_config_without_spills(head_dim: int) -> None:
    for dtype, causal in itertools.product(DType, (False, True)):
        for config in HOPPER_BACKWARD.candidates(_problem(head_dim, dtype, causal), SM90A):
            _compiled(head_dim, dtype, causal, config)


# ------------------------------------------------------------------ emulator vs float64


Case = tuple[int, DType, bool, Shape, KernelConfig]


def _check(head_dim: int, dtype: DType, causal: bool, shape: Shape,
           config: KernelConfig) -> None:
    """The family's verify (NaN-poisoned dK and dV, fresh seeded inputs, the float64
    reference) in both thread orders."""
    source = families.render(_problem(head_dim, dtype, causal), config)
    for schedule in Schedule:
        kernel = EmulatorBackend(options=LaunchOptions(schedule=schedule)).load(source)
        seed = random.Random(f"{SEED}{source.entry}{shape.key()}{schedule}").randrange(2**31)
        verdict = verify(kernel, shape, "cpu", seed=seed)
        assert verdict.ok, f"seed {seed}, {schedule}: {verdict.message}"


def _case_id(c: Case) -> str:
    return f"d{c[0]}-{c[1].value}-{'causal' if c[2] else 'full'}-{c[3].key()}-{c[4].key()}"


def _default_cases() -> list[Case]:
    """The default per head dim and one other passing config of head dim 64 (config, dtype,
    mask and shape drawn from the seed; the deterministic test runs the split mode)."""
    rng = random.Random(f"{SEED}bwd90a")
    cases: list[Case] = []
    for head_dim in HEAD_DIMS:
        dtype, causal = rng.choice(list(DType)), rng.random() < 0.5
        cases.append((head_dim, dtype, causal, rng.choice(SHAPES),
                      HOPPER_BACKWARD.default_config(_problem(head_dim, dtype, causal), SM90A)))
    others = [c for c in HOPPER_BACKWARD.candidates(_problem(64, DType.FP16, True), SM90A)
              if c != _config(128)]
    cases.append((64, rng.choice(list(DType)), rng.random() < 0.5, rng.choice(SHAPES),
                  rng.choice(others)))
    return cases


@pytest.mark.emulator
@pytest.mark.parametrize("case", [*seeded_part(_default_cases()[:len(HEAD_DIMS)], 1,
                                               "bwd90a-defaults"),
                                  *_default_cases()[len(HEAD_DIMS):]], ids=_case_id)
def test_kernel_matches_float64_in_the_emulator(case: Case) -> None:
    """The default at a seeded head dim (the others under ``-m sweep``) and the other
    config."""
    _check(*case)


def _sweep_cases() -> list[Case]:
    """Every head dim, dtype, mask, shape and passing config."""
    return [(head_dim, dtype, causal, shape, config)
            for head_dim, dtype, causal in itertools.product(HEAD_DIMS, DType, (False, True))
            for config in HOPPER_BACKWARD.candidates(_problem(head_dim, dtype, causal), SM90A)
            for shape in SHAPES]


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("case", _sweep_cases(), ids=_case_id)
def test_full_matrix_in_the_emulator(case: Case) -> None:
    _check(*case)


@pytest.mark.emulator
def test_a_missing_barrier_before_the_dq_wgmma_is_caught() -> None:
    """Planted: no block barrier between the dS stores and the dQ wgmma, which reads both
    warpgroups' rows of dS: in either thread order one warpgroup reads rows the other has
    not written yet, and dQ comes out wrong (dK and dV, which take dS from registers, not)."""
    problem = _problem(64, DType.FP16, False)
    source = families.render(problem, _config(128))
    source = dataclasses.replace(source,
                                 options=(*source.options, "-DFT_HOPPER_BWD_PLANTED_BUG=1"))
    for schedule in Schedule:
        kernel = EmulatorBackend(options=LaunchOptions(schedule=schedule)).load(source)
        verdict = verify(kernel, Shape(1, 1, 1, 64, 128), "cpu", seed=SEED)
        assert not verdict.ok and "dq_accum" in verdict.message, (schedule, verdict.message)
        assert "dk:" not in verdict.message and "dv:" not in verdict.message, verdict.message


def _gradients(head_dim: int, dtype: DType, causal: bool, shape: Shape, config: KernelConfig,
               order_seed: int | None = None, seed: int = SEED) -> dict[str, torch.Tensor]:
    """The kernel's outputs on the emulator for poisoned outputs and seeded inputs (checked
    against the family's float64 reference), with dQ as the convert kernel makes it (the
    slices summed, times softmax_scale); and the inputs."""
    kernel = EmulatorBackend(options=LaunchOptions(block_order_seed=order_seed)).load(
        families.render(_problem(head_dim, dtype, causal), config))
    launch = prepare(kernel, shape, "cpu", seed=seed, poison=True)
    launch.run()
    verdict = launch.verdict()
    assert verdict.ok, f"block order {order_seed}: {verdict.message}"
    scale = launch.inputs.scalars["softmax_scale"]
    t = launch.inputs.tensors
    return {**{name: t[name] for name in ("q", "k", "v", "do")},
            "dq_accum": launch.outputs["dq_accum"], "dk": launch.outputs["dk"],
            "dv": launch.outputs["dv"],
            "dq": (launch.outputs["dq_accum"].double().sum(0).transpose(1, 2) * scale
                   ).to(t["q"].dtype)}


@pytest.mark.emulator
@pytest.mark.parametrize("head_dim", seeded_part(HEAD_DIMS, 1, "bwd90a-autograd"))
def test_gradients_within_flash_attn_rule_against_float64_autograd(head_dim: int) -> None:
    """dQ, dK, dV against torch autograd of plain attention in float64 (GQA, causal, odd
    lengths): error at most 3x that of the same attention in the input dtype. At a seeded
    head dim (every head dim under ``-m sweep``)."""
    rng = random.Random(f"{SEED}autograd{head_dim}")
    dtype, shape = rng.choice(list(DType)), Shape(1, 4, 2, 70, 100)
    config = HOPPER_BACKWARD.default_config(_problem(head_dim, dtype, True), SM90A)
    got = _gradients(head_dim, dtype, True, shape, config, seed=rng.randrange(2**31))
    scale = head_dim ** -0.5

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = attention_reference(q, k, v, True, scale)[0]
        return out

    inputs = (got["q"], got["k"], got["v"])
    exact = gradients(attend, tuple(t.double() for t in inputs), got["do"].double())
    low = gradients(attend, inputs, got["do"])
    ours = {name: got[name] for name in ("dq", "dk", "dv")}
    del exact["out"], low["out"]
    assert got["dk"].dtype == torch_dtype(dtype)
    within_rule(ours, low, exact, f"bwd90a d{head_dim} {dtype.value} causal {shape.key()}")


@pytest.mark.emulator
@pytest.mark.parametrize("head_dim", (64, 256))
def test_deterministic_mode_is_bitwise_equal_over_block_orders(head_dim: int) -> None:
    """GQA, causal, 3 key tiles (block_n 64) in 3 slices, 2 query heads per kv head: each
    block adds its key tiles into its own slice, whatever order the blocks run in (the
    linear order and three shuffles); at head dim 256 two warpgroups add their dQ columns."""
    rng = random.Random(f"{SEED}det{head_dim}")
    dtype = rng.choice(list(DType))
    shape = Shape(1, 4, 2, 90, 150)
    runs = [_gradients(head_dim, dtype, True, shape, _config(64, space.DQ_SPLIT), order)
            for order in (None, 1, 2, 3)]
    assert runs[0]["dq_accum"].shape[0] > 1
    for other in runs[1:]:
        for name in ("dk", "dv", "dq_accum"):
            assert torch.equal(other[name], runs[0][name]), name


@pytest.mark.emulator
def test_atomic_mode_sums_in_block_order_within_tolerance() -> None:
    """Float32 atomics land in block order: a shuffle changes dQ's last bits (the shuffle
    reaches the sum), while dK and dV, summed in registers, stay bitwise equal."""
    shape = Shape(1, 2, 1, 64, 256)
    runs = [_gradients(64, DType.FP16, False, shape, _config(64), order)
            for order in (None, 1, 2)]
    assert any(not torch.equal(r["dq_accum"], runs[0]["dq_accum"]) for r in runs[1:])
    for r in runs[1:]:
        assert torch.equal(r["dk"], runs[0]["dk"]) and torch.equal(r["dv"], runs[0]["dv"])


# ------------------------------------------------------------------ command line


def test_cli_shows_compiles_and_profiles_it_beside_fa3s_backward() -> None:
    """``show`` and ``compile`` of the sm_90a default; ``profile`` counts every warp of the
    block as a compute warp (10.5 MFLOP per iteration at head dim 128, as FA3's causal loop)
    and prints FA3's backward loop from the reference facts with the ratio per tensor FLOP."""
    from typer.testing import CliRunner

    from flashtune.cli import app

    runner = CliRunner()
    common = ["--op", "bwd90a", "--arch", "sm_90a", "--head-dim", "128", "--dtype", "bf16",
              "--causal"]
    shown = runner.invoke(app, ["show", *common])
    assert shown.exit_code == 0, shown.output
    assert "ft::hopper_bwd<Traits>" in shown.output and "target: sm_90a only" in shown.output
    compiled = runner.invoke(app, ["compile", *common])
    assert compiled.exit_code == 0 and "m64_n128_w4_s1" in compiled.output, compiled.output
    profiled = runner.invoke(app, ["profile", *common])
    assert profiled.exit_code == 0, profiled.output
    text = " ".join(profiled.output.split())  # the console wraps long lines
    assert re.search(r"tensor FLOPs per iteration: 10485760 \(the warp's 1310720 x 8 compute",
                     text), text
    found = re.search(r"reference: FA3 backward, d128 bf16 causal, 64 x 128: 486 instructions "
                      r"per warp per iteration for 1310720 tensor FLOPs; this kernel: (\d+) "
                      r"for 1310720; instructions per tensor FLOP, this / reference = "
                      r"(\d+\.\d\d)", text)
    assert found is not None, text
    assert float(found[2]) == pytest.approx(int(found[1]) / 486, abs=0.005)


# ------------------------------------------------------------------ serving


@pytest.mark.emulator
@pytest.mark.parametrize("deterministic", seeded_part((False, True), 1, "train-mode"),
                         ids=("atomic", "deterministic"))  # one seeded mode by default
def test_a_training_step_on_a_virtual_sm90a_runs_it_within_the_rule(
        monkeypatch: pytest.MonkeyPatch, deterministic: bool) -> None:
    """``flashtune.attention`` and ``loss.backward()`` on the emulator as a virtual sm_90a
    device: the backward's main kernel is bwd90a (bwd90adet when deterministic), its
    gradients within flash-attn's rule against float64 autograd (GQA, causal, odd lengths),
    and as close to the mma.sync backward's (the same call on a virtual sm_90) as the rule
    allows."""
    rng = random.Random(f"{SEED}train{deterministic}")
    dtype = torch_dtype(rng.choice(list(DType)))
    shape, head_dim, seed = (1, 70, 90, 4, 2), rng.choice(HEAD_DIMS), rng.randrange(2**31)
    monkeypatch.setenv("FLASHTUNE_BACKEND", "emulator")
    served = {}
    for arch in ("sm_90", "sm_90a"):
        monkeypatch.setenv("FLASHTUNE_EMULATOR_ARCH", arch)
        plans.clear_caches()
        ratios = error_ratios(shape, head_dim, dtype, True, seed,
                              deterministic=deterministic)
        served[arch] = ({p.source.problem.op for p in plans.cached().values()}, ratios)
    main = "bwd90adet" if deterministic else "bwd90a"
    portable = "bwddet" if deterministic else "bwd"
    assert main in served["sm_90a"][0] and portable not in served["sm_90a"][0], served
    assert portable in served["sm_90"][0] and main not in served["sm_90"][0], served
    for name in ("dq", "dk", "dv"):  # each within 3x plain PyTorch's error (error_ratios)
        assert served["sm_90a"][1][name] <= 3.0 and served["sm_90"][1][name] <= 3.0
