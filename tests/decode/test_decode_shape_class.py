"""Decoding tuned by shape class (``families.decode.shape_class``): a bucket of cache
length is tuned apart per GQA group, query rows and page size; the tuner times a class at
its own group, rows and page size; a call is served its class's tuned config, and a call
of a class nobody tuned the bucket tuned without one."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
from decode_cases import assert_close_to_float64, call_api
from runtime_helpers import ListSource, best_entry

from flashtune import families
from flashtune.api import decode as api_decode
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, Problem, ProblemBucket, Shape
from flashtune.db.records import BestEntry
from flashtune.errors import InvalidProblem
from flashtune.families.decode import DECODE, DecodeCase
from flashtune.families.decode.shape_class import DEFAULT_CLASSES, ShapeClass
from flashtune.runtime import plans
from flashtune.runtime.dispatch import Dispatcher, Tier, set_dispatcher
from flashtune.tuner.driver import buckets_of

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
PROBLEM = Problem(64, DType.FP16, op="decode")


def test_a_call_falls_in_the_class_of_its_rounded_group_rows_and_page() -> None:
    assert ShapeClass.of_call(5, 3, 9).word == "g8q4p16"
    assert ShapeClass.of_call(1, 1, None).word == "g1q1p0"
    assert ShapeClass.of_call(64, 40, 1000).word == "g16q16p256"  # the largest share one
    assert ShapeClass.parse("g8q4p16") == ShapeClass(8, 4, 16)
    for word, why in (("g3q1p16", "group=3 is not a power of two"),
                      ("g8q4p512", "page=512"), ("8x4", "malformed")):
        with pytest.raises(InvalidProblem, match=why):
            ShapeClass.parse(word)
    for word in DEFAULT_CLASSES:
        DECODE.check_shape_class(PROBLEM, word)
    with pytest.raises(InvalidProblem, match="tunes no shape classes"):
        families.of(Problem(64, DType.FP16)).check_shape_class(Problem(64, DType.FP16),
                                                               "g8q4p16")
    buckets = buckets_of(PROBLEM, [1000, 4096], ["g8q4p16", "g1q1p0"])
    assert [b.key().rsplit("_", 2)[-2:] for b in buckets] == [
        ["n1024", "g1q1p0"], ["n1024", "g8q4p16"], ["n4096", "g1q1p0"], ["n4096", "g8q4p16"]]


def test_a_class_is_timed_and_verified_at_its_group_rows_and_page_size() -> None:
    shapes, verify = DECODE.tuning_shapes(PROBLEM, 4096, (), "g8q4p64")
    for shape in (*shapes, verify):
        assert shape.heads_q == 8 * shape.heads_kv and shape.seqlen_q == 4, shape
    assert {s.seqlen_k for s in shapes} == {4096, 3072}
    paged = DECODE.timing_inputs(PROBLEM, Shape(2, 8, 1, 4, 512), "cpu", "g8q4p64")
    assert paged.tensors["k_cache"].shape[1] == 64 and "block_table" in paged.tensors
    unpaged = DECODE.timing_inputs(PROBLEM, Shape(2, 8, 1, 4, 512), "cpu", "g8q4p0")
    assert "block_table" not in unpaged.tensors


@pytest.mark.emulator
def test_each_call_is_served_its_class_tuned_config() -> None:
    """The class g8q4p16 tuned with 32-key tiles, the bucket without a class with 64-key
    ones: a call of group 8, 4 query rows over 16-row pages runs the former (exactly its
    bucket), one of group 2 the latter; both against float64."""
    device = f"virtual-{get_arch(plans.emulator_arch()).name}"
    arch = get_arch(plans.emulator_arch()).name
    key = PROBLEM.key()
    tuned = best_entry(device, arch, key, 256, "m64_n32_w4_s1")
    classed = BestEntry(dataclasses.replace(tuned.trial, shape_class="g8q4p16"), arch)
    generic = best_entry(device, arch, key, 256, "m64_n64_w4_s1")
    set_dispatcher(Dispatcher(lambda: ListSource([classed, generic])))
    plans.clear_caches()
    rng = random.Random(SEED)
    try:
        for heads, rows, page, tier, block_n in (((8, 1), 4, 16, Tier.EXACT, 32),
                                                 ((4, 2), 1, 16, Tier.NEAREST, 64)):
            shape = Shape(2, heads[0], heads[1], rows, 256)
            probe = DecodeCase(page, (0, 0), 0, 1)
            room = probe.capacity(shape) - rows
            case = DecodeCase(page, (room, rng.randrange(1, room)), rows, 1)
            inputs = DECODE.random_inputs(PROBLEM, shape, "cpu", seed=rng.randrange(1 << 30),
                                          case=case)
            q = inputs.tensors["q"]
            decision, _ = api_decode.decide(q, False, 256, "emulator",
                                            shape_class=ShapeClass.of_call(
                                                heads[0] // heads[1], rows, page).word)
            assert (decision.tier, decision.config.block_n) == (tier, block_n)
            out, lse = call_api(inputs, return_lse=True, backend="emulator")
            assert_close_to_float64(inputs, False, out, lse)
            ran = [p for p in plans._plans.values() if p.source.problem.op == "decode"]
            assert any(p.source.config.block_n == block_n for p in ran), ran
            plans.clear_caches()
    finally:
        set_dispatcher(None)
        plans.clear_caches()


def test_bucket_keys_round_trip_with_a_class() -> None:
    bucket = ProblemBucket(PROBLEM, 4096, "g8q4p16")
    assert bucket.key() == "decode_d64_fp16_full_n4096_g8q4p16"
    assert ProblemBucket.from_key(bucket.key()) == bucket
    assert ProblemBucket.from_key("decode_d64_fp16_full_n4096").shape_class == ""
