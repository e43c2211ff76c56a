"""Problem, ProblemBucket and KernelConfig: validation with clear messages, key round trips."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import os
import random

import pytest

from flashtune.codegen.spec import (
    COMPILED_HEAD_DIMS,
    DType,
    KernelConfig,
    Problem,
    ProblemBucket,
)
from flashtune.errors import InvalidConfig, InvalidProblem
from flashtune.families.fwd import FORWARD

ALL_PROBLEMS = [
    Problem(head_dim=hd, dtype=dt, causal=causal)
    for hd, dt, causal in itertools.product(range(8, 257, 8), DType, (False, True))
] + [
    # Every combination of the feature switches (a window excludes causal).
    Problem(head_dim=64, dtype=DType.BF16, causal=mask == "causal", window=mask == "local",
            softcap=softcap, alibi=alibi, varlen=varlen)
    for mask, softcap, alibi, varlen in itertools.product(("full", "causal", "local"),
                                                          (False, True), (False, True),
                                                          (False, True))
    if mask == "local" or softcap or alibi or varlen
]


@pytest.mark.parametrize("problem", ALL_PROBLEMS, ids=lambda p: p.key())
def test_problem_key_round_trip(problem: Problem) -> None:
    key = problem.key()
    assert Problem.from_key(key) == problem
    assert Problem.from_dict(problem.to_dict()) == problem
    assert key.replace("_", "").isalnum()


def test_problem_keys_are_distinct() -> None:
    keys = [p.key() for p in ALL_PROBLEMS]
    assert len(set(keys)) == len(keys)


def test_padded_head_dim_is_the_next_compiled_size() -> None:
    for problem in ALL_PROBLEMS:
        padded = problem.padded_head_dim
        assert padded in COMPILED_HEAD_DIMS
        assert padded >= problem.head_dim
        smaller = [d for d in COMPILED_HEAD_DIMS if d < padded]
        assert not smaller or smaller[-1] < problem.head_dim


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"head_dim": 100, "dtype": "fp16"}, "multiple of 8"),
        ({"head_dim": 264, "dtype": "fp16"}, "multiple of 8 in [8, 256]"),
        ({"head_dim": 0, "dtype": "fp16"}, "multiple of 8"),
        ({"head_dim": 64.0, "dtype": "fp16"}, "must be an int"),
        ({"head_dim": True, "dtype": "fp16"}, "must be an int"),
        ({"head_dim": 64, "dtype": "fp32"}, "expected one of ['fp16', 'bf16', 'e4m3', 'e5m2']"),
        ({"head_dim": 64, "dtype": "fp16", "causal": 1}, "causal must be a bool"),
        ({"head_dim": 64, "dtype": "fp16", "op": "Bad-Op"}, "not a kernel family name"),
        ({"head_dim": 64, "dtype": "fp16", "op": 3}, "not a kernel family name"),
        ({"head_dim": 64, "dtype": "fp16", "softcap": 30.0}, "softcap must be a bool"),
        ({"head_dim": 64, "dtype": "fp16", "causal": True, "window": True},
         "a causal sliding window is the window (left, 0)"),
    ],
)
def test_bad_problem_says_what_is_expected(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidProblem) as info:
        Problem(**kwargs)  # type: ignore[arg-type]
    assert needle in str(info.value)


@pytest.mark.parametrize("key", ["", "fwd_d128_bf16", "fwd_d128_fp32_full", "fwd_d12x_fp16_full",
                                 "fwd_d128_bf16_causal_extra", "FWD_d128_bf16_full",
                                 "fwd_d64_fp16_full_alibi_softcap", "fwd_d64_fp16_window"])
def test_malformed_problem_key(key: str) -> None:
    with pytest.raises(InvalidProblem, match="expected e.g. 'fwd_d128_bf16_causal'"):
        Problem.from_key(key)


def test_problem_from_dict_rejects_unknown_fields() -> None:
    with pytest.raises(InvalidProblem, match="unknown problem field"):
        Problem.from_dict({"head_dim": 64, "dtype": "fp16", "sliding": 3})


def test_plain_problem_keys_and_dicts_have_no_feature_words() -> None:
    """Keys and dicts of problems without features are the ones stored before features
    existed (tuned results and defaults stay addressable)."""
    plain = Problem(128, DType.BF16, causal=True)
    assert plain.key() == "fwd_d128_bf16_causal" and plain.features == ()
    assert plain.to_dict() == {"op": "fwd", "head_dim": 128, "dtype": "bf16", "causal": True}
    both = Problem(64, DType.FP16, window=True, softcap=True, alibi=True)
    assert both.key() == "fwd_d64_fp16_local_softcap_alibi"
    assert both.features == ("window", "softcap", "alibi")


ALL_CONFIGS = [
    KernelConfig(block_m=m, block_n=n, num_warps=w, num_stages=s)
    for m, n, w, s in itertools.product(range(16, 257, 16), range(16, 257, 16), (1, 2, 4, 8, 16),
                                        (1, 2, 3, 4))
    if m % (16 * w) == 0
]


def test_every_legal_config_round_trips() -> None:
    keys = set()
    for cfg in ALL_CONFIGS:
        key = cfg.key()
        assert KernelConfig.from_key(key) == cfg
        assert KernelConfig.from_dict(cfg.to_dict()) == cfg
        assert cfg.threads == 32 * cfg.num_warps
        assert cfg.rows_per_warp * cfg.num_warps == cfg.block_m
        keys.add(key)
    assert len(keys) == len(ALL_CONFIGS)


def test_search_space_is_legal_and_stable() -> None:
    # Keys are unique over the whole space; the key round trip runs on a seeded sample of
    # each space (10^5 configs per problem, a new sample each run).
    rng = random.Random(int(os.environ["FLASHTUNE_TEST_SEED"]))
    for problem in ALL_PROBLEMS[::7]:
        configs = FORWARD.search_space(problem)
        assert configs == FORWARD.search_space(problem)
        keys = [c.key() for c in configs]
        assert len(set(keys)) == len(configs)
        for i in rng.sample(range(len(configs)), min(len(configs), 500)):
            assert KernelConfig.from_key(keys[i]) == configs[i]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"block_m": 48, "block_n": 64, "num_warps": 4, "num_stages": 2},
         "use block_m a multiple of 64"),
        ({"block_m": 72, "block_n": 64, "num_warps": 1, "num_stages": 2},
         "block_m=72 is illegal; expected a multiple of 16 in [16, 256]"),
        ({"block_m": 64, "block_n": 8, "num_warps": 4, "num_stages": 2},
         "block_n=8 is illegal"),
        ({"block_m": 64, "block_n": 272, "num_warps": 4, "num_stages": 2},
         "block_n=272 is illegal"),
        ({"block_m": 64, "block_n": 64, "num_warps": 3, "num_stages": 2},
         "num_warps=3 is illegal; expected one of (1, 2, 4, 8, 12, 16)"),
        ({"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 0},
         "num_stages=0 is illegal; expected one of (1, 2, 3, 4)"),
        ({"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2.0},
         "num_stages must be an int"),
        ({"block_m": 256, "block_n": 64, "num_warps": 16, "num_stages": 2},
         None),
    ],
)
def test_bad_config_says_what_is_expected(kwargs: dict[str, object], needle: str | None) -> None:
    if needle is None:  # the largest legal block: 512 threads, accepted
        assert KernelConfig(**kwargs).threads == 512  # type: ignore[arg-type]
        return
    with pytest.raises(InvalidConfig) as info:
        KernelConfig(**kwargs)  # type: ignore[arg-type]
    assert needle in str(info.value)


@pytest.mark.parametrize("key", ["", "m128_n64_w4", "m128_n64_w4_s2_x", "m128-n64-w4-s2",
                                 "m1280_n64_w4_s2", "M128_n64_w4_s2"])
def test_malformed_config_key(key: str) -> None:
    with pytest.raises(InvalidConfig, match="expected e.g. 'm128_n64_w4_s2'"):
        KernelConfig.from_key(key)


def test_config_key_with_illegal_values_is_rejected_by_validation() -> None:
    with pytest.raises(InvalidConfig, match="num_warps=3 is illegal"):
        KernelConfig.from_key("m96_n64_w3_s2")


def test_config_from_dict_names_unknown_and_missing_fields() -> None:
    with pytest.raises(InvalidConfig) as info:
        KernelConfig.from_dict({"block_m": 64, "block_n": 64, "num_warps": 4, "stages": 2})
    text = str(info.value)
    assert "missing: ['num_stages']" in text


def test_bucket_round_trip_on_random_lengths() -> None:
    rng = random.Random()
    for _ in range(200):
        problem = rng.choice(ALL_PROBLEMS)
        sq, sk = rng.randint(1, 1 << 21), rng.randint(1, 1 << 21)
        bucket = problem.bucket(sq, sk)
        n = max(sq, sk)
        assert bucket.seqlen >= min(n, 1 << 20)
        assert bucket.seqlen == 64 or bucket.seqlen // 2 < n
        assert ProblemBucket.from_key(bucket.key()) == bucket


@pytest.mark.parametrize("key", ["fwd_d128_bf16_causal", "fwd_d128_bf16_causal_nX",
                                 "fwd_d128_bf16_causal_n100", "fwd_d128_bf16_causal_n32"])
def test_bad_bucket_keys(key: str) -> None:
    with pytest.raises(InvalidProblem):
        ProblemBucket.from_key(key)


def test_the_init_type_checkers_see_takes_the_fields_in_order() -> None:
    """KernelConfig spells out its __init__ for type checkers only (``extras`` may be a
    mapping there), so a field added to the dataclass must be added to it too."""
    tree = ast.parse(inspect.getsource(KernelConfig).lstrip())
    inits = [node for node in ast.walk(tree)
             if isinstance(node, ast.FunctionDef) and node.name == "__init__"]
    assert len(inits) == 1, "KernelConfig should spell out one __init__ for type checkers"
    params = [arg.arg for arg in inits[0].args.args[1:]]
    assert params == [f.name for f in dataclasses.fields(KernelConfig)]
