"""Attention features as declarations: a feature registered in a test (a constant score bias)
is a Problem switch with a key word, parses back, is stored, and is refused by every family
that does not declare it, with no edit anywhere else."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import pytest

from flashtune import families
from flashtune.codegen.features import (
    BUILTIN,
    RESERVED,
    Feature,
    register_feature,
    unregister_feature,
)
from flashtune.codegen.spec import FEATURE_NAMES, FEATURES, DType, Problem
from flashtune.db.records import Keyed
from flashtune.errors import FeatureNotSupported, InvalidProblem
from flashtune.families.fwd import ForwardFamily

BIAS = Feature("bias", "bias", "a constant score bias (score_bias)")


@pytest.fixture
def bias() -> Iterator[Feature]:
    register_feature(BIAS)
    try:
        yield BIAS
    finally:
        unregister_feature(BIAS.name)


def test_builtin_features_keep_their_names_words_and_order() -> None:
    assert tuple(FEATURES) == ("window", "softcap", "alibi", "varlen", "sinks", "dropout")
    assert [f.word for f in BUILTIN] == ["local", "softcap", "alibi", "varlen", "sinks",
                                         "dropout"]
    assert FEATURE_NAMES["window"] == "sliding-window attention (window_size)"
    assert Problem(64, DType.FP16, window=True, softcap=True, alibi=True,
                   varlen=True).key() == "fwd_d64_fp16_local_softcap_alibi_varlen"
    assert Problem(64, DType.FP16, causal=True, features=("dropout", "alibi")).key() == (
        "fwd_d64_fp16_causal_alibi_dropout")


def test_a_registered_feature_is_a_switch_with_a_key_and_a_dict_field(bias: Feature) -> None:
    assert "bias" in FEATURES and FEATURE_NAMES["bias"] == bias.title
    by_keyword = Problem(64, DType.FP16, bias=True)
    by_names = Problem(64, DType.FP16, features=("bias",))
    assert by_keyword == by_names and hash(by_keyword) == hash(by_names)
    assert by_keyword.has("bias") and by_keyword.bias  # type: ignore[attr-defined]  # a registered feature (Problem.__getattr__)
    assert not Problem(64, DType.FP16).bias  # type: ignore[attr-defined]  # a registered feature (Problem.__getattr__)
    assert by_keyword.key() == "fwd_d64_fp16_full_bias"
    assert Problem.from_key("fwd_d64_fp16_full_bias") == by_keyword
    assert by_keyword.to_dict() == {"op": "fwd", "head_dim": 64, "dtype": "fp16",
                                    "causal": False, "bias": True}
    assert Problem.from_dict(by_keyword.to_dict()) == by_keyword
    assert Problem.from_dict(Keyed.of(by_keyword).as_dict()) == by_keyword
    # With the built-ins: after them in the key, in registration order.
    mixed = Problem(128, DType.BF16, window=True, softcap=True, bias=True)
    assert mixed.features == ("window", "softcap", "bias")
    assert mixed.key() == "fwd_d128_bf16_local_softcap_bias"
    assert Problem.from_key(mixed.key()) == mixed
    with pytest.raises(InvalidProblem, match="expected e.g."):
        Problem.from_key("fwd_d128_bf16_local_bias_softcap")  # not in key order
    assert Problem(128, DType.BF16, features=("bias",), bias=False) == Problem(128, DType.BF16)


def test_families_refuse_the_feature_unless_they_declare_it(bias: Feature) -> None:
    for family in families.all_families():
        with pytest.raises(FeatureNotSupported) as info:
            family.check_problem(Problem(64, DType.FP16, op=family.op, bias=True))
        assert f"the {family.op!r} kernel family" in str(info.value)
        assert "a constant score bias (score_bias)" in str(info.value)

    class BiasForward(ForwardFamily):
        op = "fwdbias"
        features: ClassVar[frozenset[str]] = ForwardFamily.features | {"bias"}

    families.register(BiasForward())
    try:
        declared = Problem.from_key("fwdbias_d64_fp16_causal_bias")
        assert declared == Problem(64, DType.FP16, causal=True, op="fwdbias", bias=True)
        families.of(declared).check_problem(declared)
        with pytest.raises(FeatureNotSupported, match="a constant score bias"):
            families.get("fwd").check_problem(Problem(64, DType.FP16, causal=True, bias=True))
    finally:
        families.unregister("fwdbias")


def test_after_removal_the_feature_is_unknown_again() -> None:
    register_feature(BIAS)
    key = Problem(64, DType.FP16, bias=True).key()
    assert Problem.from_key(key).has("bias")
    unregister_feature(BIAS.name)
    with pytest.raises(InvalidProblem, match="'bias' is not a feature word"):
        Problem.from_key(key)
    with pytest.raises(InvalidProblem, match=r"'bias' is not an attention feature; expected "
                                             r"one of \['window', 'softcap', 'alibi', 'varlen', "
                                             r"'sinks', 'dropout'\]"):
        Problem(64, DType.FP16, bias=True)
    with pytest.raises(AttributeError):
        _ = Problem(64, DType.FP16).bias  # type: ignore[attr-defined]  # unregistered: raises
    with pytest.raises(InvalidProblem, match="unknown problem field"):
        Problem.from_dict({"head_dim": 64, "dtype": "fp16", "bias": True})


def test_exclusions_are_declared_and_enforced() -> None:
    chunked = Feature("chunked", "chunked", "chunked attention (chunk_size)",
                      excludes=frozenset({"causal", "window"}), hint="use window_size instead")
    register_feature(chunked)
    try:
        with pytest.raises(InvalidProblem, match=r"causal=True and chunked=True are exclusive: "
                                                 r"use window_size instead"):
            Problem(64, DType.FP16, causal=True, chunked=True)
        with pytest.raises(InvalidProblem, match=r"window=True and chunked=True"):
            Problem(64, DType.FP16, window=True, chunked=True)
        assert Problem(64, DType.FP16, chunked=True).key() == "fwd_d64_fp16_full_chunked"
    finally:
        unregister_feature("chunked")
    with pytest.raises(InvalidProblem, match="a causal sliding window is the window"):
        Problem(64, DType.FP16, causal=True, window=True)


def test_a_mask_feature_takes_the_mask_slot_of_the_key() -> None:
    blocks = Feature("blocks", "blocked", "a block mask (block_mask)",
                     excludes=frozenset({"causal"}), mask=True)
    register_feature(blocks)
    try:
        problem = Problem(64, DType.FP16, blocks=True, softcap=True)
        assert problem.key() == "fwd_d64_fp16_blocked_softcap" and problem.mask == "blocked"
        assert Problem.from_key(problem.key()) == problem
        with pytest.raises(InvalidProblem, match="each is a mask of its own"):
            Problem(64, DType.FP16, window=True, blocks=True)
        with pytest.raises(InvalidProblem, match="is not a feature word"):
            Problem.from_key("fwd_d64_fp16_full_blocked")
    finally:
        unregister_feature("blocks")


@pytest.mark.parametrize(("make", "needle"), [
    (lambda: Feature("window", "win", "x"), "already registered"),
    (lambda: Feature("wide", "local", "x"), "clashes with 'window'"),
    (lambda: Feature("causal", "causal", "x"), "taken by the Problem"),
    (lambda: Feature("dtype", "dt", "x"), "taken by the Problem"),
    (lambda: Feature("Bad", "bad", "x"), "lowercase letters and digits"),
    (lambda: Feature("sink", "sink", "x", excludes=frozenset({"nothing"})), "not registered"),
    (lambda: Feature("mk", "mk", "x", mask=True), "must exclude 'causal'"),
    (lambda: Feature("untitled", "untitled", ""), "needs a title"),
])
def test_bad_declarations_are_refused(make, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidProblem, match=needle):
        register_feature(make())
    assert tuple(FEATURES) == ("window", "softcap", "alibi", "varlen", "sinks", "dropout")


def test_builtins_cannot_be_removed() -> None:
    with pytest.raises(InvalidProblem, match="built in"):
        unregister_feature("window")


def test_reserved_names_cover_every_public_name_of_a_problem() -> None:
    public = {name for name in dir(Problem) if not name.startswith("_")}
    builtin = {f.name for f in BUILTIN}
    assert public - builtin <= RESERVED, sorted(public - builtin - RESERVED)


def test_features_must_be_a_collection_of_names() -> None:
    with pytest.raises(InvalidProblem, match=r"must be a collection of feature names"):
        Problem(64, DType.FP16, features="window")
    with pytest.raises(InvalidProblem, match="window must be a bool"):
        Problem(64, DType.FP16, window=1)  # type: ignore[arg-type]
