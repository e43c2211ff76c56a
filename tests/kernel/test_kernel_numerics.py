"""The forward kernel in the CPU emulator against a float64 reference.

Each launch uses fresh random inputs (the seed is in the failure message) and NaN-poisoned
outputs. The default tier covers every feature once: both dtypes, causal with Nq < Nk and
Nq > Nk (rows that see no key), GQA and MQA, batch > 1, lengths that are not multiples of
the tiles, a padded head dim, strided inputs sliced from a packed qkv tensor, a custom
scale, scores of magnitude ~1e4, one to eight warps and one to four stages, in both
emulator schedules. The default run checks one seeded entry of the default table per arch
class and causal mode (its dtype and shape seeded too, by FLASHTUNE_TEST_SEED), the other
entries under ``-m sweep``; ``-m sweep`` also runs every head dim (padded ones too) with both
dtypes on the default configs of each arch class, and more lengths.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
from fwd_reference import Case, run_and_check
from sampling import seeded_part

from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.families import render
from flashtune.families.fwd import defaults
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions, Schedule

pytestmark = pytest.mark.emulator

BOTH = (Schedule.FORWARD, Schedule.REVERSE)
FWD = (Schedule.FORWARD,)

#: (problem, config, case, schedules): each row exercises something the others do not.
CI_CASES: tuple[tuple[Problem, KernelConfig, Case, tuple[Schedule, ...]], ...] = (
    # FA2's d128 tile, causal Nq == Nk, GQA 4:2, batch 2, lengths off the tile grid.
    (Problem(128, DType.FP16, causal=True), KernelConfig(128, 64, 4, 2),
     Case(2, 300, 300, 4, 2), BOTH),
    # Causal with Nq > Nk: the first rows see no key (O = 0, LSE = +inf); padded head dim.
    (Problem(72, DType.BF16, causal=True), KernelConfig(64, 64, 4, 1),
     Case(1, 300, 77, 2, 1), BOTH),
    # Causal with Nq < Nk (bottom-right alignment), MQA, three stages.
    (Problem(64, DType.FP16, causal=True), KernelConfig(64, 32, 4, 3),
     Case(1, 77, 1000, 3, 1), FWD),
    # Strided q/k/v sliced from a packed qkv tensor, custom scale, eight warps.
    (Problem(32, DType.BF16), KernelConfig(128, 32, 8, 2),
     Case(2, 128, 128, 3, 3, scale=0.3, packed_qkv=True), FWD),
    # Widest head dim, four stages, a single query row against many keys.
    (Problem(256, DType.FP16), KernelConfig(64, 32, 4, 4), Case(1, 1, 300, 2, 2), FWD),
    # Scores of magnitude ~1e4 (the online-softmax rescale must stay finite).
    (Problem(128, DType.BF16), KernelConfig(64, 64, 4, 2),
     Case(1, 77, 300, 2, 1, magnitude=100.0), FWD),
    # One warp, one key, seven queries, causal: only the last query row sees the key.
    (Problem(80, DType.FP16, causal=True), KernelConfig(16, 16, 1, 2), Case(2, 7, 1, 2, 2),
     BOTH),
)


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _check(problem: Problem, config: KernelConfig, case: Case,
           schedules: tuple[Schedule, ...]) -> None:
    source = render(problem, config)
    for schedule in schedules:
        kernel = EmulatorBackend(options=LaunchOptions(schedule=schedule)).load(source)
        run_and_check(kernel, problem, case, _fresh_seed())


@pytest.mark.parametrize(("problem", "config", "case", "schedules"), CI_CASES,
                         ids=[f"{p.key()}-{c.key()}-{x.label()}" for p, c, x, _ in CI_CASES])
def test_forward_matches_reference(problem: Problem, config: KernelConfig, case: Case,
                                   schedules: tuple[Schedule, ...]) -> None:
    _check(problem, config, case, schedules)


#: Head dims of the slow tier: every compiled size plus padded ones (72 -> 96, 80 -> 96).
HEAD_DIMS = (32, 64, 72, 80, 96, 128, 160, 192, 224, 256)
LENGTHS = (1, 7, 64, 77, 128, 300, 1000)
#: One representative arch per default-table class.
CLASS_ARCHS = tuple(defaults.REFERENCE_ARCH.values())


def _slow_case(index: int) -> Case:
    """A deterministic spread of (Nq, Nk), head grouping and batch over the index."""
    pairs = [(nq, nk) for nq, nk in itertools.product(LENGTHS, LENGTHS) if nq * nk <= 300_000]
    nq, nk = pairs[(index * 7) % len(pairs)]
    heads_kv = 1 + index % 2
    return Case(batch=1 + (index // 2) % 2, seqlen_q=nq, seqlen_k=nk,
                heads_q=heads_kv * (1 + index % 3), heads_kv=heads_kv)


SLOW = [(Problem(hd, dt, causal=c), arch)
        for arch in CLASS_ARCHS for hd, dt, c in itertools.product(HEAD_DIMS, DType, (False, True))]
_RNG = random.Random(int(os.environ["FLASHTUNE_TEST_SEED"]))
#: One case per default-table entry: its head dim, a seeded dtype, a seeded slow-tier shape.
#: Grouped by (arch class, causal): the kinds the default run keeps one of each.
DEFAULTS = sorted([(Problem(e.head_dim, _RNG.choice(list(DType)), causal=e.causal),
                    defaults.REFERENCE_ARCH[e.arch_class], _RNG.randrange(len(SLOW)))
                   for e in defaults.DEFAULT_TABLE], key=lambda d: (d[1], d[0].causal))
_KINDS = sorted({(a, p.causal) for p, a, _ in DEFAULTS})


def _one_per_kind() -> list[object]:
    """A seeded entry of each (arch class, causal) in the default run; every one under sweep."""
    return [case for arch, causal in _KINDS
            for case in seeded_part([d for d in DEFAULTS if (d[1], d[0].causal) == (arch, causal)],
                                    1, f"defaults-{arch}-{causal}", several=True)]


@pytest.mark.parametrize(("problem", "arch", "index"), _one_per_kind(),
                         ids=[f"{p.key()}-{a}" for p, a, _ in DEFAULTS])
def test_every_default_config(problem: Problem, arch: str, index: int) -> None:
    config = defaults.default_config(problem, get_arch(arch))
    _check(problem, config, _slow_case(index), FWD)


@pytest.mark.sweep
@pytest.mark.parametrize(("problem", "arch"), SLOW, ids=[f"{p.key()}-{a}" for p, a in SLOW])
def test_default_configs_every_head_dim(problem: Problem, arch: str) -> None:
    config = defaults.default_config(problem, get_arch(arch))
    index = SLOW.index((problem, arch))
    _check(problem, config, _slow_case(index), FWD)


@pytest.mark.sweep
@pytest.mark.parametrize("nq", LENGTHS)
@pytest.mark.parametrize("nk", LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
def test_every_length_pair(nq: int, nk: int, causal: bool) -> None:
    problem = Problem(96, DType.FP16, causal=causal)
    _check(problem, KernelConfig(64, 32, 4, 2), Case(2, nq, nk, 4, 2), BOTH)
