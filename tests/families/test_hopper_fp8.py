"""The FP8 forward on sm_90a wgmma (``fwd890a``) in the CPU emulator against float64, its
byte counters, its SASS, and its place in serving (``fwd8`` problems on cc 9.0).

The bound, element by element (the family's ``compare``): the kernel rounds each probability
(times 2^8, exact) to e4m3 or e5m2 before P V, an error of at most half an ulp relative
(2^-4 for e4m3's 3 mantissa bits, 2^-3 for e5m2's 2) above the format's normals and half its
denormal spacing below (2^-18 / 2^-24 in probability units), so against the float64
attention O_ref of the dequantised inputs (each FP8 value as torch decodes it times its
(batch, KV head) descale)

    |O - O_ref| <= (u + 1e-5) (P |V|) + a sum |V| + r |O_ref| + 1e-7

with P the float64 softmax, u, a the format's figures, r the rounding of O's type (2^-8
bf16, 2^-11 fp16) and 1e-5 for the fp32 scores, exp2 and sums; the LSE (fp32 sums of the
unrounded probabilities) takes the forward's LSE tolerance. Outputs are poisoned with NaN
before every launch. Inputs: fresh standard normals rounded to the format, descales in
[0.25, 4). The default run takes a seeded sample of the grid (the seed is in each id; each
input format at a seeded head dim); ``-m sweep`` the grid.
"""

from __future__ import annotations

import itertools
import os
import random
import re

import pytest
import torch
from hopper_sample import param_id
from sampling import seeded_part
from serving_fixtures import dispatcher, source, virtual_sm90a  # noqa: F401  (fixtures)

import flashtune
from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.dtypes import DType, Fp8Type
from flashtune.codegen.spec import KernelConfig, Problem, Shape
from flashtune.errors import InvalidConfig
from flashtune.families.fwd8_90a import FORWARD_FP8_90A as FAMILY
from flashtune.runtime import first_use, plans
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions
from flashtune.toolchain.compiler import compile_source
from flashtune.toolchain.cuda import find_toolchain
from flashtune.toolchain.disasm import disassemble

SM90A = get_arch("sm_90a")
HEAD_DIMS = (64, 128, 256)
#: GQA 4:2 with lengths off the tile grid, MQA with Nq < Nk, causal Nq > Nk (rows that see
#: no key: O = 0, LSE = +inf).
SHAPES = (Shape(2, 4, 2, 100, 77), Shape(1, 3, 1, 33, 150), Shape(1, 2, 2, 90, 20))
#: One and two warpgroups, key tiles of 2 to 8 k32 steps (224: FA3's FP8 tile), 1-3 stages.
CONFIGS = (KernelConfig(128, 128, 8, 2), KernelConfig(64, 64, 4, 1),
           KernelConfig(64, 224, 4, 2), KernelConfig(128, 96, 8, 3))
def problem(head_dim: int, out: DType, causal: bool, fmt: Fp8Type = Fp8Type.E4M3) -> Problem:
    return Problem(head_dim, fmt, causal=causal, op=FAMILY.op, o_dtype=out)


def run(p: Problem, config: KernelConfig, shape: Shape, seed: int,
        options: LaunchOptions | None = None) -> object:
    """One emulator launch checked against the bound; returns the launch's counters."""
    kernel = EmulatorBackend(options=options or LaunchOptions()).load(
        families.render(p, config))
    inputs = FAMILY.random_inputs(p, shape, "cpu", seed)
    outputs = FAMILY.empty_outputs(p, shape, inputs, poison=True)
    assert torch.isnan(outputs["o"]).all() and torch.isnan(outputs["lse"]).all()
    kept = {name: t.clone() for name, t in inputs.tensors.items()}
    plan = FAMILY.launch_plan(p, config, shape, inputs, outputs)
    kernel.launch(plan.grid, plan.args)
    for name, t in inputs.tensors.items():  # the inputs are only read
        assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t,
                           kept[name].view(torch.uint8) if t.element_size() == 1
                           else kept[name]), name
    ref = FAMILY.reference(p, inputs)
    where = f"{p.key()} {config.key()} {shape} seed={seed}"
    verdict = FAMILY.compare(p, shape, outputs, ref)
    err = (outputs["o"].to(torch.float64) - ref["o"]).abs()
    share = (err / (ref["o_bound"] + 1e-30)).max().item()
    print(f"{where}: O error {err.max().item():.3g}, {share:.3g} of P's rounding bound")
    assert verdict.ok, f"{where}: {verdict.message}"
    return getattr(kernel, "last_counters", None)


def _grid() -> list[tuple[int, DType, bool, Fp8Type, KernelConfig, Shape]]:
    return [(d, o, causal, fmt, c, s) for d, o, causal, fmt, c, s in itertools.product(
        HEAD_DIMS, DType, (False, True), Fp8Type, CONFIGS, SHAPES)
        if FAMILY.static_check(problem(d, o, causal, fmt), c, SM90A) is None]


_SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
_GRID = _grid()
#: One row of the grid per head dim and input format, chosen by the session's seed: the
#: default run takes each format at a seeded head dim, ``-m sweep`` every row (and the grid).
_ROWS = {fmt: [(*random.Random(f"{_SEED}-{i}-{fmt.value}").choice(
    [r for r in _GRID if r[0] == d and r[3] is fmt]), _SEED + i)
    for i, d in enumerate(HEAD_DIMS)] for fmt in Fp8Type}
SAMPLE = [row for fmt, rows in _ROWS.items()
          for row in seeded_part(rows, 1, f"fwd890a-{fmt.value}", several=True)]


@pytest.mark.emulator
@pytest.mark.parametrize("head_dim, out, causal, fmt, config, shape, seed", SAMPLE,
                         ids=param_id)
def test_fp8_wgmma_forward_matches_float64(head_dim: int, out: DType, causal: bool,
                                           fmt: Fp8Type, config: KernelConfig, shape: Shape,
                                           seed: int) -> None:
    print(f"seed={seed}")
    run(problem(head_dim, out, causal, fmt), config, shape, seed)


@pytest.mark.emulator
@pytest.mark.sweep
@pytest.mark.parametrize("head_dim, out, causal, fmt, config, shape", _GRID,
                         ids=param_id)
def test_fp8_wgmma_forward_grid(head_dim: int, out: DType, causal: bool, fmt: Fp8Type,
                                config: KernelConfig, shape: Shape) -> None:
    run(problem(head_dim, out, causal, fmt), config, shape, _SEED)


def _loaded_bytes(p: Problem, config: KernelConfig, shape: Shape) -> int:
    """cp.async bytes of every block: its Q rows once and each key tile it visits once, K
    and V (rows past the end are zero-filled, reading nothing)."""
    d, bm, bn = p.head_dim, config.block_m, config.block_n
    total = 0
    for m0 in range(0, shape.seqlen_q, bm):
        rows = min(bm, shape.seqlen_q - m0)
        n_end = shape.seqlen_k
        if p.causal:
            n_end = min(n_end, m0 + rows + shape.seqlen_k - shape.seqlen_q)
        keys = 0 if n_end <= 0 else sum(min(bn, shape.seqlen_k - t * bn)
                                        for t in range(-(-n_end // bn)))
        total += (rows * d + 2 * keys * d) if n_end > 0 else 0
    return total * shape.batch * shape.heads_q


@pytest.mark.emulator
@pytest.mark.parametrize("causal", [False, True])
def test_v_is_read_once_per_block_and_transposed_on_chip(causal: bool) -> None:
    """The only global reads are the stage copies: Q, K and V bytes once per block pass
    (V's transpose reads shared memory; a pass over global memory would add V's bytes),
    nothing through __ldg, and no input is written (the kernel has no other buffer)."""
    p = problem(128, DType.BF16, causal)
    config = KernelConfig(64, 64, 4, 2)
    shape = Shape(1, 2, 1, 100, 150)
    counters = run(p, config, shape, _SEED, LaunchOptions(counters=True))
    assert counters is not None
    assert counters.cp_async_bytes == _loaded_bytes(p, config, shape)  # type: ignore[attr-defined]
    assert counters.ldg_bytes == 0  # type: ignore[attr-defined]


def test_served_for_fwd8_on_cc90_and_falls_back_where_it_refuses(
        caplog: pytest.LogCaptureFixture) -> None:
    fwd8 = Problem(128, Fp8Type.E4M3, causal=True, op="fwd8", o_dtype=DType.BF16)
    assert families.served_problem(fwd8, get_arch("sm_90")).op == FAMILY.op
    assert families.served_problem(fwd8, get_arch("sm_89")).op == "fwd8"
    # a head dim it does not take, and a feature it does not have: fwd8 serves them
    odd = Problem(96, Fp8Type.E4M3, op="fwd8", o_dtype=DType.FP16)
    with caplog.at_level("DEBUG", logger="flashtune.families"):
        assert families.served_problem(odd, get_arch("sm_90")).op == "fwd8"
    assert "fwd890a does not serve fwd8_d96" in caplog.text and "head_dim=96" in caplog.text
    windowed = Problem(128, Fp8Type.E4M3, op="fwd8", o_dtype=DType.BF16,
                       features=frozenset({"window"}))
    assert families.served_problem(windowed, get_arch("sm_90")).op == "fwd8"


def test_refusals_name_the_reason() -> None:
    with pytest.raises(Exception, match=r"head_dim=96: .*\(64, 128, 256\).*fwd8"):
        FAMILY.check_problem(problem(96, DType.BF16, False))
    p = problem(256, DType.BF16, False)
    why = FAMILY.static_check(p, KernelConfig(128, 256, 8, 3), SM90A)
    assert why is not None and "shared memory" in why
    why = FAMILY.static_check(p, KernelConfig(128, 80, 8, 2), SM90A)
    assert why is not None and "multiple of 32" in why
    assert "sm_90a" in (FAMILY.static_check(p, KernelConfig(128, 64, 8, 2), get_arch("sm_89"))
                        or "")
    with pytest.raises(InvalidConfig, match="head_dim=96"):
        FAMILY.default_config(problem(96, DType.BF16, False), SM90A)


@pytest.mark.parametrize("head_dim, causal", [
    (64, False), *seeded_part([(128, True), (256, True)], 1, "fwd890a-nvrtc", several=True)])
def test_nvrtc_sm90a_main_loop_issues_fp8_gmmas_without_spills(head_dim: int,
                                                               causal: bool) -> None:
    """The default kernel: no spills, Q K^T and P V as QGMMA ...E4M3.E4M3 (block_n / 32 P V
    steps of N = head_dim, head_dim / 32 Q K^T steps of N = block_n, each once per masked
    and unmasked loop)."""
    p = problem(head_dim, DType.BF16, causal)
    config = FAMILY.default_config(p, SM90A)
    kernel = compile_source(families.render(p, config), "sm_90")
    res = kernel.resources
    print(f"{p.key()} {config.key()}: {res.registers} registers, spills "
          f"{res.spill_stores}/{res.spill_loads}")
    assert kernel.arch == "sm_90a" and res.spill_stores == 0 and res.spill_loads == 0, res
    if find_toolchain().nvdisasm is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    sass = disassemble(kernel.cubin)
    qk = len(re.findall(rf"\bQGMMA\.64x{config.block_n}x32\.F32\.E4M3\.E4M3\b", sass))
    pv = len(re.findall(rf"\bQGMMA\.64x{head_dim}x32\.F32\.E4M3\.E4M3\b", sass))
    assert qk > 0 and pv > 0, (qk, pv)
    assert not re.search(r"\bHGMMA\.\S+ (?!RZ)", sass)  # no 16-bit tensor-core products


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher", "virtual_sm90a")
def test_attention_with_e4m3_on_a_virtual_sm90a_runs_fwd890a() -> None:
    """The torch API on the emulator's virtual sm_90a: e4m3 tensors with descales (GQA 4:2,
    causal, Nq < Nk) run on ``fwd890a`` after its first-use check, within the bound."""
    p = problem(128, DType.BF16, True)
    shape = Shape(1, 4, 2, 70, 90)
    inputs = FAMILY.random_inputs(p, shape, "cpu", _SEED)
    t = inputs.tensors
    out, lse = flashtune.attention(t["q"], t["k"], t["v"], causal=True,
                                   q_descale=t["q_descale"], k_descale=t["k_descale"],
                                   v_descale=t["v_descale"], out_dtype=torch.bfloat16,
                                   return_lse=True)
    assert first_use.refused("virtual-sm_90a") is None
    ops = {plan.decision.problem.op for plan in plans.cached().values()}
    assert FAMILY.op in ops, ops
    verdict = FAMILY.compare(p, shape, {"o": out, "lse": lse}, FAMILY.reference(p, inputs))
    assert verdict.ok, f"seed={_SEED}: {verdict.message}"


def test_profile_prints_the_main_loop_per_iteration() -> None:
    """``flashtune profile --op fwd890a``: the unmasked loop's instructions per iteration,
    its FP8 wgmma FLOPs (Q K^T and P V of a 64 x block_n tile per warpgroup, per warp), and
    no prediction (the cost model has no model of the FP8 sm_90a kernel)."""
    import json

    from typer.testing import CliRunner

    from flashtune.cli import app

    if find_toolchain().nvdisasm is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    args = ["profile", "--op", FAMILY.op, "--dtype", "bf16", "--head-dim", "128", "--causal",
            "--arch", "sm_90a", "--config", "m128_n128_w8_s2"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["prediction"] is None and data["resources"]["spill_stores"] == 0
    loop = data["sass"]["unmasked_loop"]
    print(f"unmasked loop: {loop['total']} instructions per warp per iteration")
    # per warpgroup: 2 products of 64 x 128 x 128, shared by its 4 warps
    assert loop["wgmma_flops"] * 4 == 2 * 2 * 64 * 128 * 128
    assert 0 < loop["total"] < 2000
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0 and "unmasked loop" in table.output


def test_the_bound_takes_p_rounding_and_no_more() -> None:
    """The reference rounded to O's type passes; one element moved past its bound fails."""
    p = problem(64, DType.BF16, True)
    shape = Shape(1, 2, 1, 40, 50)
    inputs = FAMILY.random_inputs(p, shape, "cpu", _SEED)
    ref = FAMILY.reference(p, inputs)
    outputs = {"o": ref["o"].to(torch.bfloat16), "lse": ref["lse"].to(torch.float32)}
    assert FAMILY.compare(p, shape, outputs, ref).ok
    moved = ref["o"].clone()
    moved[0, 39, 1, 5] += 2 * ref["o_bound"][0, 39, 1, 5] + 0.02
    verdict = FAMILY.compare(p, shape, {**outputs, "o": moved.to(torch.bfloat16)}, ref)
    assert not verdict.ok and "O: 0 elements left unwritten (NaN), 1 outside" in verdict.message
