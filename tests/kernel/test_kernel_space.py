"""Configs of the search space run correctly in the emulator, or a rule excludes them.

The space is the forward family's for head dims 64 and 128, both dtypes, causal and not; a
config is in scope when ``space.static_check`` admits it for sm_80 or sm_90 (configs it
rejects are excluded by a rule that names why). The space has about 10^5 configs a problem
(tile shapes times structure knobs), too many to run each in the emulator: ``pytest -m
sweep`` runs every tile shape with the knobs at their defaults (each on one problem, the
problems in turn) and SWEEP_SAMPLE configs drawn
from the whole space, in both emulator thread orders (tests/kernel/test_kernel_knobs.py
sweeps every knob value on chosen tiles); the default tier runs a sample of the whole space
that changes from run to run, seeded (the seed is printed in the report header and in
failure messages; replay with FLASHTUNE_TEST_SEED).
"""

from __future__ import annotations

import itertools
import random

import pytest
from fwd_reference import Case, run_and_check
from kernel_space_seed import SEED_VARIABLE, SPACE_SEED
from sampling import when_swept

from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.families import render
from flashtune.families.fwd import FORWARD, space
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions, Schedule

pytestmark = pytest.mark.emulator

ARCHS = tuple(get_arch(name) for name in ("sm_80", "sm_90"))
PROBLEMS = tuple(Problem(hd, dt, causal=c)
                 for hd, dt, c in itertools.product((64, 128), DType, (False, True)))
#: Small, off the tile grid in both lengths, GQA 2:1, batch 2.
SMALL = Case(batch=2, seqlen_q=150, seqlen_k=200, heads_q=2, heads_kv=1)
SAMPLE_SIZE = 2
#: Configs of the whole space (knobs included) the sweep draws, seeded.
SWEEP_SAMPLE = 64
#: Configs a problem's rule check draws from the whole space, beside every tile shape.
RULE_SAMPLE = 4000


def in_scope(problem: Problem, config: KernelConfig) -> bool:
    return any(space.static_check(problem, config, arch) is None for arch in ARCHS)


def draw(rng: random.Random, count: int) -> list[tuple[Problem, KernelConfig]]:
    """``count`` in-scope (problem, config) pairs of the whole space, drawn by ``rng``."""
    out: list[tuple[Problem, KernelConfig]] = []
    configs = FORWARD.search_space(PROBLEMS[0])  # the same for every problem
    while len(out) < count:
        problem, config = rng.choice(PROBLEMS), rng.choice(configs)
        if in_scope(problem, config) and (problem, config) not in out:
            out.append((problem, config))
    return out


def tile_shapes() -> list[tuple[Problem, KernelConfig]]:
    """Every tile shape with the knobs at their defaults, once, on the problems in turn (the
    first in scope from the i-th on), so that the sweep's size stays that of the shapes."""
    out = []
    shapes = [c for c in FORWARD.search_space(PROBLEMS[0]) if not c.extras]
    for index, config in enumerate(shapes):
        turn = PROBLEMS[index % len(PROBLEMS):] + PROBLEMS[:index % len(PROBLEMS)]
        out += [(p, config) for p in turn if in_scope(p, config)][:1]
    return out


def sweep_space() -> list[tuple[Problem, KernelConfig]]:
    """Every tile shape (``tile_shapes``), then ``SWEEP_SAMPLE`` seeded draws of the whole
    space that are not among them."""
    tiles = tile_shapes()
    return tiles + [pick for pick in draw(random.Random(SPACE_SEED), SWEEP_SAMPLE)
                    if pick not in tiles]


SPACE = when_swept(sweep_space)


def _check(problem: Problem, config: KernelConfig, seed: int,
           schedules: tuple[Schedule, ...] = (Schedule.FORWARD,)) -> None:
    source = render(problem, config)
    for schedule in schedules:
        kernel = EmulatorBackend(options=LaunchOptions(schedule=schedule)).load(source)
        run_and_check(kernel, problem, SMALL, seed)


def test_every_excluded_config_names_its_rule() -> None:
    rng = random.Random(SPACE_SEED)
    for problem in PROBLEMS:
        configs = FORWARD.search_space(problem)
        for config in [c for c in configs if not c.extras] + rng.sample(configs, RULE_SAMPLE):
            if not in_scope(problem, config):
                reasons = [space.static_check(problem, config, arch) for arch in ARCHS]
                assert all(reasons), (problem.key(), config.key())
                assert all(len(r or "") > 20 for r in reasons), reasons


def test_space_sample() -> None:
    picks = draw(random.Random(SPACE_SEED + 1), SAMPLE_SIZE)
    for index, (problem, config) in enumerate(picks):
        seed = SPACE_SEED + index
        try:
            _check(problem, config, seed)
        except AssertionError as exc:
            raise AssertionError(
                f"{problem.key()} {config.key()} failed; replay the sample with "
                f"{SEED_VARIABLE}={SPACE_SEED}: {exc}") from exc


@pytest.mark.sweep
@pytest.mark.parametrize(("problem", "config"), SPACE,
                         ids=[f"{p.key()}-{c.key()}" for p, c in SPACE])
def test_every_config_of_the_space(problem: Problem, config: KernelConfig) -> None:
    # Both thread orders: a race between warps shows in one or the other.
    _check(problem, config, SPACE_SEED, tuple(Schedule))
