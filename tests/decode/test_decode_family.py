"""The decode and combine kernel families on their own: split ranges and the split-count
heuristic, space, defaults and NVRTC compilation, emulator numerics of each kernel against
float64 (both thread schedules, NaN-poisoned outputs) over a seeded sample of the grid, the
kernel's refusal of bad lengths and pages, and the emulator's byte counters (each K/V element
read once per group). The whole grid and both spaces run behind the sweep marker."""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch
from decode_cases import GRID, GridCase, inputs_of, problem_of, sample
from sampling import seeded_part

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families.base import Inputs
from flashtune.families.combine import COMBINE
from flashtune.families.decode import DECODE
from flashtune.families.decode.splits import (
    MAX_SPLITS,
    SPLIT_ALIGN,
    heuristic_splits,
    split_range,
)
from flashtune.families.decode.status import BEYOND_CAPACITY, NEGATIVE_LENGTH, PAGE_INDEX
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions, Schedule
from flashtune.runtime.launch import PreparedLaunch, prepare

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
ARCHS = ("sm_80", "sm_86", "sm_90")


def _default(problem: Problem) -> KernelConfig:
    return families.of(problem).default_config(problem, get_arch("sm_90"))


def _run(problem: Problem, config: KernelConfig, shape: Shape, inputs: Inputs,
         schedule: Schedule = Schedule.FORWARD, counters: bool = False) -> PreparedLaunch:
    options = LaunchOptions(schedule=schedule, counters=counters)
    kernel = EmulatorBackend(options=options).load(families.render(problem, config))
    launch = prepare(kernel, shape, "cpu", inputs=inputs, poison=True)
    launch.run()
    return launch


# ------------------------------------------------------------------------- splits


def test_split_ranges_partition_every_sequence_in_aligned_pieces() -> None:
    rng = random.Random(SEED)
    for _ in range(200):
        total, splits = rng.randrange(0, 5000), rng.randrange(1, MAX_SPLITS + 1)
        ranges = [split_range(total, splits, s) for s in range(splits)]
        covered = [k for begin, end in ranges for k in range(begin, end)]
        assert covered == list(range(total)), (total, splits)
        assert all(begin % SPLIT_ALIGN == 0 for begin, end in ranges if end > begin)


def test_heuristic_follows_the_wave_efficiency_rule() -> None:
    # A grid that fills 80% of the SMs is not split.
    assert heuristic_splits(106, 132, 1000) == 1
    # 8 blocks on 132 SMs over 64 key blocks: 16 splits (128 blocks, 97% of one wave) is the
    # smallest eligible count within 85% of the best efficiency (97%; 33 splits would fill
    # 2 waves exactly but keeps 2 key blocks per split, as 32 does, so it is not eligible).
    assert heuristic_splits(8, 132, 64) == 16
    # Never more splits than key blocks, SMs or MAX_SPLITS.
    assert heuristic_splits(1, 132, 3) <= 3
    assert heuristic_splits(1, 1000, 10**6) <= MAX_SPLITS
    assert heuristic_splits(1, 4, 10**6) <= 4


# ------------------------------------------------------------------------- space, compile


def test_space_defaults_and_rules() -> None:
    for op in ("decode", "combine"):
        for head_dim in (32, 64, 72, 128, 256):
            for arch in ARCHS:
                problem = Problem(head_dim, DType.BF16, causal=op == "decode", op=op)
                family = families.of(problem)
                spec = get_arch(arch)
                default = family.default_config(problem, spec)
                assert default in family.candidates(problem, spec), (op, head_dim, arch)
                assert family.default_reason(problem, spec)
    problem = Problem(64, DType.FP16, op="decode")
    fixed = KernelConfig(64, 64, 4, 2, extras={"splits": 8})
    assert fixed in DECODE.candidates(problem, get_arch("sm_90"))
    assert DECODE.config(DECODE.point(fixed)) == fixed
    default = DECODE.default_config(problem, get_arch("sm_90"))
    assert DECODE.point(default)["splits"] == 0 and not default.extras  # the heuristic
    for bad in (0, 3):
        reason = DECODE.static_check(problem, KernelConfig(64, 64, 4, 2, extras={"splits": bad}),
                                     get_arch("sm_90"))
        assert reason is not None and "not a split count" in reason
    inputs = DECODE.random_inputs(problem, Shape(2, 8, 2, 1, 100), "cpu", seed=SEED)
    assert DECODE.bind(problem, fixed, inputs).scalars["num_splits"] == 8
    assert DECODE.bind(problem, default, inputs) is inputs
    huge = KernelConfig(128, 128, 4, 3)
    reason = DECODE.static_check(Problem(256, DType.FP16, op="decode"), huge,
                                 get_arch("sm_86"))
    assert reason is not None and "shared memory" in reason


#: Each family's default on one arch drawn with the run's seed (the other under -m sweep).
DEFAULT_COMPILES = [case for op in ("decode", "combine")
                    for case in seeded_part([(arch, op) for arch in ("sm_80", "sm_90")], 1,
                                            f"family-nvrtc-{op}", several=True)]


@pytest.mark.parametrize("arch, op", DEFAULT_COMPILES)
def test_defaults_compile_with_nvrtc_without_spills(arch: str, op: str) -> None:
    from flashtune.toolchain.compiler import compile_source

    problem = Problem(128, DType.BF16, causal=op == "decode", op=op)
    kernel = compile_source(families.render(problem, _default(problem)), arch)
    assert kernel.resources.spill_bytes == 0 and kernel.resources.registers > 0


def _tile_jobs() -> list[tuple[Problem, KernelConfig, str]]:
    """Every tile of the decode space (the split-count knob changes no code) that passes the
    static rules, for head dims 64 and 128, both dtypes and masks, on sm_80 and sm_90."""
    jobs = []
    for head_dim, dtype, causal in itertools.product((64, 128), DType, (False, True)):
        problem = Problem(head_dim, dtype, causal=causal, op="decode")
        for arch in ("sm_80", "sm_90"):
            jobs += [(problem, c, arch) for c in DECODE.candidates(problem, get_arch(arch))
                     if not c.extras]
    return jobs


def _compile(jobs: list[tuple[Problem, KernelConfig, str]]) -> None:
    from flashtune.toolchain.compiler import compile_pairs

    results = compile_pairs([(families.render(p, c), arch) for p, c, arch in jobs])
    failed = [f"{r.source.entry} {r.arch}: {r.failure.message}" for r in results
              if r.failure is not None]
    assert not failed, f"FLASHTUNE_TEST_SEED={SEED}\n" + "\n".join(failed)
    assert all(r.unwrap().resources.registers > 0 for r in results)


def test_a_sample_of_the_decode_tiles_compiles_with_nvrtc() -> None:
    """One tile of the space drawn with the run's seed (every tile: -m sweep)."""
    _compile(random.Random(SEED).sample(_tile_jobs(), 1))


@pytest.mark.sweep
def test_every_decode_tile_compiles_with_nvrtc() -> None:
    _compile(_tile_jobs())


# ------------------------------------------------------------------------- numerics


def _grid_config(case: GridCase) -> tuple[Problem, KernelConfig]:
    """Causal cases run the default of d64 fp16; the others a config of the space drawn
    with the run's seed, at a head dim and dtype drawn too."""
    if case.causal:
        problem = problem_of(case)
        return problem, _default(problem)
    rng = random.Random(SEED)
    problem = problem_of(case, rng.choice((32, 64, 72, 128)), rng.choice(list(DType)))
    return problem, rng.choice(DECODE.candidates(problem, get_arch("sm_90")))


def _check_case(case: GridCase) -> None:
    problem, config = _grid_config(case)
    for schedule in Schedule:
        inputs = inputs_of(case, problem)
        launch = _run(problem, config, case.shape, inputs, schedule)
        verdict = launch.verdict()
        assert verdict.ok, f"{config.key()} {schedule.value}: {verdict.message}"


@pytest.mark.emulator
@pytest.mark.parametrize("case", sample(SEED, 6), ids=lambda c: c.key)
def test_decode_matches_float64_on_a_sample_of_the_grid(case: GridCase) -> None:
    _check_case(case)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("case", GRID, ids=lambda c: c.key)
def test_decode_whole_grid(case: GridCase) -> None:
    _check_case(case)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("config", [c for c in DECODE.candidates(
    Problem(64, DType.BF16, op="decode"), get_arch("sm_90")) if not c.extras],
    ids=KernelConfig.key)
def test_decode_whole_space(config: KernelConfig) -> None:
    """Every tile of the space (the split-count knob changes no code: the grid covers it)."""
    case = GridCase(16, 5, (8, 2), True, True, 3, seed=SEED)
    problem = Problem(64, DType.BF16, causal=True, op="decode")
    verdict = _run(problem, config, case.shape, inputs_of(case, problem)).verdict()
    assert verdict.ok, verdict.message


@pytest.mark.emulator
@pytest.mark.parametrize("splits", [1, 3, 33, MAX_SPLITS])
def test_combine_matches_float64(splits: int) -> None:
    problem = Problem(64, DType.BF16, op="combine")
    shape = Shape(2, 3, 3, 5, 5)
    for schedule in Schedule:
        inputs = COMBINE.random_inputs(problem, shape, "cpu", seed=SEED + splits,
                                       num_splits=splits)
        launch = _run(problem, _default(problem), shape, inputs, schedule)
        verdict = launch.verdict()
        assert verdict.ok, verdict.message
        assert torch.isposinf(launch.outputs["lse"][0, 0]).all()  # every split empty
        assert (launch.outputs["o"][0, :, 0] == 0).all()


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("config", COMBINE.candidates(Problem(128, DType.FP16, op="combine"),
                                                      get_arch("sm_90")), ids=KernelConfig.key)
def test_combine_whole_space(config: KernelConfig) -> None:
    problem = Problem(128, DType.FP16, op="combine")
    shape = Shape(3, 4, 4, 7, 7)
    inputs = COMBINE.random_inputs(problem, shape, "cpu", seed=SEED, num_splits=70)
    verdict = _run(problem, config, shape, inputs).verdict()
    assert verdict.ok, verdict.message


@pytest.mark.emulator
def test_a_wrong_partial_result_or_cache_is_caught() -> None:
    case = GridCase(4, 3, (8, 2), True, True, 3, seed=SEED)
    problem = problem_of(case)
    launch = _run(problem, _default(problem), case.shape, inputs_of(case, problem))
    assert launch.verdict().ok
    launch.outputs["o_part"][0, 1, 5, 2, 7] += 0.05
    assert "partial O" in launch.verdict().message
    launch.outputs["o_part"][0, 1, 5, 2, 7] -= 0.05
    cache = launch.outputs["k_cache"].view(-1)
    cache[int(torch.nonzero(~torch.isnan(cache))[0])] += 1  # a cached row overwritten
    assert "k_cache: 1 elements differ" in launch.verdict().message


# ------------------------------------------------------------------------- bad inputs


def _hostile(edit: str) -> tuple[PreparedLaunch, Inputs]:
    case = GridCase(16, 2, (4, 1), True, True, 4, seed=SEED)
    problem = problem_of(case)
    inputs = inputs_of(case, problem)
    t = dict(inputs.tensors)
    if edit == "page":
        table = t["block_table"].clone()
        table[1, 2] = t["k_cache"].shape[0]  # one past the last page; sequence 1 (full
        # room) uses slot 2
        t["block_table"] = table
    elif edit == "negative_page":
        table = t["block_table"].clone()
        table[2, 0] = -5
        t["block_table"] = table
    else:
        lengths = t["cache_seqlens"].clone()
        lengths[2] = -1 if edit == "negative" else 303  # room: 304 - 2 new rows
        t["cache_seqlens"] = lengths
    bad = Inputs(t, inputs.scalars)
    return _run(problem, _default(problem), case.shape, bad), bad


@pytest.mark.emulator
@pytest.mark.parametrize("edit, code, batch", [("page", PAGE_INDEX, 1),
                                               ("negative_page", PAGE_INDEX, 2),
                                               ("negative", NEGATIVE_LENGTH, 2),
                                               ("beyond", BEYOND_CAPACITY, 2)])
def test_bad_pages_and_lengths_are_refused_and_never_followed(edit: str, code: int,
                                                              batch: int) -> None:
    launch, bad = _hostile(edit)
    assert launch.outputs["status"][:2].tolist() == [code, batch]
    o_part, lse_part = launch.outputs["o_part"], launch.outputs["lse_part"]
    # The refused sequence's blocks write NaN (all of them for a bad length, the splits
    # that use the bad slot for a bad page); the other sequences are unaffected.
    assert torch.isnan(lse_part[:, batch]).any()
    if edit in ("negative", "beyond"):
        assert torch.isnan(o_part[:, batch]).all()
    good = [b for b in range(3) if b != batch]
    assert not torch.isnan(o_part[:, good]).any()
    # No cached row was overwritten, and at most the accepted sequences' new rows were
    # written (into rows that held NaN: past each length, never a spare page's).
    before, after = bad.tensors["k_cache_before"], launch.outputs["k_cache"]
    live = ~torch.isnan(before)
    assert (after[live] == before[live]).all()
    assert int((~torch.isnan(after) & ~live).sum()) <= 3 * 2 * 64  # 3 seqs, 2 rows, dim 64


# ------------------------------------------------------------------------- counters


@pytest.mark.emulator
@pytest.mark.parametrize("page_size, heads, seqlen_q, splits", [
    (16, (8, 2), 2, 3), (None, (4, 1), 1, 1), (1, (8, 1), 4, 7)])
def test_each_kv_element_is_read_once_per_group(page_size: int | None,
                                                heads: tuple[int, int], seqlen_q: int,
                                                splits: int) -> None:
    """cp.async bytes of a call = each sequence's K and V rows once per kv head, plus the
    group's Q rows once per non-empty split (nothing is read twice; zero-fills read
    nothing). The rows of a group fit one block (group x seqlen_q <= block_m)."""
    case = GridCase(page_size, seqlen_q, heads, True, True, splits, seed=SEED)
    problem = problem_of(case, 128, DType.BF16)
    config = KernelConfig(64, 64, 4, 2)
    kernel = EmulatorBackend(options=LaunchOptions(counters=True)).load(
        families.render(problem, config))
    launch = prepare(kernel, case.shape, "cpu", inputs=inputs_of(case, problem), poison=True)
    launch.run()
    got = kernel.last_counters
    assert got is not None and launch.verdict().ok
    heads_q, heads_kv = heads
    dim, elem = 128, 2
    totals = [n + case.decode_case().seqlen_new for n in case.decode_case().cache_seqlens]
    nonempty = [sum(1 for s in range(splits) if split_range(t, splits, s)[0] <
                    split_range(t, splits, s)[1]) for t in totals]
    kv_bytes = 2 * heads_kv * sum(totals) * dim * elem
    q_bytes = heads_q * seqlen_q * dim * elem * sum(nonempty)
    assert got.cp_async_bytes == kv_bytes + q_bytes
    assert got.coalescing_efficiency == 1.0
