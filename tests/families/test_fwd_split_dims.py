"""Split QK / V head dims in the mma.sync forward (``Problem.head_dim_v``): Q K^T over Q/K's
head dim, P V and O over V's (DeepSeek's prefill: 192 / 128).

Numerics: the CPU emulator against the float64 reference (``attention_reference``, which
takes V of any head dim), every element of O and the LSE within the 16-bit forward's
tolerance (``families.checks``), outputs poisoned with NaN before each launch, inputs fresh
standard normal values from a seeded generator. Pairs: 192/128, 128/64 (Q/K wider), 64/128
and 72/136 (V wider, the latter off the k16 step on both sides); fp16 and bf16; causal and
not; GQA/MQA shapes with lengths off the tile grid, and Nq > Nk under the causal mask (rows
that see no key). The default run takes a seeded sample (the seed in each id replays it; a
pair with Q/K wider and one with V wider, and NVRTC per arch likewise); ``-m sweep`` the
grid.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random

import pytest
from sampling import seeded_part
from split_dims import case_id, run_split

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.errors import FeatureNotSupported, InvalidProblem
from flashtune.families.fwd import FORWARD, space
from flashtune.toolchain.compiler import compile_source

#: (Q/K's head dim, V's head dim).
PAIRS = ((192, 128), (128, 64), (64, 128), (72, 136))
#: (batch, heads_q, heads_kv, seqlen_q, seqlen_k): GQA 4:2 off the tile grid, MQA with
#: Nq < Nk, causal Nq > Nk (the first rows see no key: O = 0, LSE = +inf).
SHAPES = (Shape(2, 4, 2, 100, 77), Shape(1, 3, 1, 33, 150), Shape(1, 2, 2, 90, 20))
#: Each structure knob of the forward: swizzled rows, Q in registers with pipelined Q K^T,
#: one to three stages, a one-warp tile, and a persistent block.
CONFIGS = (KernelConfig(64, 32, 4, 2), KernelConfig(64, 64, 4, 1),
           KernelConfig(128, 32, 4, 3, extras=(("swizzle", 1),)),
           KernelConfig(64, 32, 4, 2, extras=(("qregs", 1), ("pipeline", 1))),
           KernelConfig(16, 16, 1, 2),
           KernelConfig(64, 32, 4, 1, extras=(("persistent", 1),)))

_SEED = int(os.environ["FLASHTUNE_TEST_SEED"])


def split(head_dim: int, head_dim_v: int, dtype: DType, causal: bool,
          features: frozenset[str] = frozenset()) -> Problem:
    return Problem(head_dim, dtype, causal=causal, head_dim_v=head_dim_v, features=features)


def _grid() -> list[tuple[tuple[int, int], DType, bool, KernelConfig, Shape]]:
    return [(pair, dtype, causal, c, s) for pair, dtype, causal, c, s in itertools.product(
        PAIRS, (DType.FP16, DType.BF16), (False, True), CONFIGS, SHAPES)
        if FORWARD.static_check(split(*pair, dtype, causal), c, get_arch("sm_80")) is None]


_GRID = _grid()
#: One row per pair, chosen by the session's seed (in the id); the default run takes a seeded
#: one of the pairs with Q/K wider and one of those with V wider, ``-m sweep`` all four.
_ROWS = [(*random.Random(_SEED + i).choice([r for r in _GRID if r[0] == pair]), _SEED + i)
         for i, pair in enumerate(PAIRS)]
SAMPLE = [*seeded_part([r for r in _ROWS if r[0][0] > r[0][1]], 1, "fwd-split-qk",
                       several=True),
          *seeded_part([r for r in _ROWS if r[0][0] < r[0][1]], 1, "fwd-split-v",
                       several=True)]


@pytest.mark.emulator
@pytest.mark.parametrize("pair, dtype, causal, config, shape, seed", SAMPLE, ids=case_id)
def test_split_head_dims_match_float64(pair: tuple[int, int], dtype: DType, causal: bool,
                                       config: KernelConfig, shape: Shape, seed: int) -> None:
    print(f"seed={seed}")
    run_split(split(*pair, dtype, causal), config, shape, seed, "o")


@pytest.mark.emulator
@pytest.mark.sweep
@pytest.mark.parametrize("pair, dtype, causal, config, shape", _GRID, ids=case_id)
def test_split_head_dims_grid(pair: tuple[int, int], dtype: DType, causal: bool,
                              config: KernelConfig, shape: Shape) -> None:
    run_split(split(*pair, dtype, causal), config, shape, _SEED, "o")


@pytest.mark.emulator
@pytest.mark.parametrize("pair", [(72, 136), (136, 72)], ids=case_id)
def test_a_persistent_block_walks_several_query_blocks(pair: tuple[int, int]) -> None:
    """One block in x walks every query block of its head: O's staging (V's columns) must
    not leave the next tile's pad columns of Q, K or V nonzero (72 and 136 are off the k16
    step, so each has zero columns the tensor cores read)."""
    run_split(split(*pair, DType.BF16, True),
              KernelConfig(64, 32, 4, 1, extras=(("persistent", 1),)),
              Shape(1, 2, 1, 150, 150), _SEED, "o", grid_x=1)


#: The features that come with the forward's hooks, each on a split problem.
FEATURE_SETS = (frozenset({"window"}), frozenset({"softcap", "alibi"}),
                frozenset({"varlen"}), frozenset({"sinks"}), frozenset({"dropout"}))


def _feature_grid() -> list[tuple[tuple[int, int], DType, bool, frozenset[str],
                                  KernelConfig, Shape]]:
    return [(pair, dtype, causal, f, c, s) for pair, dtype, causal, f, c, s in
            itertools.product(PAIRS[:3], (DType.FP16, DType.BF16), (False, True),
                              FEATURE_SETS, CONFIGS[:2], SHAPES)
            if not (causal and "window" in f)]


_FEATURE_GRID = _feature_grid()
FEATURE_SAMPLE = [(*random.Random(_SEED + 20 + i).choice(
    [r for r in _FEATURE_GRID if r[3] == f]), _SEED + 20 + i)
    for i, f in enumerate(FEATURE_SETS)]


@pytest.mark.emulator
@pytest.mark.parametrize("pair, dtype, causal, features, config, shape, seed", FEATURE_SAMPLE,
                         ids=case_id)
def test_split_head_dims_with_features_match_float64(
        pair: tuple[int, int], dtype: DType, causal: bool, features: frozenset[str],
        config: KernelConfig, shape: Shape, seed: int) -> None:
    print(f"seed={seed}")
    run_split(split(*pair, dtype, causal, features), config, shape, seed, "o")


@pytest.mark.emulator
@pytest.mark.sweep
@pytest.mark.parametrize("pair, dtype, causal, features, config, shape", _FEATURE_GRID,
                         ids=case_id)
def test_split_head_dims_with_features_grid(
        pair: tuple[int, int], dtype: DType, causal: bool, features: frozenset[str],
        config: KernelConfig, shape: Shape) -> None:
    run_split(split(*pair, dtype, causal, features), config, shape, _SEED, "o")


def test_the_key_names_both_head_dims_and_a_plain_problem_keeps_its_own() -> None:
    p = split(192, 128, DType.BF16, True)
    assert p.key() == "fwd_d192v128_bf16_causal"
    assert Problem.from_key(p.key()) == p
    assert Problem.from_dict(p.to_dict()) == p and p.to_dict()["head_dim_v"] == 128
    plain = Problem(128, DType.BF16, causal=True, head_dim_v=128)
    assert plain == Problem(128, DType.BF16, causal=True) and not plain.split_head_dims
    assert plain.key() == "fwd_d128_bf16_causal" and "head_dim_v" not in plain.to_dict()
    assert plain.v_head_dim == 128 and p.v_head_dim == 128 and p.padded_v_head_dim == 128
    # Replacing Q/K's head dim keeps a plain problem plain and a split one split.
    assert not dataclasses.replace(plain, head_dim=64).split_head_dims
    assert dataclasses.replace(p, op="fwd90a").key() == "fwd90a_d192v128_bf16_causal"
    with pytest.raises(InvalidProblem, match="canonical spelling is 'fwd_d128_bf16_full'"):
        Problem.from_key("fwd_d128v128_bf16_full")


@pytest.mark.parametrize("value, match", [
    (100, r"head_dim_v \(V's head dim\)=100 .*multiple of 8.*pad v's head dim .* to 104"),
    (512, r"head_dim_v \(V's head dim\)=512 .*at most 256"),
    ("128", r"head_dim_v \(V's head dim\) must be an int"),
    (True, r"head_dim_v \(V's head dim\) must be an int"),
])
def test_a_bad_v_head_dim_is_refused_naming_it(value: object, match: str) -> None:
    with pytest.raises(InvalidProblem, match=match):
        Problem(128, DType.BF16, head_dim_v=value)  # type: ignore[arg-type]


def test_families_without_split_head_dims_refuse_them_and_serving_falls_back() -> None:
    """The cp.async sm_90a forward and the FP8 forward do not declare split head dims
    (``KernelFamily.split_head_dims``, not inherited): each refuses naming both dims and
    what serves them. The warp-specialised sm_90a forward declares them for whole 128-byte
    panels (tests/families/test_hopper_ws_wide.py): on an sm_90a device DeepSeek's 192 / 128
    runs on it, 72 / 136 on the mma.sync forward."""
    p = split(192, 128, DType.BF16, True)
    FORWARD.check_problem(p)
    assert families.served_problem(p, get_arch("sm_90a")) == dataclasses.replace(
        p, op="fwd90aws")
    partial = split(72, 136, DType.BF16, True)
    assert families.served_problem(partial, get_arch("sm_90a")) == partial
    plain = Problem(128, DType.BF16, causal=True)
    assert families.served_problem(plain, get_arch("sm_90a")).op != "fwd"
    assert families.get("fwd90aws").split_head_dims
    with pytest.raises(InvalidProblem, match=r"head_dim=72: the sm_90a forward takes"):
        families.get("fwd90aws").check_problem(dataclasses.replace(partial, op="fwd90aws"))
    for op in ("fwd90a", "fwd8"):
        family = families.get(op)
        assert not family.split_head_dims
        with pytest.raises(FeatureNotSupported,
                           match=r"head_dim=192 and head_dim_v=128.*mma\.sync forward"):
            family.check_problem(dataclasses.replace(p, op=op))


def test_smem_bytes_follow_the_split_layout() -> None:
    """V's stage buffers take V's padded rows; with V the wider, O's staging (block_m of
    V's rows) is the floor."""
    config = KernelConfig(64, 32, 4, 2)
    row, v_row = (192 + 8) * 2, (128 + 8) * 2
    assert space.smem_bytes(split(192, 128, DType.BF16, False), config) == (
        row * (64 + 2 * 32) + v_row * 2 * 32)
    wide = KernelConfig(256, 16, 8, 1)
    row, v_row = (32 + 8) * 2, (256 + 8) * 2
    assert space.smem_bytes(split(32, 256, DType.BF16, False), wide) == v_row * 256 > (
        row * (256 + 16) + v_row * 16)


#: Per arch, the defaults of the three pairs, causal and not: by default a seeded one with
#: Q/K wider and one with V wider, ``-m sweep`` all six.
_COMPILED = [case for arch in ("sm_80", "sm_90") for wider_qk in (True, False)
             for case in seeded_part(
                 [(arch, pair, causal) for pair, causal in itertools.product(PAIRS[:3],
                                                                             (False, True))
                  if (pair[0] > pair[1]) == wider_qk], 1,
                 f"fwd-split-nvrtc-{arch}-{wider_qk}", several=True)]


@pytest.mark.parametrize("arch, pair, causal", _COMPILED, ids=case_id)
def test_default_kernels_compile_without_spills(arch: str, pair: tuple[int, int],
                                                causal: bool) -> None:
    """NVRTC and ptxas build the defaults of the pairs, causal and not, without spills
    (the registers are in the report of the change)."""
    p = split(*pair, DType.BF16, causal)
    config = FORWARD.default_config(p, get_arch(arch))
    resources = compile_source(families.render(p, config), arch).resources
    assert resources.spill_stores == 0 and resources.spill_loads == 0, (
        f"{p.key()} {config.key()} on {arch}: {resources}")


def test_the_command_line_takes_v_head_dim() -> None:
    """``--head-dim-v`` (show, compile, check): the split problem, refused naming the option
    where the family takes one head dim."""
    import typer

    from flashtune.commands.codegen import parse_problem

    assert parse_problem("fwd", 192, DType.BF16, True, None, 128).key() == (
        "fwd_d192v128_bf16_causal")
    assert parse_problem("bwd", 192, DType.BF16, True, None, 192).key() == (
        "bwd_d192_bf16_causal")
    with pytest.raises(typer.BadParameter, match="needs V's head dim equal to Q/K's"):
        parse_problem("fwd90a", 128, DType.BF16, False, None, 64)
