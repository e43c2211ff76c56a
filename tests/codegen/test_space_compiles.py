"""Configs of the forward space that pass static_check compile for sm_80 and sm_90 through
NVRTC, with their resources read back (the compiles run in a process pool and land in the
session's kernel cache, which later tests reuse). The default run compiles a sample seeded
by FLASHTUNE_TEST_SEED (printed in the report header) that keeps every problem on every
arch; ``-m sweep`` compiles every tile shape (knobs at their defaults) and a seeded sample of
configs with knobs per problem. The default configs' spill check takes each head dim on each
arch with a seeded dtype and causal mode (every problem: ``-m sweep``)."""

from __future__ import annotations

import itertools
import os
import random

import pytest

from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, KernelSource, Problem
from flashtune.families import render
from flashtune.families.fwd import FORWARD, space
from flashtune.families.fwd.defaults import default_config
from flashtune.perf.model.default_rule import spill_rule_problems
from flashtune.perf.sass.disasm import sass_listing
from flashtune.perf.sass.loops import main_loops
from flashtune.toolchain.compiler import CompileResult, compile_pairs, compile_source

#: One xdist worker runs the module, so its compiles (the module fixture) are made once, not
#: once on each worker at the same time.
pytestmark = pytest.mark.xdist_group("space_compiles")

ARCHS = ("sm_80", "sm_90")
SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
#: Compiles per (problem, arch) in the default run.
PER_PROBLEM_ARCH = 1
PROBLEMS = [Problem(hd, dt, causal=c)
            for hd, dt, c in itertools.product((64, 128), DType, (False, True))]


#: Configs with structure knobs each problem draws (seeded) for ``-m sweep``; those the
#: rules exclude on both archs are dropped.
KNOB_SAMPLE = 24


def _all_pairs() -> list[tuple[Problem, KernelConfig, str]]:
    """Every tile shape with the knobs at their defaults and KNOB_SAMPLE draws of configs
    with knobs per problem (the space has 10^5 configs a problem), on each arch that admits
    them (nothing rendered yet: rendering every one costs more than the sample's compiles)."""
    pairs = []
    rng = random.Random(SEED)
    for problem in PROBLEMS:
        configs = FORWARD.search_space(problem)
        knobbed = [c for c in configs if c.extras]
        picks = [c for c in configs if not c.extras]
        while len(picks) < len(configs) - len(knobbed) + KNOB_SAMPLE:
            picks.append(rng.choice(knobbed))
        for config in picks:
            pairs += [(problem, config, a) for a in ARCHS
                      if space.static_check(problem, config, get_arch(a)) is None]
    return pairs


def _jobs(request: pytest.FixtureRequest) -> list[tuple[KernelSource, str]]:
    """Every job under ``-m sweep``; else a seeded sample of each (problem, arch)."""
    pairs = _all_pairs()
    if "sweep" not in (request.config.getoption("markexpr", "") or ""):
        rng = random.Random(SEED)
        sample = []
        for problem, arch in itertools.product(PROBLEMS, ARCHS):
            mine = [p for p in pairs if p[0] == problem and p[2] == arch]
            sample += rng.sample(mine, min(PER_PROBLEM_ARCH, len(mine)))
        pairs = sample
    sources: dict[tuple[Problem, KernelConfig], KernelSource] = {}
    return [(sources.setdefault((p, c), render(p, c)), a) for p, c, a in pairs]


@pytest.fixture(scope="module")
def jobs(request: pytest.FixtureRequest) -> list[tuple[KernelSource, str]]:
    return _jobs(request)


@pytest.fixture(scope="module")
def results(jobs: list[tuple[KernelSource, str]]) -> list[CompileResult]:
    return compile_pairs(jobs)


def test_every_candidate_compiles(results: list[CompileResult],
                                  jobs: list[tuple[KernelSource, str]]) -> None:
    failed = [f"{r.source.entry} {r.arch}: {r.failure.message}"
              for r in results if r.failure is not None]
    assert not failed, f"FLASHTUNE_TEST_SEED={SEED}\n" + "\n".join(failed)
    assert len(results) == len(jobs)
    for problem in PROBLEMS:  # each problem keeps a usable space on each arch
        for arch in ARCHS:
            assert any(r.source.problem == problem and r.arch == arch for r in results)


def test_resources_are_read_back(results: list[CompileResult]) -> None:
    for r in results:
        kernel = r.unwrap()
        res = kernel.resources
        spec = get_arch(r.arch)
        where = f"{r.source.entry} on {r.arch}"
        assert kernel.arch == r.arch and kernel.entry == r.source.entry, where
        assert kernel.cubin[:4] == b"\x7fELF", where
        assert 0 < res.registers <= spec.max_regs_per_thread, where
        # __launch_bounds__(threads) must leave every thread of a block its registers
        assert res.registers * r.source.threads <= spec.regs_per_sm, where
        assert res.dynamic_smem == space.smem_bytes(r.source.problem, r.source.config), where
        assert res.smem_bytes <= spec.max_smem_per_block, where
        assert res.max_threads == r.source.config.threads, where
        assert res.barriers >= 1, where  # the kernel synchronises its block


def test_binaries_differ_per_arch_and_config(results: list[CompileResult]) -> None:
    keys = [r.unwrap().compile_key for r in results]
    assert len(set(keys)) == len(keys)
    cubins = {r.unwrap().cubin for r in results}
    assert len(cubins) == len(results)


def _spill_breaches(problems: list[Problem], arch: str) -> list[str]:
    """How the default configs of ``problems`` on ``arch`` break the spill rule."""
    breaches = []
    spec = get_arch(arch)
    for problem in problems:
        config = default_config(problem, spec)
        assert space.static_check(problem, config, spec) is None
        source = render(problem, config)
        kernel = compile_source(source, arch)
        if kernel.resources.spill_bytes or kernel.resources.stack_frame:
            loops = main_loops(sass_listing(kernel.cubin, arch).function(source.entry))
            breaches += [f"{problem.key()} {config.key()} {arch}: {why}"
                         for why in spill_rule_problems(loops, arch)]
    return breaches


def test_default_configs_spill_only_as_the_spill_rule_allows() -> None:
    """A default may spill (FA2's own d128 tile does), but no local access may sit in a
    tensor-core chain and each main loop makes at most MAX_LOCAL_ACCESSES per iteration.
    Each head dim on each arch, with a seeded dtype and causal mode (every problem in
    the sweep; tests/kernel/test_kernel_default_resources.py checks the whole table)."""
    rng = random.Random(f"{SEED}-spill")
    breaches = []
    for head_dim, arch in itertools.product((64, 128), ARCHS):
        mine = [p for p in PROBLEMS if p.head_dim == head_dim]
        breaches += _spill_breaches([rng.choice(mine)], arch)
    assert not breaches, "\n".join(breaches)


@pytest.mark.sweep
def test_default_configs_of_every_problem_spill_only_as_the_spill_rule_allows() -> None:
    breaches = [b for arch in ARCHS for b in _spill_breaches(PROBLEMS, arch)]
    assert not breaches, "\n".join(breaches)
