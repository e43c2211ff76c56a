"""The forward family's declared space: the structure knobs, their static rules (each with a
reason), the canonical config of a point (knobs at their defaults left out), the space's
size and the persistent kernel's launch grid. No kernel runs here (see tests/kernel)."""

from __future__ import annotations

import pytest
import torch

from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families.fwd import FORWARD, defaults, knobs, space
from flashtune.families.launch_args import persistent_grid

SM80, SM90 = get_arch("sm_80"), get_arch("sm_90")
D128 = Problem(128, DType.BF16)
D64_CAUSAL = Problem(64, DType.FP16, causal=True)


def test_points_and_configs_round_trip_with_defaults_left_out() -> None:
    config = KernelConfig(128, 32, 4, 2)
    point = FORWARD.point(config)
    assert point == {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 2,
                     "swizzle": 0, "qregs": 0, "pipeline": 0, "minblocks": 0,
                     "order": "plain", "persistent": 0}
    FORWARD.space(D128).check(point)
    assert FORWARD.config(point) == config and FORWARD.config(point).key() == "m128_n32_w4_s2"
    tuned = FORWARD.config({**point, "swizzle": 1, "order": "headsinner"})
    assert tuned.key() == "m128_n32_w4_s2_order-headsinner_swizzle-1"
    assert FORWARD.config(FORWARD.point(tuned)) == tuned
    assert KernelConfig.from_key(tuned.key()) == tuned


def test_every_default_config_is_a_point_without_knobs() -> None:
    legal = set(FORWARD.search_space(D128))
    for entry in defaults.DEFAULT_TABLE:
        assert entry.config.extras == () and entry.config in legal, entry


def test_template_params_pass_every_knob() -> None:
    config = KernelConfig(128, 32, 4, 2, extras={"pipeline": 1, "minblocks": 3})
    params = FORWARD.template_params(D128, config)
    assert {k: params[k] for k in knobs.DEFAULTS} == {**knobs.DEFAULTS, "pipeline": 1,
                                                       "minblocks": 3}
    assert "__launch_bounds__(128, 3)" in FORWARD.render(D128, config).code
    assert "__launch_bounds__(128)\n" in FORWARD.render(D128, KernelConfig(128, 32, 4, 2)).code


@pytest.mark.parametrize(("problem", "extras", "stages", "phrase"), [
    (D128, {"pipeline": 1}, 1, "num_stages >= 2"),
    (D64_CAUSAL, {"persistent": 1, "order": "headsinner"}, 2, "walks the query blocks of one"),
    (D128, {"order": "longest"}, 2, "without a causal mask"),
    (D128, {"order": "diagonal"}, 2, "order='diagonal' is outside the search space"),
    (D128, {"swizzle": 2}, 2, "swizzle=2 is outside"),
    (D128, {"minblocks": 2}, 2, "the same kernel as minblocks=0"),
    (D128, {"qregs": 1, "pipeline": 1}, 2, "held fragments need 256 registers"),
])
def test_rules_name_their_reason(problem: Problem, extras: dict[str, int | str], stages: int,
                                 phrase: str) -> None:
    config = KernelConfig(128, 32, 4, stages, extras=extras)
    for arch in (SM80, SM90):
        reason = FORWARD.static_check(problem, config, arch)
        assert reason is not None and phrase in reason, reason


def test_register_cap_follows_min_blocks_and_threads() -> None:
    # 4 warps: 3 blocks cap at 65536 / 384 = 170 -> 168 registers (budget 168 * 192 / 255)
    config = KernelConfig(64, 64, 4, 1, extras={"minblocks": 3})
    assert space.register_cap(config, SM90, 3) == 168
    assert space.register_budget(config, SM90, 3) == 126
    assert FORWARD.static_check(D128, config, SM90) is None  # 16 rows: 96 held
    too_big = KernelConfig(64, 128, 4, 1, extras={"minblocks": 3})  # 128 held
    assert "over the 126" in (FORWARD.static_check(D128, too_big, SM90) or "")
    # 16 warps: the register file gives each thread 128 whatever minblocks says
    wide = KernelConfig(256, 32, 16, 2)
    assert space.register_cap(wide, SM90, 0) == 128
    assert FORWARD.static_check(D128, wide, SM90) is None
    # two 8-warp blocks of 129 KB cannot be resident together
    crowded = KernelConfig(128, 128, 8, 3, extras={"minblocks": 2})
    assert "holds only" in (FORWARD.static_check(Problem(64, DType.FP16), crowded, SM90) or "")


def test_swizzle_drops_the_row_padding_from_shared_memory() -> None:
    config = KernelConfig(128, 128, 4, 3)
    padded = space.smem_bytes(D128, config)
    swizzled = space.smem_bytes(D128, KernelConfig(128, 128, 4, 3, extras={"swizzle": 1}))
    assert padded == (128 + 6 * 128) * 136 * 2 and swizzled == (128 + 6 * 128) * 128 * 2


@pytest.mark.parametrize(("head_dim", "arch", "least"), [
    (128, "sm_90", 1000), (128, "sm_80", 1000), (64, "sm_90", 1000), (64, "sm_80", 1000)])
def test_the_space_is_worth_searching(head_dim: int, arch: str, least: int) -> None:
    problem = Problem(head_dim, DType.BF16)
    assert FORWARD.space(problem).size == 147456
    assert len(FORWARD.search_space(problem)) == 101376
    assert len(FORWARD.candidates(problem, get_arch(arch))) >= least


def test_every_knob_value_passes_the_rules_somewhere() -> None:
    candidates = FORWARD.candidates(Problem(64, DType.BF16, causal=True), SM90)
    for param in knobs.KNOB_PARAMS:
        for value in param.values:
            assert any(knobs.knob(c, param.name) == value for c in candidates), param.name


def test_persistent_grid_is_bounded_by_the_sms_and_the_query_blocks() -> None:
    assert persistent_grid((10, 4, 2), 132, 2) == (10, 4, 2)    # 264 slots for 80
    assert persistent_grid((64, 16, 4), 132, 2) == (5, 16, 4)   # ceil(264 / 64)
    assert persistent_grid((64, 64, 16), 132, 2) == (1, 64, 16)  # never below one
    assert persistent_grid((3, 2, 2), None, 2) == (2, 2, 2)      # 4 SMs assumed


def test_a_persistent_launch_plan_walks_several_query_blocks() -> None:
    shape = Shape(2, 2, 1, 300, 200)
    config = KernelConfig(64, 32, 4, 2, extras={"persistent": 1, "minblocks": 3})
    inputs = FORWARD.random_inputs(D128, shape, "cpu", seed=1)
    outputs = FORWARD.empty_outputs(D128, shape, inputs, poison=True)
    grid = FORWARD.launch_plan(D128, config, shape, inputs, outputs).grid
    assert grid == (3, 2, 2)  # 4 SMs x 3 blocks over 4 (head, batch) pairs; 5 query blocks
    plain = FORWARD.launch_plan(D128, KernelConfig(64, 32, 4, 2), shape, inputs, outputs)
    assert plain.grid == (5, 2, 2)
    assert torch.isnan(outputs["o"]).all()
