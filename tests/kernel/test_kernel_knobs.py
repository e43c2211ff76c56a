"""The forward family's structure knobs (swizzle, qregs, pipeline, minblocks, order,
persistent) and the tile shapes beyond the old space (block_n any multiple of 16, block_m
up to 256 with 2 to 16 warps).

Every knob left at its default renders today's kernel; each setting runs in the emulator
against the forward family's float64 reference (runtime.launch), on fresh seeded inputs with
NaN-poisoned outputs, in both thread orders. The default tier runs a seeded sample of
settings (the seed is in the report header; replay with FLASHTUNE_TEST_SEED); ``-m sweep``
runs every value of every knob on every tile of KNOB_TILES where the static rules admit it.
"""

from __future__ import annotations

import random

import pytest
from kernel_space_seed import SEED_VARIABLE, SPACE_SEED
from knob_render import (
    KNOBS,
    SHAPES,
    Knobs,
    check_in_emulator,
    knob_label,
    legal,
    with_knobs,
)

from flashtune.codegen.render import environment
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families import render
from flashtune.families.fwd import FORWARD, space
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions
from flashtune.runtime.launch import verify

pytestmark = pytest.mark.emulator

#: (problem, config): both dtypes, causal and not, a padded head dim with an odd number of
#: 16-byte chunks (72), a 4-chunk swizzle group (96), block_n not a power of two, block_m
#: from 64 to 256 (192: three m16 tiles a warp) on 2 to 16 warps, one to three stages; each
#: knob value is admitted on at least one of them (test_the_sweep_covers_every_knob_value).
KNOB_TILES: tuple[tuple[Problem, KernelConfig], ...] = (
    (Problem(64, DType.FP16, causal=True), KernelConfig(64, 48, 4, 3)),
    (Problem(96, DType.BF16, causal=True), KernelConfig(128, 80, 8, 2)),
    (Problem(72, DType.FP16, causal=False), KernelConfig(64, 16, 2, 1)),
    (Problem(128, DType.BF16, causal=False), KernelConfig(256, 32, 16, 2)),
    (Problem(64, DType.BF16, causal=True), KernelConfig(192, 48, 4, 2)),
)


def single_knob_settings(problem: Problem, config: KernelConfig) -> list[dict[str, int | str]]:
    """Each non-default value of each knob alone, plus as many switched on at once as the
    rules admit; only settings the static rules admit on sm_80 or sm_90."""
    out: list[dict[str, int | str]] = [{name: value} for name, values in KNOBS.items()
                                       for value in values[1:]]
    out.append({"swizzle": 1, "qregs": 1, "pipeline": 1, "persistent": 1,
                "order": "longest" if problem.causal else "plain"})
    out.append({"swizzle": 1, "pipeline": 1, "persistent": 1})
    return [k for k in out if legal(problem, with_knobs(config, k))]


def _check(problem: Problem, config: KernelConfig, settings: Knobs, seed: int) -> None:
    check_in_emulator(problem, with_knobs(config, settings), SHAPES, seed)


def test_default_knobs_render_todays_kernel() -> None:
    problem, config = KNOB_TILES[0]
    defaults = {name: values[0] for name, values in KNOBS.items()}
    assert with_knobs(config, defaults) == config and config.extras == ()
    plain = render(problem, config)
    # The template with no knob variable at all (the kernel before the knobs existed).
    params = {k: v for k, v in FORWARD.render_params(problem, config).items()
              if k not in KNOBS}
    body = environment().get_template(FORWARD.template).render(
        entry=plain.entry, smem_bytes=plain.smem_bytes, threads=config.threads, **params)
    assert plain.code.endswith(body)


def test_smem_bytes_follow_the_layout() -> None:
    problem, config = Problem(128, DType.FP16), KernelConfig(128, 64, 4, 2)
    rows = 128 + 2 * 2 * 64
    assert space.smem_bytes(problem, config) == rows * (128 + 8) * 2
    swizzled = with_knobs(config, {"swizzle": 1})
    assert space.smem_bytes(problem, swizzled) == rows * 128 * 2
    assert render(problem, swizzled).smem_bytes == rows * 128 * 2


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
    source = render(problem, with_knobs(config, {"swizzle": int(swizzle)}))
    kernel = EmulatorBackend(options=LaunchOptions(counters=True)).load(source)
    verdict = verify(kernel, Shape(1, 1, 1, config.block_m, 200), "cpu", seed=SPACE_SEED)
    assert verdict.ok, verdict.message
    counters = kernel.last_counters
    assert counters is not None and counters.ldmatrix_count > 0
    assert counters.ldmatrix_conflicts == 0, counters.conflicting_sites()
    assert counters.cp_async_smem_conflicts == 0, counters.conflicting_sites()


SAMPLE_SIZE = 2


def test_knob_sample() -> None:
    rng = random.Random(SPACE_SEED)
    for index in range(SAMPLE_SIZE):
        problem, config = rng.choice(KNOB_TILES)
        while True:
            settings = {name: rng.choice(values) for name, values in KNOBS.items()}
            if legal(problem, with_knobs(config, settings)):
                break
        try:
            _check(problem, config, settings, SPACE_SEED + index)
        except AssertionError as exc:
            raise AssertionError(
                f"{problem.key()} {config.key()} {settings} failed; replay the sample with "
                f"{SEED_VARIABLE}={SPACE_SEED}: {exc}") from exc


SWEEP = [(p, c, k) for p, c in KNOB_TILES for k in single_knob_settings(p, c)]


def test_the_sweep_covers_every_knob_value() -> None:
    for name, values in KNOBS.items():
        for value in values:
            assert any(k.get(name, values[0]) == value for _, _, k in SWEEP), (name, value)
    for field, values in (("block_m", space.BLOCK_M), ("num_warps", space.NUM_WARPS),
                          ("num_stages", space.NUM_STAGES)):
        assert {getattr(c, field) for _, c in KNOB_TILES} == set(values), field


@pytest.mark.sweep
@pytest.mark.parametrize(("problem", "config", "settings"), SWEEP,
                         ids=[f"{p.key()}-{c.key()}-{knob_label(k)}" for p, c, k in SWEEP])
def test_every_knob_on_every_tile(problem: Problem, config: KernelConfig,
                                  settings: dict[str, int | str]) -> None:
    _check(problem, config, settings, SPACE_SEED)
