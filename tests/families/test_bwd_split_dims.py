"""Split QK / V head dims in the mma.sync backward (``bwd``, ``bwddet``): S, dQ and dK over
Q/K's head dim, dP = dO V^T and dV over V's (DeepSeek's prefill: 192 / 128).

Numerics: the CPU emulator against the float64 autograd-free reference
(``families.bwd.reference.backward_reference``: the definition's gradients in float64, with
flash-attn's rule as the bound, ``BackwardFamily.compare``), dK and dV poisoned with NaN
before each launch, fresh seeded inputs, the forward's LSE and D of them. Pairs: 192/128,
128/64 (Q/K wider), 64/128 and 72/136 (V wider, the latter off the k16 step); fp16 and
bf16; causal and not; GQA/MQA shapes off the tile grid and Nq > Nk under the causal mask.
The default run takes a seeded sample (the seed in each id replays it; both modes, one on a
pair with Q/K wider, the other on one with V wider); ``-m sweep`` the grid.
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Any

import pytest
from split_dims import case_id, run_split

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.errors import FeatureNotSupported
from flashtune.toolchain.compiler import compile_source

PAIRS = ((192, 128), (128, 64), (64, 128), (72, 136))
SHAPES = (Shape(2, 4, 2, 100, 77), Shape(1, 3, 1, 33, 150), Shape(1, 2, 2, 90, 20))


def _configs(mode: str) -> tuple[KernelConfig, ...]:
    extras = (("dqmode", mode),)
    return (KernelConfig(64, 32, 4, 2, extras=extras), KernelConfig(128, 64, 8, 1, extras=extras),
            KernelConfig(32, 16, 2, 1, extras=extras), KernelConfig(64, 64, 4, 1, extras=extras))


CONFIGS = {"bwd": _configs("atomic"), "bwddet": _configs("split")}
_SEED = int(os.environ["FLASHTUNE_TEST_SEED"])


def split(op: str, pair: tuple[int, int], dtype: DType, causal: bool,
          features: frozenset[str] = frozenset()) -> Problem:
    return Problem(pair[0], dtype, causal=causal, op=op, head_dim_v=pair[1],
                   features=features)


def _grid() -> list[tuple[str, tuple[int, int], DType, bool, KernelConfig, Shape]]:
    rows = []
    for op in CONFIGS:
        family = families.get(op)
        rows += [(op, pair, dtype, causal, c, s) for pair, dtype, causal, c, s in
                 itertools.product(PAIRS, (DType.FP16, DType.BF16), (False, True),
                                   CONFIGS[op], SHAPES)
                 if family.static_check(split(op, pair, dtype, causal), c,
                                        get_arch("sm_80")) is None]
    return rows


_GRID = _grid()
#: One row per pair and mode, by the session's seed. The default run takes two: both modes,
#: one with a pair whose Q/K is wider and one with a pair whose V is wider (which mode takes
#: which, and the pairs, drawn); ``-m sweep`` every row (and the grid).
_ROWS = [(*random.Random(_SEED + 40 + i).choice([r for r in _GRID if r[1] == pair
                                                  and r[0] == op]), _SEED + 40 + i)
         for i, (op, pair) in enumerate(itertools.product(CONFIGS, PAIRS))]


def _sample() -> list[Any]:
    rng = random.Random(f"{_SEED}-bwd-split")
    modes = list(CONFIGS)
    rng.shuffle(modes)
    picked = [rng.choice([r for r in _ROWS if r[0] == op and (r[1][0] > r[1][1]) == wider_qk])
              for op, wider_qk in zip(modes, (True, False), strict=True)]
    return [r if r in picked else pytest.param(*r, marks=pytest.mark.sweep) for r in _ROWS]


SAMPLE = _sample()


@pytest.mark.emulator
@pytest.mark.parametrize("op, pair, dtype, causal, config, shape, seed", SAMPLE, ids=case_id)
def test_split_head_dim_gradients_match_float64(op: str, pair: tuple[int, int], dtype: DType,
                                                causal: bool, config: KernelConfig,
                                                shape: Shape, seed: int) -> None:
    print(f"seed={seed}")
    run_split(split(op, pair, dtype, causal), config, shape, seed, "dv")


@pytest.mark.emulator
@pytest.mark.sweep
@pytest.mark.parametrize("op, pair, dtype, causal, config, shape", _GRID, ids=case_id)
def test_split_head_dim_gradients_grid(op: str, pair: tuple[int, int], dtype: DType,
                                       causal: bool, config: KernelConfig,
                                       shape: Shape) -> None:
    run_split(split(op, pair, dtype, causal), config, shape, _SEED, "dv")


FEATURE_SETS = (frozenset({"window"}), frozenset({"softcap", "alibi"}),
                frozenset({"varlen"}), frozenset({"dropout"}))
_FEATURE_GRID = [(pair, dtype, causal, f, c, s) for pair, dtype, causal, f, c, s in
                 itertools.product(PAIRS[:3], (DType.FP16, DType.BF16), (False, True),
                                   FEATURE_SETS, CONFIGS["bwd"][:2], SHAPES)
                 if not (causal and "window" in f)]
FEATURE_SAMPLE = [(*random.Random(_SEED + 50 + i).choice(
    [r for r in _FEATURE_GRID if r[3] == f]), _SEED + 50 + i)
    for i, f in enumerate(FEATURE_SETS)]


@pytest.mark.emulator
@pytest.mark.parametrize("pair, dtype, causal, features, config, shape, seed", FEATURE_SAMPLE,
                         ids=case_id)
def test_split_head_dim_gradients_with_features_match_float64(
        pair: tuple[int, int], dtype: DType, causal: bool, features: frozenset[str],
        config: KernelConfig, shape: Shape, seed: int) -> None:
    print(f"seed={seed}")
    run_split(split("bwd", pair, dtype, causal, features), config, shape, seed, "dv")


@pytest.mark.emulator
@pytest.mark.sweep
@pytest.mark.parametrize("pair, dtype, causal, features, config, shape", _FEATURE_GRID,
                         ids=case_id)
def test_split_head_dim_gradients_with_features_grid(
        pair: tuple[int, int], dtype: DType, causal: bool, features: frozenset[str],
        config: KernelConfig, shape: Shape) -> None:
    run_split(split("bwd", pair, dtype, causal, features), config, shape, _SEED, "dv")


def test_warps_that_cannot_split_v_head_dim_are_ruled_out_naming_it() -> None:
    """dV's n8 tiles split over the same warps as dK's: a V head dim whose tiles do not
    divide among them is refused by the static rule, naming it."""
    p = split("bwd", (128, 72), DType.BF16, False)  # 80 columns: 10 n8 tiles over 4 warps
    why = families.get("bwd").static_check(p, KernelConfig(64, 16, 4, 1, extras=(
        ("dqmode", "atomic"),)), get_arch("sm_80"))
    assert why is not None and "V head dim's 10 n8 tiles" in why and "V head dim 72" in why


def test_the_sm90a_and_fp8_backwards_refuse_split_head_dims() -> None:
    for op in ("bwd90a", "bwd8"):
        family = families.get(op)
        assert not family.split_head_dims
        with pytest.raises(FeatureNotSupported, match=r"head_dim=192 and head_dim_v=128"):
            family.check_problem(Problem(192, DType.BF16, op=op, head_dim_v=128))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_default_kernels_compile_without_spills(arch: str) -> None:
    """NVRTC and ptxas build both modes' defaults of the DeepSeek pair, causal, without
    spills (the registers are in the report of the change)."""
    for op in CONFIGS:
        p = split(op, (192, 128), DType.BF16, True)
        config = families.get(op).default_config(p, get_arch(arch))
        resources = compile_source(families.render(p, config), arch).resources
        assert resources.spill_stores == 0 and resources.spill_loads == 0, (
            f"{p.key()} {config.key()} on {arch}: {resources}")
