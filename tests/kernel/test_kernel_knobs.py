"""The forward template's structure knobs (optional jinja variables: swizzle, qregs,
pipeline, minblocks, order, persistent) and the tile shapes beyond the default space
(block_n any multiple of 16, block_m up to 256 with 2 to 16 warps).

Every knob left unset renders today's kernel; each setting runs in the emulator against the
forward family's float64 reference (runtime.launch), on fresh seeded inputs with
NaN-poisoned outputs, in both thread orders. The default tier runs a seeded sample of
settings (the seed is in the report header; replay with FLASHTUNE_TEST_SEED); ``-m sweep``
runs every knob on every tile of KNOB_TILES.
"""

from __future__ import annotations

import random

import jinja2
import pytest
from kernel_space_seed import SEED_VARIABLE, SPACE_SEED
from knob_render import Knobs, check_in_emulator, knob_label, knob_smem_bytes, render_knobs

from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families import render
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions
from flashtune.runtime.launch import verify

pytestmark = pytest.mark.emulator

#: Every knob's legal values; the first is the default (today's kernel).
KNOBS: dict[str, tuple[int | str, ...]] = {
    "swizzle": (0, 1),
    "qregs": (0, 1),
    "pipeline": (0, 1),
    "minblocks": (0, 1, 2),
    "order": ("plain", "headsinner", "longest"),
    "persistent": (0, 1),
}

#: (problem, config): both dtypes, causal and not, a padded head dim with an odd number of
#: 16-byte chunks (72), a 4-chunk swizzle group (96), block_n not a power of two, block_m
#: from 32 to 256 with 2 to 16 warps, one to three stages.
KNOB_TILES: tuple[tuple[Problem, KernelConfig], ...] = (
    (Problem(64, DType.FP16, causal=True), KernelConfig(64, 48, 4, 2)),
    (Problem(96, DType.BF16, causal=True), KernelConfig(128, 80, 8, 3)),
    (Problem(72, DType.FP16, causal=False), KernelConfig(32, 16, 2, 1)),
    (Problem(128, DType.BF16, causal=False), KernelConfig(256, 32, 16, 2)),
)

#: Off the tile grid in both lengths, GQA, batch 2; Nq > Nk (causal rows that see no key)
#: and Nq < Nk.
SHAPES = [Shape(2, 2, 1, 150, 200), Shape(1, 3, 1, 77, 300), Shape(1, 2, 2, 300, 77)]


def legal(config: KernelConfig, knobs: Knobs) -> bool:
    """The static rules of the knobs (see the template and FwdTraits)."""
    if knobs.get("pipeline") and config.num_stages < 2:
        return False  # Q K^T of the next tile needs its K copied a stage ahead
    return not (knobs.get("persistent") and knobs.get("order") == "headsinner")


def single_knob_settings(config: KernelConfig) -> list[dict[str, int | str]]:
    """Each non-default value of each knob alone, plus everything on at once."""
    out: list[dict[str, int | str]] = [{name: value} for name, values in KNOBS.items()
                                       for value in values[1:]]
    out.append({"swizzle": 1, "qregs": 1, "pipeline": 1, "minblocks": 1, "order": "longest",
                "persistent": 1})
    return [k for k in out if legal(config, k)]


def _check(problem: Problem, config: KernelConfig, knobs: Knobs, seed: int) -> None:
    source = render_knobs(problem, config, knobs)
    # A persistent kernel gets a grid of a third of the query blocks: each block walks 3.
    check_in_emulator(source, SHAPES, seed,
                      grid_blocks_per_x=3 if knobs.get("persistent") else 1)


def test_unset_knobs_render_todays_kernel() -> None:
    problem, config = KNOB_TILES[0]
    plain = render(problem, config).code
    defaults = {name: values[0] for name, values in KNOBS.items()}
    for knobs in ({}, defaults):
        body = render_knobs(problem, config, knobs).code.replace(
            f"__{knob_label(knobs)}(", "(", 1)
        # The rendered body is the tail of render()'s code (after its banner).
        assert plain.endswith(body), knobs


def test_unknown_block_order_is_refused() -> None:
    problem, config = KNOB_TILES[0]
    with pytest.raises(jinja2.UndefinedError):
        render_knobs(problem, config, {"order": "diagonal"})


def test_smem_bytes_follow_the_layout() -> None:
    problem, config = Problem(128, DType.FP16), KernelConfig(128, 64, 4, 2)
    rows = 128 + 2 * 2 * 64
    assert knob_smem_bytes(problem, config, {}) == rows * (128 + 8) * 2
    assert knob_smem_bytes(problem, config, {"swizzle": 1}) == rows * 128 * 2
    assert render_knobs(problem, config, {}).smem_bytes == render(problem, config).smem_bytes


@pytest.mark.parametrize("swizzle", [False, True], ids=["padded", "swizzled"])
@pytest.mark.parametrize(("head_dim", "config"), [
    (128, KernelConfig(64, 32, 4, 2)), (96, KernelConfig(64, 48, 4, 2)),
    (72, KernelConfig(64, 32, 2, 1)), (32, KernelConfig(128, 128, 8, 2)),
])
def test_shared_memory_layouts_are_bank_conflict_free(head_dim: int, config: KernelConfig,
                                                      swizzle: bool) -> None:
    # ldmatrix phases (8 rows of one chunk column) and cp.async phases (8 lanes of the copy
    # plan) each hit 8 distinct bank groups: the emulator counts no extra wavefront.
    problem = Problem(head_dim, DType.FP16)
    source = render_knobs(problem, config, {"swizzle": int(swizzle)})
    kernel = EmulatorBackend(options=LaunchOptions(counters=True)).load(source)
    verdict = verify(kernel, Shape(1, 1, 1, config.block_m, 200), "cpu", seed=SPACE_SEED)
    assert verdict.ok, verdict.message
    counters = kernel.last_counters
    assert counters is not None and counters.ldmatrix_count > 0
    assert counters.ldmatrix_conflicts == 0, counters.conflicting_sites()
    assert counters.cp_async_smem_conflicts == 0, counters.conflicting_sites()


SAMPLE_SIZE = 3


def test_knob_sample() -> None:
    rng = random.Random(SPACE_SEED)
    for index in range(SAMPLE_SIZE):
        problem, config = rng.choice(KNOB_TILES)
        while True:
            knobs = {name: rng.choice(values) for name, values in KNOBS.items()}
            if legal(config, knobs):
                break
        try:
            _check(problem, config, knobs, SPACE_SEED + index)
        except AssertionError as exc:
            raise AssertionError(
                f"{problem.key()} {config.key()} {knobs} failed; replay the sample with "
                f"{SEED_VARIABLE}={SPACE_SEED}: {exc}") from exc


SWEEP = [(p, c, k) for p, c in KNOB_TILES for k in single_knob_settings(c)]


@pytest.mark.sweep
@pytest.mark.parametrize(("problem", "config", "knobs"), SWEEP,
                         ids=[f"{p.key()}-{c.key()}-{knob_label(k)}" for p, c, k in SWEEP])
def test_every_knob_on_every_tile(problem: Problem, config: KernelConfig,
                                  knobs: dict[str, int | str]) -> None:
    _check(problem, config, knobs, SPACE_SEED)
