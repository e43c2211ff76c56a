"""The backward kernels (bwd and bwddet) with traced score and mask modifications, run in
the CPU emulator: dK, dV, the dQ accumulator and the gradient by the modified score
(``dscore``) against the float64 reference (families/bwd/reference.py, which takes the
modifications' slope from torch autograd, not from the derivative trees the kernels are
rendered from), on NaN-poisoned outputs and fresh seeded inputs, with a control that the
kernel applied the modification; and a block mask's column ranges: each key tile walks
exactly the query tiles that hold a row seeing one of its keys (the emulator's tensor-core
counters; fails with skipping off), with the same results as walking every tile. One case
drawn with the run's seed in the default run (a third of the time over flash-attn's causal,
softcap and ALiBi); every case under -m sweep."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from flex_fixtures import (
    four_documents,
    launch_with_ranges,
)

from flashtune.api import flex_mods
from flashtune.api.block_mask import create_block_mask
from flashtune.api.flex import traced_feature
from flashtune.codegen.features import (
    Feature,
    mods_of,
    register_feature,
    unregister_feature,
)
from flashtune.codegen.score_mods import ModParam, ScoreMod
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.codegen.trace import trace
from flashtune.errors import FeatureNotSupported
from flashtune.families import render
from flashtune.families.bwd import BACKWARD, BACKWARD_DETERMINISTIC, BackwardFamily
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions

pytestmark = pytest.mark.emulator

_SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
Fn = Callable[..., Any] | None
H, N = 4, 90

#: Score modifications (their captured tensors are drawn again by the family's inputs).
SCORES: dict[str, Fn] = {
    "none": None,
    "t5": flex_mods.t5_relative_bias(torch.randn(H, 32), N, 64),
    "alibi": flex_mods.alibi(torch.rand(H)),
    "softcap": flex_mods.softcap(2.0),
    "learned-scale": lambda s, b, h, q, k: s * torch.sigmoid(torch.zeros(H)[h]) * 2.0
    + torch.zeros(N, N)[q, k],
}
MASKS: dict[str, Fn] = {
    "none": None,
    "causal": flex_mods.causal,
    "document": flex_mods.document(torch.sort(torch.randint(0, 4, (N,))).values),
    "prefix-lm": flex_mods.prefix_lm(torch.tensor([17, 60])),
    "sliding-window": flex_mods.sliding_window_causal(20),
    "flashmask": flex_mods.flashmask(torch.arange(N) + 9, torch.arange(N) + 30),
}
CASES = [(s, m) for s in SCORES for m in MASKS if (s, m) != ("none", "none")]
FAMILIES = {"bwd": BACKWARD, "bwddet": BACKWARD_DETERMINISTIC}
#: Small tiles: the emulator runs them quickly, and N = 90 spans several of them.
CONFIGS = {"bwd": KernelConfig(32, 32, 2, 2, extras=(("dqmode", "atomic"),)),
           "bwddet": KernelConfig(32, 32, 2, 2, extras=(("dqmode", "split"),))}


def _verify(score: str, mask: str, op: str, tiles: bool, seed: int,
            **builtins: bool) -> None:
    """One launch against the reference; ``builtins``: flash-attn's features (causal,
    window, softcap, alibi) switched on under the modification."""
    traced = trace(SCORES[score], MASKS[mask], tiles=tiles)
    family: BackwardFamily = FAMILIES[op]
    problem = Problem(64, DType.FP16, op=op, features=[traced_feature(traced)],
                      **cast(dict[str, Any], builtins))
    shape = Shape(2, H, 2, 70, N)
    where = f"{score}+{mask} {op} tiles={tiles} {builtins} seed={seed}"
    config = CONFIGS[op]
    kernel = EmulatorBackend().load(render(problem, config))
    inputs = family.random_inputs(problem, shape, "cpu", seed)
    outputs = family.empty_outputs(problem, shape, inputs, poison=True)
    plan = family.launch_plan(problem, config, shape, inputs, outputs)
    kernel.launch(plan.grid, plan.args)
    for name in ("dk", "dv"):
        assert not outputs[name].isnan().any(), f"{where}: {name} has unwritten elements"
    verdict = family.compare(problem, shape, outputs, family.reference(problem, inputs))
    assert verdict.ok, f"{where}: {verdict.message}"
    # Control: without the modification the reference differs (the kernel applied it).
    plain = Problem(64, DType.FP16, op=op, **cast(dict[str, Any], builtins))
    control = family.reference(plain, inputs)
    got = outputs["dk"].double()
    assert (got - control["dk"]).abs().max() > 10 * (got - family.reference(
        problem, inputs)["dk"]).abs().max(), f"{where}: the modification changed nothing"


@pytest.mark.parametrize("op", [random.Random(f"{_SEED}-op").choice(sorted(FAMILIES))])
def test_a_sampled_modification_in_the_backward(op: str) -> None:
    rng = random.Random(f"{_SEED}-case")
    score, mask = rng.choice(CASES)
    builtins = rng.choice([{}, {}, {"causal": True, "softcap": True, "alibi": True}])
    _verify(score, mask, op, rng.random() < 0.5, rng.randrange(2**31), **builtins)


@pytest.mark.sweep
def test_a_modification_over_the_built_in_features() -> None:
    """Softcap and ALiBi (flash-attn's) before a learned scale, under a causal mask and a
    document mask: the slopes chain (dS carries tanh's and the modification's)."""
    for op in sorted(FAMILIES):
        _verify("learned-scale", "document", op, op == "bwd",
                random.Random(f"{_SEED}-builtins-{op}").randrange(2**31), causal=True,
                softcap=True, alibi=True)


@pytest.mark.sweep
@pytest.mark.parametrize("op", sorted(FAMILIES))
@pytest.mark.parametrize(("score", "mask"), CASES, ids=[f"{s}+{m}" for s, m in CASES])
def test_every_modification_in_the_backward(score: str, mask: str, op: str) -> None:
    _verify(score, mask, op, mask != "none",
            random.Random(f"{_SEED}-{score}-{mask}-{op}").randrange(2**31))


def test_a_block_mask_skips_the_empty_tiles_in_the_backward() -> None:
    _skip_case(random.Random(f"{_SEED}-skip").random() < 0.5)


@pytest.mark.sweep
@pytest.mark.parametrize("flash", [False, True], ids=["document-ids", "flashmask"])
def test_block_masks_skip_the_empty_tiles_in_the_backward_in_both_forms(flash: bool) -> None:
    _skip_case(flash)


def _skip_case(flash: bool) -> None:
    """Causal document masking (4 documents, the first holding full tiles), as document ids
    or in FlashMask's column form (``flash``), through the
    atomic backward, one block per key tile: with the mask's column ranges each block's
    tensor-core count is its number of query tiles that see one of its keys (counted from
    the dense mask) times one step's count; walking every query tile costs more and gives
    the same bits; and marking every tile full changes the result (the mask is evaluated
    on the partial tiles)."""
    n, dim, op = 256, 32, "bwd"
    family, config = FAMILIES[op], CONFIGS[op]
    cuts, _, mask_mod = four_documents(n, _SEED, flash)
    block_mask = create_block_mask(mask_mod, 1, 1, n, n)
    traced = trace(None, mask_mod, tiles=True)
    problem = Problem(dim, DType.FP16, op=op, features=[traced_feature(traced)])
    shape = Shape(1, 1, 1, n, n)
    drawn = family.random_inputs(problem, shape, "cpu", _SEED)
    kernel = EmulatorBackend(options=LaunchOptions(counters=True)).load(
        render(problem, config))

    def launch(ranges: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[int], bool]:
        outputs, counts, verdict = launch_with_ranges(family, problem, config, shape, kernel,
                                                      traced, ranges, drawn)
        return outputs, counts, verdict.ok

    ranges = block_mask.tiles(config.block_m, config.block_n, torch.device("cpu"),
                              columns=True)
    assert ranges.shape == (1, 1, n // config.block_n, 4)
    assert int((ranges[..., 3] - ranges[..., 2]).sum()) > 0, f"cuts={cuts}: no full tiles"
    skipped_out, skipped, ok = launch(ranges)
    assert ok, f"cuts={cuts}: wrong gradients with the block mask"
    # Zero gradients would make every later comparison vacuous (stale forward statistics
    # once hid whole rows here).
    assert float(skipped_out["dv"].abs().amax()) > 0, f"cuts={cuts}: dV is zero"
    tiles_m = n // config.block_m
    every = torch.tensor([0, tiles_m, 0, 0], dtype=torch.int32).expand(1, 1, n // 32, 4)
    walked_out, walked, ok = launch(every.contiguous())
    assert ok, f"cuts={cuts}: wrong gradients walking every tile"
    # Walking every query tile, each block's count is tiles_m steps of equal cost.
    assert len(set(walked)) == 1 and walked[0] % tiles_m == 0, walked
    per_step = walked[0] // tiles_m
    visible = mask_mod(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                       torch.arange(n)[:, None], torch.arange(n)[None, :])
    expected = []
    for t in range(n // config.block_n):
        cols = visible[:, t * config.block_n:(t + 1) * config.block_n].any(-1)
        expected.append(per_step * int(cols.view(tiles_m, config.block_m).any(-1).sum()))
    assert skipped == expected, f"cuts={cuts}"
    assert sum(skipped) < sum(walked), f"cuts={cuts}"
    for name in ("dk", "dv", "dq_accum", "dscore"):
        assert torch.equal(skipped_out[name], walked_out[name]), f"cuts={cuts}: {name}"
    all_full = ranges.clone()
    all_full[..., 2], all_full[..., 3] = ranges[..., 0], ranges[..., 1]
    _, _, ok = launch(all_full)
    assert not ok, f"cuts={cuts}: the mask was applied on full tiles"


def test_a_modification_without_a_derivative_is_refused_by_the_backward() -> None:
    def stepped(s: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
        return s + (s * 4.0) // 1.0

    name = traced_feature(trace(stepped))
    for op, family in FAMILIES.items():
        with pytest.raises(FeatureNotSupported, match=rf"{name}.*declare none.*score_slope"):
            family.check_problem(Problem(64, DType.FP16, op=op, features=[name]))


#: Two declared modifications with their derivatives, applied in key order: a scale, then
#: a tanh; the backward's slope is their chain, tanh'(w s) w.
_SCALE = Feature("bwdscale", "bwdscale", "a scaled score (test)", score=ScoreMod(
    "score * w", lambda score, b, h, q_idx, kv_idx, w: score * w,
    (ModParam("w", draws=(0.5, 1.5)),), grad="w"))
_TANH = Feature("bwdtanh", "bwdtanh", "a tanh of the score (test)", score=ScoreMod(
    "2.0f * tanhf(score)", lambda score, b, h, q_idx, kv_idx: 2.0 * torch.tanh(score),
    grad="2.0f * (1.0f - tanhf(score) * tanhf(score))"))


def test_declared_modifications_chain_their_slopes_in_key_order() -> None:
    register_feature(_SCALE)
    register_feature(_TANH)
    try:
        op = random.Random(f"{_SEED}-chain").choice(sorted(FAMILIES))
        family, config = FAMILIES[op], CONFIGS[op]
        problem = Problem(64, DType.FP16, op=op, features=["bwdscale", "bwdtanh"])
        assert [name for name, _ in mods_of(problem.features)] == ["bwdscale", "bwdtanh"]
        shape = Shape(1, 2, 1, 50, 70)
        kernel = EmulatorBackend().load(render(problem, config))
        inputs = family.random_inputs(problem, shape, "cpu", _SEED)
        outputs = family.empty_outputs(problem, shape, inputs, poison=True)
        plan = family.launch_plan(problem, config, shape, inputs, outputs)
        kernel.launch(plan.grid, plan.args)
        verdict = family.compare(problem, shape, outputs, family.reference(problem, inputs))
        assert verdict.ok, f"{op} seed={_SEED}: {verdict.message}"
    finally:
        unregister_feature(_TANH.name)
        unregister_feature(_SCALE.name)
