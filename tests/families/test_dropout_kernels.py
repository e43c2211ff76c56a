"""Dropout in the mma.sync forward and backward kernels (``fwd``, ``bwd``, ``bwddet``) and
in the serving sm_90a forward (``fwd90aws``, head dim 64), run by the CPU emulator.

The mask is drawn by the tests' own plain-Python Philox 4x32-10 (``dropout_philox``, checked
against Random123's known answers), never read back from a kernel: the forward's O and the
backward's dK, dV and dQ are compared with float64 references that apply that mask, with
causal masks, windows, softcaps, ALiBi, GQA and odd lengths, fp16 and bf16 (a seeded sample
in the default run, the grid behind ``-m sweep``). Also: flashtune's host generator (the
families' references) equals the tests' one; the same seed gives bitwise-identical outputs
and another offset another mask; the deterministic backward stays bitwise equal over
shuffled block orders with dropout on; the kept fraction is within a binomial bound.
"""

from __future__ import annotations

import itertools
import math
import os
import random
from typing import Any

import pytest
import torch
from dropout_philox import KNOWN_ANSWERS, float32, mask, philox

from flashtune import families
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families.base import Inputs
from flashtune.families.fwd.dropout import kept_mask
from flashtune.families.fwd.reference import scaled_scores
from flashtune.families.fwd.variants import VariantValues
from flashtune.families.hopper import space
from flashtune.families.hopper.ws import HOPPER_WS_FORWARD
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions

pytestmark = pytest.mark.emulator

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
SPLIT = (("dqmode", "split"),)

#: Feature switches besides dropout: alone, with causal, and together.
FEATURES: list[dict[str, bool]] = [
    {}, {"causal": True}, {"window": True}, {"softcap": True}, {"alibi": True},
    {"alibi": True, "causal": True}, {"window": True, "softcap": True, "alibi": True}]
SHAPES = [Shape(1, 2, 1, 77, 70), Shape(2, 4, 2, 45, 61), Shape(1, 1, 1, 33, 100)]
CONFIGS = {"fwd": [KernelConfig(64, 64, 4, 1), KernelConfig(32, 32, 2, 2)],
           "bwd": [KernelConfig(64, 64, 4, 1, extras=(("dqmode", "atomic"),)),
                   KernelConfig(32, 32, 2, 2, extras=SPLIT)],
           "bwddet": [KernelConfig(32, 32, 2, 2, extras=SPLIT),
                      KernelConfig(64, 32, 4, 2, extras=SPLIT)],
           # FA3's default schedule (ping-pong and overlap), and one plain warpgroup
           "fwd90aws": [HOPPER_WS_FORWARD.config({"block_m": 128, "block_n": 64,
                                                  "num_stages": 2, space.PINGPONG: 1,
                                                  space.OVERLAP: 1}),
                        HOPPER_WS_FORWARD.config({"block_m": 64, "block_n": 64,
                                                  "num_stages": 2})]}
#: The head dim of each op's cases (the sm_90a kernels take 64, 128 and 256).
HEAD_DIMS = {"fwd90aws": 64}

Case = tuple[str, dict[str, bool], DType, KernelConfig, Shape]


def test_philox_matches_the_published_known_answers() -> None:
    for counter, key, expected in KNOWN_ANSWERS:
        assert philox(counter, key) == expected


def test_flashtune_host_mask_equals_the_tests_generator() -> None:
    seed, offset = 0xF00D_1234_5678_9ABC, 3 * 2**32 + 7  # both 32-bit halves matter
    ours = torch.from_numpy(kept_mask(seed, offset, 0.3, 3, 21, 19, range(1, 3)))
    assert torch.equal(ours, mask(seed, offset, 0.3, range(1, 3), 3, 21, 19))


def _inputs(problem: Problem, shape: Shape, seed: int) -> Inputs:
    return families.of(problem).random_inputs(problem, shape, "cpu", seed)


def _launch(problem: Problem, config: KernelConfig, shape: Shape, inputs: Inputs,
            options: LaunchOptions | None = None) -> dict[str, torch.Tensor]:
    kernel = EmulatorBackend(options=options or LaunchOptions()).load(
        families.render(problem, config))
    family = families.of(problem)
    outputs = family.empty_outputs(problem, shape, inputs, poison=True)
    plan = family.launch_plan(problem, config, shape, inputs, outputs)
    kernel.launch(plan.grid, plan.args)
    return outputs


def _probs(problem: Problem, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """float64 undropped P (B, Hq, Nq, Nk), the scores' LSE and the call's values."""
    t = inputs.tensors
    values = VariantValues.of(inputs).only(problem)
    group = t["q"].shape[2] // t["k"].shape[2]
    scores = scaled_scores(t["q"].double(), t["k"].double().repeat_interleave(group, 2),
                           inputs.scalars["softmax_scale"], problem.causal,
                           window=values.window, softcap=values.softcap or None,
                           alibi_slopes=values.alibi_slopes)
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0)[..., None])
    return probs.nan_to_num(0.0), lse.masked_fill(torch.isneginf(lse), math.inf), values


def _kept_scale(inputs: Inputs, shape: Shape) -> torch.Tensor:
    """M / (1 - p) of the inputs' dropout, from the tests' generator."""
    s = inputs.scalars
    kept = mask(int(s["dropout_seed"]), int(s["dropout_offset"]), s["dropout_p"],
                range(shape.batch), shape.heads_q, shape.seqlen_q, shape.seqlen_k)
    return kept.double() / (1.0 - float32(s["dropout_p"]))


def _forward_reference(problem: Problem, shape: Shape, inputs: Inputs
                       ) -> dict[str, torch.Tensor]:
    probs, lse, _ = _probs(problem, inputs)
    v = inputs.tensors["v"].double()
    v = v.repeat_interleave(shape.heads_q // shape.heads_kv, 2)
    out = torch.einsum("bhqk,bkhd->bqhd", probs * _kept_scale(inputs, shape), v)
    return {"o": out, "lse": lse}


def _backward_reference(problem: Problem, shape: Shape, inputs: Inputs
                        ) -> dict[str, torch.Tensor]:
    """dK, dV and dQ's sum with the tests' mask; the tolerances' bounds are the family's."""
    family = families.of(problem)
    bounds = family.reference(problem, inputs)
    t = inputs.tensors
    group = shape.heads_q // shape.heads_kv
    q, dout = t["q"].double(), t["do"].double()
    k, v = (t[n].double().repeat_interleave(group, 2) for n in ("k", "v"))
    probs, _, values = _probs(problem, inputs)
    kept = _kept_scale(inputs, shape)
    dprobs = torch.einsum("bqhd,bkhd->bhqk", dout, v)
    dscores = probs * (dprobs * kept - t["dsum"].double()[..., None])
    if values.softcap:
        raw = torch.einsum("bqhd,bkhd->bhqk", q, k) * inputs.scalars["softmax_scale"]
        dscores = dscores * (1.0 - torch.tanh(raw / values.softcap) ** 2)

    def per_kv(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(shape.batch, shape.seqlen_k, shape.heads_kv, group, -1).sum(3)

    scale = inputs.scalars["softmax_scale"]
    return {**bounds,
            "dv": per_kv(torch.einsum("bhqk,bqhd->bkhd", probs * kept, dout)),
            "dk": per_kv(torch.einsum("bhqk,bqhd->bkhd", dscores, q)) * scale,
            "dq_accum": torch.einsum("bhqk,bkhd->bhqd", dscores, k)}


def _id(case: Case) -> str:
    op, switches, dtype, config, shape = case
    names = "-".join(sorted(switches)) or "plain"
    return f"{op}-{names}-{dtype.value}-{config.key()}-{shape.key()}"


def _run(case: Case) -> None:
    op, switches, dtype, config, shape = case
    problem = Problem(HEAD_DIMS.get(op, 32), dtype, op=op, causal=switches.get("causal", False),
                      features=("dropout", *(n for n in switches if n != "causal")))
    seed = random.Random(f"{SEED}-{_id(case)}").randrange(2**31)
    inputs = _inputs(problem, shape, seed)
    outputs = _launch(problem, config, shape, inputs)
    ref = (_forward_reference if op.startswith("fwd") else _backward_reference)(problem, shape,
                                                                                 inputs)
    verdict = families.of(problem).compare(problem, shape, outputs, ref)
    values = {k: v for k, v in inputs.scalars.items() if k != "softmax_scale"}
    assert verdict.ok, f"{_id(case)} {values} seed={seed}: {verdict.message}"


def _grid() -> list[Case]:
    return [(op, switches, dtype, config, shape)
            for op in CONFIGS
            for switches, dtype, config, shape in itertools.product(
                FEATURES, DType, CONFIGS[op], SHAPES)]


def _sample() -> list[Case]:
    """One feature set per op, on a dtype, config and shape drawn from the seed."""
    rng = random.Random(SEED)
    return [(op, rng.choice(FEATURES), rng.choice(list(DType)), rng.choice(CONFIGS[op]),
             rng.choice(SHAPES)) for op in CONFIGS]


@pytest.mark.parametrize("case", _sample(), ids=_id)
def test_dropout_matches_float64_with_the_tests_mask(case: Case) -> None:
    _run(case)


@pytest.mark.sweep
@pytest.mark.parametrize("case", _grid(), ids=_id)
def test_dropout_grid_matches_float64_with_the_tests_mask(case: Case) -> None:
    _run(case)


def test_same_seed_is_bitwise_equal_and_another_offset_draws_another_mask() -> None:
    problem = Problem(32, DType.FP16, op="fwd", features=("dropout",), causal=True)
    config, shape = KernelConfig(32, 32, 2, 2), Shape(1, 2, 1, 40, 40)
    inputs = _inputs(problem, shape, SEED)
    first = _launch(problem, config, shape, inputs)
    again = _launch(problem, config, shape, inputs)
    assert torch.equal(first["o"], again["o"]) and torch.equal(first["lse"], again["lse"])
    moved = Inputs(inputs.tensors, {**inputs.scalars,
                                    "dropout_offset": inputs.scalars["dropout_offset"] + 2})
    other = _launch(problem, config, shape, moved)
    assert torch.equal(other["lse"], first["lse"])  # the softmax's denominator is undropped
    assert not torch.equal(other["o"], first["o"])
    verdict = families.of(problem).compare(problem, shape, other,
                                           _forward_reference(problem, shape, moved))
    assert verdict.ok, verdict.message


def test_deterministic_backward_is_bitwise_equal_over_block_orders_with_dropout() -> None:
    problem = Problem(32, DType.BF16, op="bwddet",
                      features=("dropout", "window", "softcap", "alibi"))
    config, shape = KernelConfig(32, 32, 2, 2, extras=SPLIT), Shape(1, 4, 2, 100, 130)
    inputs = _inputs(problem, shape, SEED)
    runs = [_launch(problem, config, shape, inputs, LaunchOptions(block_order_seed=s))
            for s in (None, 1, 2)]
    verdict = families.of(problem).compare(problem, shape, runs[0],
                                           _backward_reference(problem, shape, inputs))
    assert verdict.ok, verdict.message
    for other in runs[1:]:
        for name in ("dk", "dv", "dq_accum"):
            assert torch.equal(other[name], runs[0][name]), name


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_is_within_a_binomial_bound(p: float) -> None:
    """Six standard deviations of Binomial(n, 1 - p) / n, on the tests' generator (a small
    sample) and on flashtune's host generator (a large one; equal to the tests' above)."""
    rng = random.Random(f"{SEED}-{p}")
    seed, offset = rng.randrange(2**64), rng.randrange(2**40)
    for kept in (mask(seed, offset, p, range(1), 2, 64, 64),
                 torch.from_numpy(kept_mask(seed, offset, p, 8, 256, 256, range(2)))):
        n = kept.numel()
        bound = 6 * math.sqrt(p * (1 - p) / n)
        assert abs(float(kept.double().mean()) - (1 - p)) <= bound, (p, n)


@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_dropout_defaults_compile_with_nvrtc_without_spills(op: str) -> None:
    """The head-dim-128 defaults with dropout compile for sm_80 with NVRTC and keep their
    registers (the Philox rounds are a loop, see dropout.cuh)."""
    from flashtune.codegen.arch import get_arch
    from flashtune.toolchain.compiler import compile_source

    problem = Problem(128, DType.BF16, op=op, causal=True, features=("dropout",))
    config = families.of(problem).default_config(problem, get_arch("sm_80"))
    kernel = compile_source(families.render(problem, config), "sm_80")
    assert kernel.resources.registers > 0 and kernel.resources.spill_bytes == 0
