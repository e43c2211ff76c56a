"""The sm_90a backward (``bwd90a``) with the features it declares: sliding windows (query
tiles outside the window of a key tile skipped; the causal window (left, 0) among them) and
softcap (the tanh's derivative in dS), alone, softcap with causal masks, and together,
over head dims 64, 128 and 256; and varlen (packs with zero-length sequences, alone, causal,
with a window and softcap).

Every case runs through the family (fresh inputs from a printed seed with the features'
values, LSE and D of those features, NaN-poisoned outputs, the float64 reference) in both
thread orders; gradients are checked against float64 autograd of plain PyTorch (flash-attn's
rule); the split dQ mode stays bitwise equal over shuffled block orders with both features,
and a counter test checks that a narrow window visits fewer query tiles (it fails when
skipping is disabled). The default run takes a seeded sample (``FLASHTUNE_TEST_SEED``
replays it), ``-m sweep`` the grid.
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Any, cast

import pytest
import torch
from feature_inputs import backward_inputs
from grad_helpers import feature_scores, gradients, within_rule
from hopper_sample import emulate
from sampling import seeded_part
from test_bwd_varlen import FEATURES as VARLEN_FEATURES_OF
from test_bwd_varlen import PACKS, autograd_reference, packed_inputs
from test_bwd_varlen import _zero_parts as zero_parts

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.errors import FeatureNotSupported
from flashtune.families.base import Inputs
from flashtune.families.bwd90a import HOPPER_BACKWARD, space
from flashtune.runtime.backends.emulator import LaunchOptions, Schedule
from flashtune.toolchain.compiler import compile_source

pytestmark = pytest.mark.emulator

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
SM90A = get_arch("sm_90a")

#: (switches, window or None for a drawn one, cap or None for a drawn one): each feature
#: alone, with causal, together; a cap of 2 saturates the tanh (its derivative far from 1).
FEATURES: list[tuple[dict[str, bool], tuple[int, int] | None, float | None]] = [
    ({"window": True}, (16, 0), None), ({"window": True}, (3, 40), None),
    ({"window": True}, None, None), ({"window": True}, (70, 0), None),
    ({"softcap": True}, None, None), ({"softcap": True}, None, 2.0),
    ({"softcap": True, "causal": True}, None, None),
    ({"window": True, "softcap": True}, (32, 8), 2.0)]
#: GQA over several key and query tiles with odd lengths; Nq < Nk; Nq > Nk.
SHAPES = [Shape(1, 4, 2, 100, 150), Shape(1, 1, 1, 33, 130), Shape(2, 2, 1, 150, 70)]

Case = tuple[dict[str, bool], tuple[int, int] | None, float | None, int, DType, KernelConfig,
             Shape]


def _config(block_n: int, dqmode: str = space.DQ_ATOMIC) -> KernelConfig:
    return HOPPER_BACKWARD.config({"block_m": 64, "block_n": block_n, "num_stages": 1,
                                   "dqmode": dqmode})


def _inputs(problem: Problem, shape: Shape, window: tuple[int, int] | None, seed: int,
            cap: float | None = None) -> Inputs:
    return backward_inputs(HOPPER_BACKWARD, problem, shape, seed, window, cap)


def _launch(problem: Problem, config: KernelConfig, shape: Shape, inputs: Inputs,
            options: LaunchOptions | None = None) -> tuple[dict[str, torch.Tensor], object]:
    return emulate(HOPPER_BACKWARD, problem, config, shape, inputs, options)


def _check(problem: Problem, config: KernelConfig, shape: Shape,
           window: tuple[int, int] | None, cap: float | None, seed: int) -> None:
    """Both thread orders against the family's float64 reference."""
    inputs = _inputs(problem, shape, window, seed, cap)
    reference = HOPPER_BACKWARD.reference(problem, inputs)
    values = {k: v for k, v in inputs.scalars.items() if k != "softmax_scale"}
    for schedule in Schedule:
        outputs, _ = _launch(problem, config, shape, inputs, LaunchOptions(schedule=schedule))
        verdict = HOPPER_BACKWARD.compare(problem, shape, outputs, reference)
        where = f"{problem.key()} {config.key()} {shape.key()} {values} seed={seed} {schedule}"
        assert verdict.ok, f"{where}: {verdict.message}"


def _problem(switches: dict[str, bool], head_dim: int, dtype: DType) -> Problem:
    return Problem(head_dim, dtype, op=HOPPER_BACKWARD.op, **cast(dict[str, Any], switches))


def _grid() -> list[Case]:
    """Every feature set, head dim, dtype, passing config and shape."""
    return [(switches, window, cap, head_dim, dtype, config, shape)
            for (switches, window, cap), head_dim, dtype in itertools.product(
                FEATURES, space.HEAD_DIMS, DType)
            for config in HOPPER_BACKWARD.candidates(_problem(switches, head_dim, dtype), SM90A)
            for shape in SHAPES]


def _sample() -> list[Case]:
    """Three feature sets drawn from the seed, one per head dim (d64 on a drawn passing
    config, the others on their default), dtype and shape drawn too."""
    rng = random.Random(f"{SEED}bwd90a-features")
    out: list[Case] = []
    for (switches, window, cap), head_dim in zip(rng.sample(FEATURES, 3), space.HEAD_DIMS,
                                                 strict=True):
        dtype = rng.choice(list(DType))
        problem = _problem(switches, head_dim, dtype)
        config = (rng.choice(HOPPER_BACKWARD.candidates(problem, SM90A)) if head_dim == 64
                  else HOPPER_BACKWARD.default_config(problem, SM90A))
        out.append((switches, window, cap, head_dim, dtype, config, rng.choice(SHAPES)))
    return out


def _id(case: Case) -> str:
    switches, window, cap, head_dim, dtype, config, shape = case
    names = "-".join(sorted(switches)) + (f"{window[0]}_{window[1]}" if window else "")
    names += f"-cap{cap:g}" if cap is not None else ""
    return f"{names}-d{head_dim}-{dtype.value}-{config.key()}-{shape.key()}"


def _run_case(case: Case) -> None:
    switches, window, cap, head_dim, dtype, config, shape = case
    seed = random.Random(f"{SEED}-{_id(case)}").randrange(2**31)
    _check(_problem(switches, head_dim, dtype), config, shape, window, cap, seed)


def test_declares_window_softcap_and_varlen_and_refuses_the_others() -> None:
    assert HOPPER_BACKWARD.features == frozenset({"window", "softcap", "varlen"})
    for switches in ({"alibi": True}, {"dropout": True}, {"sinks": True}):
        with pytest.raises(FeatureNotSupported):
            families.render(_problem(switches, 64, DType.FP16), _config(64))


@pytest.mark.parametrize("head_dim", seeded_part(space.HEAD_DIMS, 1, "bwd90a-features-nvrtc"))
def test_nvrtc_compiles_every_feature_for_sm90a_without_spills(head_dim: int) -> None:
    """At a seeded head dim (every head dim under ``-m sweep``)."""
    dtype = random.Random(f"{SEED}nvrtc-features{head_dim}").choice(list(DType))
    problem = _problem({"window": True, "softcap": True, "varlen": True}, head_dim, dtype)
    source = families.render(problem, HOPPER_BACKWARD.default_config(problem, SM90A))
    kernel = compile_source(source, "sm_90")
    assert kernel.arch == "sm_90a" and kernel.resources.spill_bytes == 0, kernel.resources


@pytest.mark.parametrize("case", _sample(), ids=_id)
def test_features_match_float64(case: Case) -> None:
    _run_case(case)


@pytest.mark.sweep
@pytest.mark.parametrize("case", _grid(), ids=_id)
def test_features_grid_matches_float64(case: Case) -> None:
    _run_case(case)


def test_gradients_within_flash_attn_rule_against_float64_autograd() -> None:
    """dQ, dK, dV of a window with softcap (GQA, odd lengths, head dim drawn; a cap of 2, so
    the tanh's derivative matters) against torch autograd of plain attention in float64:
    error at most 3x that of the input dtype's."""
    rng = random.Random(f"{SEED}features-autograd")
    head_dim, dtype = rng.choice(space.HEAD_DIMS), rng.choice(list(DType))
    problem = _problem({"window": True, "softcap": True}, head_dim, dtype)
    shape, window = Shape(1, 4, 2, 90, 120), (24, 6)
    inputs = _inputs(problem, shape, window, rng.randrange(2**31), 2.0)
    outputs, _ = _launch(problem, HOPPER_BACKWARD.default_config(problem, SM90A), shape, inputs)
    t, cap = inputs.tensors, float(inputs.scalars["softcap"])
    scale = inputs.scalars["softmax_scale"]
    ours = {"dk": outputs["dk"], "dv": outputs["dv"],
            "dq": (outputs["dq_accum"].double().sum(0).transpose(1, 2) * scale).to(t["q"].dtype)}

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores, visible, v = feature_scores(q, k, v, False, window, cap, None)
        seen = visible.any(-1)[:, None]
        scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~seen, 0.0)
        probs = torch.softmax(scores, dim=-1).masked_fill(~seen, 0.0)
        return torch.einsum("bhqk,bkhd->bqhd", probs, v)

    leaves = (t["q"], t["k"], t["v"])
    exact = gradients(attend, tuple(x.double() for x in leaves), t["do"].double())
    low = gradients(attend, leaves, t["do"])
    del exact["out"], low["out"]
    within_rule(ours, low, exact, f"bwd90a d{head_dim} {dtype.value} window {window} "
                                  f"softcap {cap}")


def test_split_mode_is_bitwise_equal_over_block_orders_with_both_features() -> None:
    problem = _problem({"window": True, "softcap": True}, 64, DType.BF16)
    config = _config(64, space.DQ_SPLIT)
    shape = Shape(1, 4, 2, 150, 200)
    inputs = _inputs(problem, shape, (40, 10), SEED)
    runs = [_launch(problem, config, shape, inputs, LaunchOptions(block_order_seed=s))[0]
            for s in (None, 1, 2, 3)]
    verdict = HOPPER_BACKWARD.compare(problem, shape, runs[0],
                                      HOPPER_BACKWARD.reference(problem, inputs))
    assert verdict.ok, verdict.message
    assert runs[0]["dq_accum"].shape[0] > 1
    for other in runs[1:]:
        for name in ("dk", "dv", "dq_accum"):
            assert torch.equal(other[name], runs[0][name]), name


def test_a_narrow_window_skips_query_tiles() -> None:
    """A window of 8 keys each side over 256 rows, key tiles of 64 and query tiles of 64:
    key tile n is seen by rows [64 n - 8, 64 n + 71], i.e. 2 query tiles at either end and 3
    elsewhere: 10 of the 16 (key tile, query tile) pairs, so 10/16 of the unbounded window's
    tensor-core work."""
    shape = Shape(1, 1, 1, 256, 256)
    problem = _problem({"window": True}, 64, DType.FP16)
    counts = {}
    for window in ((8, 8), (-1, -1)):
        inputs = _inputs(problem, shape, window, SEED)
        outputs, counters = _launch(problem, _config(64), shape, inputs,
                                    LaunchOptions(counters=True))
        verdict = HOPPER_BACKWARD.compare(problem, shape, outputs,
                                          HOPPER_BACKWARD.reference(problem, inputs))
        assert verdict.ok, verdict.message
        assert counters is not None
        counts[window] = counters.mma_count  # type: ignore[attr-defined]
    assert counts[(8, 8)] * 16 == counts[(-1, -1)] * 10, counts


# ------------------------------------------------------------------ varlen

#: The varlen features of the sm_90a backward (names of test_bwd_varlen.FEATURES).
VARLEN_FEATURES = ("plain", "causal", "window", "window-softcap")
VarlenCase = tuple[str, str, int, DType, KernelConfig]


def _varlen_id(case: VarlenCase) -> str:
    features, pack, head_dim, dtype, config = case
    return f"varlen-{features}-{pack}-d{head_dim}-{dtype.value}-{config.key()}"


def _run_varlen(case: VarlenCase, orders: tuple[int | None, ...] = (None,)) -> None:
    """A pack with a zero-length sequence (test_bwd_varlen.PACKS) in both thread orders (and
    the given block orders: bitwise equal to the first) against the family's float64
    reference, itself checked against per-sequence float64 autograd; zero-length sequences
    give exact zeros."""
    features, pack, head_dim, dtype, config = case
    switches, window = VARLEN_FEATURES_OF[features]
    problem = _problem({"varlen": True, **switches}, head_dim, dtype)
    seed = random.Random(f"{SEED}-{_varlen_id(case)}").randrange(2**31)
    shape, inputs = packed_inputs(problem, PACKS[pack], window, seed)
    reference = HOPPER_BACKWARD.reference(problem, inputs)
    for name, value in autograd_reference(problem, inputs).items():
        assert torch.allclose(reference[name], value, rtol=1e-4,
                              atol=1e-5 * (float(value.abs().max()) or 1.0)), name
    where = f"{_varlen_id(case)} {PACKS[pack]} seed={seed}"
    runs = [_launch(problem, config, shape, inputs, LaunchOptions(schedule=schedule))[0]
            for schedule in Schedule]
    runs += [_launch(problem, config, shape, inputs, LaunchOptions(block_order_seed=order))[0]
             for order in orders[1:]]
    for outputs in runs:
        verdict = HOPPER_BACKWARD.compare(problem, shape, outputs, reference)
        assert verdict.ok, f"{where}: {verdict.message}"
        zero_parts(inputs, outputs)
    for other in runs[len(Schedule):]:
        for name in ("dk", "dv", "dq_accum"):
            assert torch.equal(other[name], runs[0][name]), f"{where}: {name}"


def _varlen_sample() -> list[VarlenCase]:
    """Causal at head dim 128 and window + softcap at 256 on their defaults, on packs and
    dtypes drawn from the seed."""
    rng = random.Random(f"{SEED}bwd90a-varlen")
    out: list[VarlenCase] = []
    for features, head_dim in (("causal", 128), ("window-softcap", 256)):
        dtype = rng.choice(list(DType))
        switches = VARLEN_FEATURES_OF[features][0]
        problem = _problem({"varlen": True, **switches}, head_dim, dtype)
        out.append((features, rng.choice(list(PACKS)), head_dim, dtype,
                    HOPPER_BACKWARD.default_config(problem, SM90A)))
    return out


def _varlen_grid() -> list[VarlenCase]:
    return [(features, pack, head_dim, dtype, config)
            for features, pack, head_dim, dtype in itertools.product(
                VARLEN_FEATURES, PACKS, space.HEAD_DIMS, DType)
            for config in HOPPER_BACKWARD.candidates(
                _problem({"varlen": True, **VARLEN_FEATURES_OF[features][0]}, head_dim,
                         dtype), SM90A)]


@pytest.mark.parametrize("case", _varlen_sample(), ids=_varlen_id)
def test_varlen_matches_float64(case: VarlenCase) -> None:
    _run_varlen(case)


@pytest.mark.sweep
@pytest.mark.parametrize("case", _varlen_grid(), ids=_varlen_id)
def test_varlen_grid_matches_float64(case: VarlenCase) -> None:
    _run_varlen(case)


def test_varlen_split_mode_is_bitwise_equal_over_block_orders() -> None:
    pack = random.Random(f"{SEED}varlen-det").choice(sorted(PACKS))
    _run_varlen(("causal", pack, 64, DType.FP16, _config(64, space.DQ_SPLIT)), (None, 1, 2, 3))
