"""Every config of the search space runs correctly in the emulator, or a rule excludes it.

The space is that of ``codegen.space.search_space`` for head dims 64 and 128, both dtypes,
causal and not; a config is in scope when ``space.static_check`` admits it for sm_80 or
sm_90 (configs it rejects are excluded by a rule that names why). ``pytest -m sweep`` runs
all of them in both emulator thread orders; the default tier runs a sample that changes from
run to run, seeded (the seed is printed in the report header and in failure messages; replay
with FLASHTUNE_TEST_SEED).
"""

from __future__ import annotations

import itertools
import random

import pytest
from fwd_reference import Case, run_and_check
from kernel_space_seed import SEED_VARIABLE, SPACE_SEED

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
SAMPLE_SIZE = 4


def in_scope(problem: Problem, config: KernelConfig) -> bool:
    return any(space.static_check(problem, config, arch) is None for arch in ARCHS)


SPACE = [(p, c) for p in PROBLEMS for c in FORWARD.search_space(p) if in_scope(p, c)]


def _check(problem: Problem, config: KernelConfig, seed: int,
           schedules: tuple[Schedule, ...] = (Schedule.FORWARD,)) -> None:
    source = render(problem, config)
    for schedule in schedules:
        kernel = EmulatorBackend(options=LaunchOptions(schedule=schedule)).load(source)
        run_and_check(kernel, problem, SMALL, seed)


def test_every_excluded_config_names_its_rule() -> None:
    for problem in PROBLEMS:
        for config in FORWARD.search_space(problem):
            if not in_scope(problem, config):
                reasons = [space.static_check(problem, config, arch) for arch in ARCHS]
                assert all(reasons), (problem.key(), config.key())
                assert all(len(r or "") > 20 for r in reasons), reasons


def test_space_sample() -> None:
    rng = random.Random(SPACE_SEED)
    picks = rng.sample(SPACE, SAMPLE_SIZE)
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
