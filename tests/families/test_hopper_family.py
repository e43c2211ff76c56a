"""The sm_90a forward family (wgmma, cp.async + mbarrier ring): registry, space and rules
with reasons, NVRTC for sm_90a (no spills; HGMMA in the SASS), and numerics in the emulator
against float64 over head dims 64/128/256, causal (bottom-right), GQA, odd lengths, fp16 and
bf16, in both thread orders, on NaN-poisoned outputs, for it and for its warp-specialised
sibling (fwd90aws: a TMA or cp.async producer, setmaxnreg, the ping-pong, overlap and load
knobs; its own tests in test_hopper_ws.py). The default run takes per family the default
at a seeded head dim, a seeded sample of each new mechanism (three consumer warpgroups, a
key tile that is not a power of two, ping-pong, overlap, cp.async loads; configs with
several of them drawn first) and a seeded point of the space; ``-m sweep`` the full
matrix."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import os
import random
import re
from typing import Any

import pytest
import torch
from sampling import seeded_part, when_swept
from typer.testing import CliRunner

import flashtune
from flashtune import families
from flashtune.cli import app
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.db.records import BestEntry
from flashtune.errors import EmulatorError, InvalidConfig, InvalidProblem
from flashtune.families.base import KernelFamily
from flashtune.families.fwd.reference import attention_reference
from flashtune.families.hopper import HOPPER_FORWARD, space
from flashtune.families.hopper.ws import HOPPER_WS_FORWARD
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions, Schedule
from flashtune.runtime.device import DeviceInfo
from flashtune.runtime.dispatch import Dispatcher, default_config
from flashtune.runtime.launch import verify
from flashtune.runtime.precompile import default_kernels, planned_kernels
from flashtune.toolchain.compiler import compile_source
from flashtune.toolchain.cuda import find_toolchain
from flashtune.toolchain.disasm import disassemble

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
SM90A = get_arch("sm_90a")
HEAD_DIMS = (64, 128, 256)
#: GQA with lengths off the tile grid; causal Nq > Nk (rows that see no key); MQA with one
#: query row; Nq > Nk over several key tiles; two query blocks of equal lengths.
SHAPES = (Shape(1, 2, 1, 77, 150), Shape(2, 2, 2, 9, 4), Shape(1, 4, 1, 1, 100),
          Shape(1, 1, 1, 150, 33), Shape(1, 2, 2, 130, 130))
#: The families whose numerics run over the grid: the cp.async one and the warp-specialised
#: one (its ping-pong knob included).
NUMERICS_FAMILIES = (HOPPER_FORWARD, HOPPER_WS_FORWARD)


def _problem(head_dim: int, dtype: DType, causal: bool) -> Problem:
    return Problem(head_dim, dtype, causal=causal, op=HOPPER_FORWARD.op)


def _config(block_m: int, block_n: int, stages: int) -> KernelConfig:
    return HOPPER_FORWARD.config({"block_m": block_m, "block_n": block_n,
                                  "num_stages": stages})


# ------------------------------------------------------------------ registry and rules


def test_registered_as_an_sm90a_family_the_warp_specialised_one_serving_the_forward() -> None:
    assert families.get("fwd90a") is HOPPER_FORWARD
    assert HOPPER_FORWARD.target_arch == "sm_90a" and HOPPER_FORWARD.serves is None
    assert HOPPER_WS_FORWARD.target_arch == "sm_90a" and HOPPER_WS_FORWARD.serves == "fwd"
    source = families.render(_problem(128, DType.BF16, True), _config(128, 128, 2))
    assert source.target == "sm_90a" and source.threads == 256
    with pytest.raises(InvalidProblem, match="head dims"):
        families.render(_problem(96, DType.FP16, False), _config(64, 64, 2))


def test_space_rules_name_their_reasons() -> None:
    problem = _problem(128, DType.FP16, False)
    assert space.SPACE.names == ("block_m", "block_n", "num_stages")
    assert space.BLOCK_N == (64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256)
    configs = HOPPER_FORWARD.search_space(problem)
    assert len(configs) == 3 * 13 * 3
    assert all(c.num_warps == c.block_m // 16 for c in configs)
    cases = {
        _config(64, 256, 1): "accumulators need 256 registers",
        _config(128, 128, 3): None,
        _config(128, 176, 2): None,  # FA3's tile at head dim 128
        _config(64, 208, 2): None,
        _config(128, 144, 1): None,
        _config(128, 160, 1): "accumulators need 184 registers per thread (S, O and P), over "
                              "the 172 that compile without spills (NVRTC 13) in a consumer "
                              "thread's 255 registers (64 Ki registers shared by 256 threads) "
                              "at head dim 128 with one stage",
        # three warpgroups: 384 threads share the register file, 168 each
        _config(192, 64, 2): None,
        _config(192, 80, 2): "over the 112 that compile without spills (NVRTC 13) in a "
                             "consumer thread's 168 registers (64 Ki registers shared by 384 "
                             "threads)",
        KernelConfig(128, 128, 4, 2): "one warpgroup per 64",
        KernelConfig(64, 32, 4, 2): "block_n a multiple of 16 in 64..256",
    }
    for config, reason in cases.items():
        found = HOPPER_FORWARD.static_check(problem, config, SM90A)
        assert (found is None) if reason is None else (found is not None and reason in found)
    wide = HOPPER_FORWARD.static_check(_problem(256, DType.FP16, False), _config(64, 128, 3),
                                       SM90A)
    assert wide is not None and "shared memory" in wide
    single = HOPPER_FORWARD.static_check(_problem(256, DType.BF16, True), _config(64, 64, 1),
                                         SM90A)
    assert single is not None and "spills" in single
    assert HOPPER_FORWARD.candidates(problem, get_arch("sm_80")) == []
    with pytest.raises(InvalidConfig, match="sm_90a"):
        HOPPER_FORWARD.default_config(problem, get_arch("sm_89"))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_defaults_pass_the_rules(head_dim: int) -> None:
    for dtype, causal in itertools.product(DType, (False, True)):
        problem = _problem(head_dim, dtype, causal)
        config = HOPPER_FORWARD.default_config(problem, SM90A)
        assert config in HOPPER_FORWARD.candidates(problem, SM90A)
        assert HOPPER_FORWARD.smem_bytes(problem, config) <= SM90A.max_smem_per_block


# ------------------------------------------------------------------ NVRTC for sm_90a


def _compiled(head_dim: int, dtype: DType, causal: bool,
              config: KernelConfig | None = None) -> None:
    problem = _problem(head_dim, dtype, causal)
    config = config or HOPPER_FORWARD.default_config(problem, SM90A)
    source = families.render(problem, config)
    kernel = compile_source(source, "sm_90")  # what a cc 9.0 GPU asks for
    res = kernel.resources
    assert kernel.arch == "sm_90a" and res.spill_bytes == 0, res
    assert 0 < res.registers <= 255 and res.dynamic_smem == source.smem_bytes
    if find_toolchain().nvdisasm is None:
        return
    found = collections.Counter(re.findall(r"\bHGMMA\.64x(\d+)x16\.F32(?:\.BF16)?\b",
                                           disassemble(kernel.cubin)))
    # Q K^T: N = block_n, at least head_dim / 16 k-steps; P V: N = head_dim, block_n / 16.
    assert found[str(config.block_n)] >= head_dim // 16, found
    assert found[str(head_dim)] >= config.block_n // 16, found


@pytest.mark.parametrize("case", [(64, DType.BF16, True), (256, DType.FP16, False)],
                         ids=lambda c: f"d{c[0]}-{c[1].value}-{'causal' if c[2] else 'full'}")
def test_nvrtc_compiles_defaults_for_sm90a_without_spills(
        case: tuple[int, DType, bool]) -> None:
    _compiled(*case)


@pytest.mark.sweep
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.value)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_nvrtc_compiles_every_passing_config_without_spills(head_dim: int, dtype: DType,
                                                            causal: bool) -> None:
    for config in HOPPER_FORWARD.candidates(_problem(head_dim, dtype, causal), SM90A):
        _compiled(head_dim, dtype, causal, config)


# ------------------------------------------------------------------ emulator vs float64


Case = tuple[KernelFamily, int, DType, bool, Shape, KernelConfig]


def _check(family: KernelFamily, head_dim: int, dtype: DType, causal: bool, shape: Shape,
           config: KernelConfig) -> None:
    problem = Problem(head_dim, dtype, causal=causal, op=family.op)
    source = families.render(problem, config)
    for schedule in Schedule:
        kernel = EmulatorBackend(options=LaunchOptions(schedule=schedule)).load(source)
        seed = random.Random(f"{SEED}{source.entry}{shape.key()}{schedule}").randrange(2**31)
        verdict = verify(kernel, shape, "cpu", seed=seed)
        assert verdict.ok, f"seed {seed}, {schedule}: {verdict.message}"


@functools.cache
def _admitted(family: KernelFamily, head_dim: int) -> tuple[KernelConfig, ...]:
    """Every config of ``family``'s space its rules admit at ``head_dim`` on sm_90a (the
    rules do not depend on the dtype or the mask: the sweep's test checks it)."""
    return tuple(family.candidates(Problem(head_dim, DType.FP16, op=family.op), SM90A))


def _default_cases() -> list[Case]:
    """Per family: one default per head dim (dtype, mask and shape drawn from the seed), and
    seeded configs that have every new mechanism of its space (``_MECHANISMS``) among them,
    each drawn among those with the most mechanisms the ones before lack."""
    cases: list[Case] = []
    for family in NUMERICS_FAMILIES:
        rng = random.Random(f"{SEED}{family.op}")
        for head_dim in HEAD_DIMS:
            dtype, causal = rng.choice(list(DType)), rng.random() < 0.5
            problem = Problem(head_dim, dtype, causal=causal, op=family.op)
            cases.append((family, head_dim, dtype, causal, rng.choice(SHAPES),
                          family.default_config(problem, SM90A)))
        uncovered = list(_MECHANISMS)
        for mechanism in _MECHANISMS:
            if mechanism not in uncovered:  # a config drawn before has it
                continue
            head_dim, dtype, causal = rng.choice(HEAD_DIMS), rng.choice(list(DType)), True
            drawn = [c for c in _admitted(family, head_dim) if mechanism(c)]
            if not drawn:  # e.g. three warpgroups at head dim 256: none fits the registers
                head_dim = 64
                drawn = [c for c in _admitted(family, head_dim) if mechanism(c)]
            if drawn:  # the cp.async family has no ping-pong or overlap
                # drawn among those with the most mechanisms not yet covered: fewer kernels
                most = max(sum(m(c) for m in uncovered) for c in drawn)
                config = rng.choice([c for c in drawn if sum(m(c) for m in uncovered) == most])
                uncovered = [m for m in uncovered if not m(config)]
                cases.append((family, head_dim, dtype, causal, rng.choice(SHAPES), config))
    return cases


#: The mechanisms the seeded sample covers in each family: three consumer warpgroups, a key
#: tile that is not a power of two (two warpgroups or fewer), ping-pong, overlap, a producer
#: that loads some operand with cp.async.
_MECHANISMS = (lambda c: c.block_m == 192,
               lambda c: c.block_m < 192 and c.block_n & (c.block_n - 1) != 0,
               lambda c: bool(space.knob(c, space.PINGPONG)),
               lambda c: bool(space.knob(c, space.OVERLAP)),
               space.cp_async_producer)


def _case_id(c: Case) -> str:
    return (f"{c[0].op}-d{c[1]}-{c[2].value}-{'causal' if c[3] else 'full'}-{c[4].key()}-"
            f"{c[5].key()}")


def _default_params() -> list[Any]:
    """``_default_cases`` as parameters: per family its defaults at a seeded one of the head
    dims (the others under ``-m sweep``) and the seeded configs of the mechanisms."""
    params: list[Any] = []
    for family in NUMERICS_FAMILIES:
        cases = [c for c in _default_cases() if c[0] is family]
        params += [*seeded_part(cases[:len(HEAD_DIMS)], 1, f"hopper-default-{family.op}"),
                   *cases[len(HEAD_DIMS):]]
    return params


@pytest.mark.emulator
@pytest.mark.parametrize("case", _default_params(), ids=_case_id)
def test_kernel_matches_float64_in_the_emulator(case: Case) -> None:
    _check(*case)


def test_the_default_sample_covers_every_new_mechanism() -> None:
    for family in NUMERICS_FAMILIES:
        configs = [c[5] for c in _default_cases() if c[0] is family]
        assert any(c.block_m == 192 for c in configs), configs
        assert any(c.block_n not in (64, 128, 256) for c in configs), configs
        ws = family is HOPPER_WS_FORWARD
        assert any(space.knob(c, space.PINGPONG) for c in configs) == ws, configs
        assert any(space.knob(c, space.OVERLAP) for c in configs) == ws, configs
        assert any(space.cp_async_producer(c) for c in configs) == ws, configs


@pytest.mark.emulator
def test_panel_stride_of_a_power_of_two_tile_is_caught() -> None:
    """Planted: K and V descriptors that step over panels of 256 rows in a 176-row tile."""
    problem = _problem(128, DType.FP16, False)
    source = families.render(problem, _config(64, 176, 2))
    source = dataclasses.replace(source, options=(*source.options, "-DFT_HOPPER_PLANTED_BUG=1"))
    kernel = EmulatorBackend().load(source)
    with pytest.raises(EmulatorError, match=r"wgmma at .*hopper_fwd.cuh:\d+: the B descriptor "
                       r"addresses shared-window byte 0x[0-9a-f]+, outside the block's shared "
                       r"memory"):
        verify(kernel, Shape(1, 2, 1, 70, 300), "cpu", seed=SEED)


def _widest_overlap(problem: Problem) -> KernelConfig:
    """The warp-specialised family's widest passing overlap config with two stages, two
    consumer warpgroups where one fits (one at head dim 256)."""
    fits = [c for c in HOPPER_WS_FORWARD.candidates(problem, SM90A)
            if space.knob(c, space.OVERLAP) and not space.knob(c, space.PINGPONG)
            and c.num_stages == 2 and c.block_m <= 128]
    return max(fits, key=lambda c: (c.block_m, c.block_n))


def _sweep_cases() -> list[Case]:
    """Per family: every head dim, dtype, mask and shape with the default (and, in the
    warp-specialised one, with its widest overlap config)."""
    cases: list[Case] = []
    for family in NUMERICS_FAMILIES:
        for head_dim, dtype, causal in itertools.product(HEAD_DIMS, DType, (False, True)):
            problem = Problem(head_dim, dtype, causal=causal, op=family.op)
            configs = [family.default_config(problem, SM90A)]
            if family is HOPPER_WS_FORWARD:
                configs.append(_widest_overlap(problem))
            cases += [(family, head_dim, dtype, causal, shape, config)
                      for config in configs for shape in SHAPES]
    return cases


#: The (dtype, causal) pairs every point of a space is spread over.
_PAIRS = tuple(itertools.product(DType, (False, True)))


def _every_point() -> list[PointCase]:
    """Every point of each family's space its rules admit, at every head dim: each point
    once (its rules do not depend on the dtype or the mask), with the (dtype, mask) pairs
    dealt out in turn over a seeded shuffle of the points (so each pair takes a quarter of
    them, spread over every knob), on two shapes drawn from ``SHAPES``."""
    cases: list[PointCase] = []
    for family in NUMERICS_FAMILIES:
        for head_dim in HEAD_DIMS:
            rng = random.Random(f"{SEED}{family.op}{head_dim}")
            configs = list(_admitted(family, head_dim))
            rng.shuffle(configs)
            for i, config in enumerate(configs):
                dtype, causal = _PAIRS[i % len(_PAIRS)]
                shapes = tuple(rng.sample(SHAPES, 2))
                cases.append((family, head_dim, dtype, causal, shapes, config))
    return cases


PointCase = tuple[KernelFamily, int, DType, bool, tuple[Shape, ...], KernelConfig]


def _point_id(c: PointCase) -> str:
    return (f"{c[0].op}-d{c[1]}-{c[2].value}-{'causal' if c[3] else 'full'}-"
            f"{'+'.join(s.key() for s in c[4])}-{c[5].key()}")


def _check_point(case: PointCase) -> None:
    family, head_dim, dtype, causal, shapes, config = case
    problem = Problem(head_dim, dtype, causal=causal, op=family.op)
    assert family.rules(problem, config, SM90A) is None, config  # the space admits it
    for shape in shapes:
        _check(family, head_dim, dtype, causal, shape, config)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("case", when_swept(_sweep_cases), ids=_case_id)
def test_full_matrix_in_the_emulator(case: Case) -> None:
    _check(*case)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("case", when_swept(_every_point), ids=_point_id)
def test_every_admitted_point_in_the_emulator(case: PointCase) -> None:
    _check_point(case)


#: Points of the sweep the default run takes (drawn from the seed, ``FLASHTUNE_TEST_SEED``).
_DEFAULT_POINTS = 1


@pytest.mark.emulator
@pytest.mark.parametrize("case", random.Random(f"{SEED}points").sample(_every_point(),
                                                                       _DEFAULT_POINTS),
                         ids=_point_id)
def test_a_seeded_sample_of_the_sweep_in_the_emulator(case: PointCase) -> None:
    _check_point(case)


def test_the_sweep_holds_every_admitted_point_once() -> None:
    """Every point each family's rules admit, at every head dim, every knob value of the
    space among them, and each (dtype, mask) pair dealt a quarter of the points."""
    points = _every_point()
    keys = [(c[0].op, c[1], c[5]) for c in points]
    assert len(keys) == len(set(keys))
    for family in NUMERICS_FAMILIES:
        for head_dim in HEAD_DIMS:
            admitted = set(family.candidates(Problem(head_dim, DType.BF16, causal=True,
                                                     op=family.op), SM90A))
            swept = {c[5] for c in points if c[0] is family and c[1] == head_dim}
            assert swept == admitted, (family.op, head_dim)
    ws = [c for c in points if c[0] is HOPPER_WS_FORWARD]
    for param in space.WS_SPACE.params:
        seen = {family_point[param.name] for family_point in
                (HOPPER_WS_FORWARD.point(c[5]) for c in ws)}
        assert seen == set(param.values), param.name
    pairs = collections.Counter((c[2], c[3]) for c in ws)
    assert max(pairs.values()) - min(pairs.values()) <= len(HEAD_DIMS), pairs


# ------------------------------------------------------------------ through the public API


@pytest.mark.emulator
def test_attention_on_the_emulator_runs_it_only_as_sm90a(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(1, 70, 4, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 90, 2, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 90, 2, 64, generator=gen).to(torch.bfloat16)
    monkeypatch.setenv("FLASHTUNE_BACKEND", "emulator")
    monkeypatch.delenv("FLASHTUNE_EMULATOR_ARCH", raising=False)
    assert flashtune.explain(q, k, v, causal=True).problem.op == "fwd"  # the default sm_90
    monkeypatch.setenv("FLASHTUNE_EMULATOR_ARCH", "sm_90a")
    decision = flashtune.explain(q, k, v, causal=True)
    assert decision.problem.op == "fwd90aws" and decision.arch == "sm_90a"
    out, lse = flashtune.attention(q, k, v, causal=True, return_lse=True)
    ref_o, ref_lse = attention_reference(q, k, v, True, 64 ** -0.5)
    assert torch.allclose(out.double(), ref_o, atol=2.5e-2, rtol=2.5e-2)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-3, rtol=2e-6)


# ------------------------------------------------------------------ command line and shipping


def test_precompile_plans_name_the_serving_family_for_sm90a() -> None:
    generic = Problem(64, DType.FP16)
    odd = Problem(96, DType.FP16)
    served = Problem(64, DType.FP16, op=HOPPER_WS_FORWARD.op)
    # the sm_90a family's kernel, and the portable one a device refused it falls back to
    portable = (generic, default_config(generic, "sm_90"))
    planned = default_kernels("sm_90a", [generic, odd])
    assert [p for p, _ in planned] == [served, generic, odd]
    assert planned[0][1] == HOPPER_WS_FORWARD.default_config(served, SM90A)
    assert planned[1] == portable
    assert [p for p, _ in default_kernels("sm_90", [generic])] == [generic]
    device = DeviceInfo.virtual("sm_90a")
    pairs = planned_kernels(device, [generic], [1024], dispatcher=Dispatcher(lambda: _NoTuned()))
    assert pairs == [(served, HOPPER_WS_FORWARD.default_config(served, SM90A)), portable]


class _NoTuned:
    def all_best(self) -> list[BestEntry]:
        return []


def _compile_cli(*args: str) -> str:
    result = CliRunner(env={"COLUMNS": "250"}).invoke(
        app, ["compile", "--arch", "sm_90a", "--head-dim", "64", "--causal", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_cli_compile_for_sm90a_compiles_the_serving_family() -> None:
    out = _compile_cli()
    assert "fwd90aws_d64_fp16_causal: NVRTC resource usage" in out
    assert "m128_n128_w8_s2" in out and " ok " in out


@pytest.mark.sweep
def test_cli_compile_all_for_sm90a_lists_the_space() -> None:
    out = _compile_cli("--all", "--op", "fwd90a")
    passing = HOPPER_FORWARD.candidates(_problem(64, DType.FP16, True), SM90A)
    assert "space of fwd90a_d64_fp16_causal on sm_90a: 117 declared points" in out
    assert out.count(" ok ") == len(passing) == out.count(" 0/0 ")  # no spills
    # The configs the rules exclude (shared memory, accumulator registers) are counted only.
    assert f"117 legal configs, {len(passing)} pass the static rules" in out
