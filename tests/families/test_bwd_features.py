"""The backward main kernel with the forward's features: sliding windows (query tiles outside
the window of a key tile skipped), softcap (the tanh's derivative in dS), ALiBi, their
combinations with causal masks and GQA, in ``bwd`` (atomic and split dQ) and ``bwddet``.

Every case runs through the family (fresh inputs from a printed seed with the features'
drawn values, LSE and D of those features, NaN-poisoned outputs, the float64 reference);
the default run takes a seeded sample, ``-m sweep`` the grid. The split mode stays bitwise
equal over shuffled block orders with every feature, and a counter test checks that a
narrow window visits fewer tiles (it fails when skipping is disabled).
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Any, cast

import pytest
import torch
from feature_inputs import backward_inputs

from flashtune import families
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families.base import Inputs
from flashtune.families.bwd import BACKWARD
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions

pytestmark = pytest.mark.emulator

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
ATOMIC = {"dqmode": "atomic"}
SPLIT = {"dqmode": "split"}

#: (switches, window or None for a drawn one): each feature alone, with causal, and together.
FEATURES = [({"window": True}, (16, 0)), ({"window": True}, (3, 40)), ({"window": True}, None),
            ({"softcap": True}, None), ({"softcap": True, "causal": True}, None),
            ({"alibi": True}, None), ({"alibi": True, "causal": True}, None),
            ({"window": True, "softcap": True, "alibi": True}, (32, 8))]
SHAPES = [Shape(1, 2, 1, 77, 70), Shape(2, 4, 2, 100, 130), Shape(1, 1, 1, 33, 100)]
CONFIGS = [KernelConfig(64, 64, 4, 1, extras=ATOMIC), KernelConfig(32, 32, 2, 2, extras=SPLIT),
           KernelConfig(64, 32, 4, 2, extras=SPLIT)]


def _inputs(problem: Problem, shape: Shape, window: tuple[int, int] | None, seed: int
            ) -> Inputs:
    """The family's random inputs, with ``window`` (when given) instead of the drawn one:
    redrawn with the family's LSE and D for that window."""
    return backward_inputs(BACKWARD, problem, shape, seed, window)


def _launch(problem: Problem, config: KernelConfig, shape: Shape, inputs: Inputs,
            options: LaunchOptions | None = None) -> tuple[dict[str, torch.Tensor], object]:
    kernel = EmulatorBackend(options=options or LaunchOptions()).load(
        families.render(problem, config))
    family = families.of(problem)
    outputs = family.empty_outputs(problem, shape, inputs, poison=True)
    plan = family.launch_plan(problem, config, shape, inputs, outputs)
    kernel.launch(plan.grid, plan.args)
    return outputs, getattr(kernel, "last_counters", None)


def _check(problem: Problem, config: KernelConfig, shape: Shape,
           window: tuple[int, int] | None, seed: int) -> None:
    inputs = _inputs(problem, shape, window, seed)
    outputs, _ = _launch(problem, config, shape, inputs)
    family = families.of(problem)
    verdict = family.compare(problem, shape, outputs, family.reference(problem, inputs))
    where = (f"{problem.key()} {config.key()} {shape.key()} "
             f"{ {k: v for k, v in inputs.scalars.items() if k != 'softmax_scale'} } seed={seed}")
    assert verdict.ok, f"{where}: {verdict.message}"


def _grid() -> list[tuple[dict[str, bool], tuple[int, int] | None, DType, KernelConfig, Shape,
                          str]]:
    return [(switches, window, dtype, config, shape, op)
            for (switches, window), dtype, config, shape, op in itertools.product(
                FEATURES, DType, CONFIGS, SHAPES, ("bwd", "bwddet"))
            if not (op == "bwddet" and config.extra("dqmode", "") == "atomic")]


def _sample() -> list[tuple[dict[str, bool], tuple[int, int] | None, DType, KernelConfig,
                            Shape, str]]:
    """Half the feature sets (drawn from the seed; all of them under ``-m sweep``), each on
    a config, dtype, shape and op drawn from the seed."""
    rng = random.Random(SEED)
    out = []
    for switches, window in rng.sample(FEATURES, len(FEATURES) // 2):
        op = rng.choice(("bwd", "bwddet"))
        config = rng.choice([c for c in CONFIGS if op == "bwd"
                             or c.extra("dqmode", "") == "split"])
        out.append((switches, window, rng.choice(list(DType)), config, rng.choice(SHAPES), op))
    return out


def _id(case: tuple[dict[str, bool], tuple[int, int] | None, DType, KernelConfig, Shape,
                    str]) -> str:
    switches, window, dtype, config, shape, op = case
    names = "-".join(sorted(switches)) + (f"{window[0]}_{window[1]}" if window else "")
    return f"{op}-{names}-{dtype.value}-{config.key()}-{shape.key()}"


def _run_case(case: tuple[dict[str, bool], tuple[int, int] | None, DType, KernelConfig,
                          Shape, str]) -> None:
    switches, window, dtype, config, shape, op = case
    problem = Problem(64, dtype, op=op, **cast(dict[str, Any], switches))
    seed = random.Random(f"{SEED}-{_id(case)}").randrange(2**31)
    _check(problem, config, shape, window, seed)


@pytest.mark.parametrize("case", _sample(), ids=_id)
def test_features_match_float64(case) -> None:  # type: ignore[no-untyped-def]
    _run_case(case)


@pytest.mark.sweep
@pytest.mark.parametrize("case", _grid(), ids=_id)
def test_features_grid_matches_float64(case) -> None:  # type: ignore[no-untyped-def]
    _run_case(case)


def test_split_mode_is_bitwise_equal_over_block_orders_with_every_feature() -> None:
    problem = Problem(32, DType.BF16, op="bwddet", window=True, softcap=True, alibi=True)
    config = KernelConfig(32, 32, 2, 2, extras=SPLIT)
    shape = Shape(1, 4, 2, 150, 200)
    inputs = _inputs(problem, shape, (40, 10), SEED)
    runs = [_launch(problem, config, shape, inputs, LaunchOptions(block_order_seed=s))[0]
            for s in (None, 1, 2)]
    verdict = BACKWARD.compare(problem, shape, runs[0], BACKWARD.reference(problem, inputs))
    assert verdict.ok, verdict.message
    for other in runs[1:]:
        for name in ("dk", "dv", "dq_accum"):
            assert torch.equal(other[name], runs[0][name]), name


def test_a_narrow_window_skips_query_tiles() -> None:
    """A window of 8 keys each side over 256 rows in tiles of 32: key tile n is seen by
    rows [32 n - 8, 32 n + 39], i.e. 2 query tiles at either end and 3 elsewhere: 22 of the
    64 (key tile, query tile) pairs, so 22/64 of the unbounded window's tensor-core work."""
    shape = Shape(1, 1, 1, 256, 256)
    config = KernelConfig(32, 32, 2, 1, extras=ATOMIC)
    counts = {}
    for window in ((8, 8), (-1, -1)):
        problem = Problem(32, DType.FP16, op="bwd", window=True)
        inputs = _inputs(problem, shape, window, SEED)
        outputs, counters = _launch(problem, config, shape, inputs,
                                    LaunchOptions(counters=True))
        verdict = BACKWARD.compare(problem, shape, outputs, BACKWARD.reference(problem, inputs))
        assert verdict.ok, verdict.message
        assert counters is not None
        counts[window] = counters.mma_count  # type: ignore[attr-defined]
    assert counts[(8, 8)] * 64 == counts[(-1, -1)] * 22, counts
