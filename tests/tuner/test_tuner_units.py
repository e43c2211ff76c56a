"""Unit tests of the tuner's pure parts: workload, objective, encoding, selection, naming."""

from __future__ import annotations

import math
import random
from pathlib import Path

import optuna
import pytest

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.params import Param, ParamSpace
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.db.records import TrialStatus
from flashtune.errors import InvalidConfig, TuningError
from flashtune.families.fwd import FORWARD, space
from flashtune.tuner.landscape import parse_budget
from flashtune.tuner.measure.base import ShapeTiming
from flashtune.tuner.measure.evaluate import TrialResult
from flashtune.tuner.measure.workload import (
    BatchHeads,
    geomean,
    make_workload,
    parse_batch_heads,
    parse_seqlens,
)
from flashtune.tuner.search.encoding import SearchEncoding
from flashtune.tuner.search.selection import Scored, choose
from flashtune.tuner.search.space import SearchSpace
from flashtune.tuner.search.study import study_name, templates_digest

P = Problem(128, DType.BF16)
ARCH = get_arch("sm_90")


def test_flops_follow_the_fields_formula_halved_when_causal() -> None:
    shape = Shape(2, 16, 16, 4096, 4096)
    assert families.of(P).flops(P, shape) == 4 * 2 * 4096 * 4096 * 16 * 128
    causal = Problem(128, DType.BF16, causal=True)
    assert families.of(causal).flops(causal, shape) == families.of(P).flops(P, shape) / 2


def test_objective_is_the_geometric_mean_of_tflops() -> None:
    workload = make_workload(P.bucket(4096, 4096))
    times = [random.uniform(0.5, 5.0) for _ in workload.shapes]
    per_shape = [families.of(P).flops(P, s) / (t * 1e-3) / 1e12
                 for s, t in zip(workload.shapes, times, strict=True)]
    expected = math.prod(per_shape) ** (1 / len(per_shape))
    assert workload.objective(times) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(TuningError):
        workload.objective(times[:-1])
    with pytest.raises(TuningError):
        geomean([1.0, 0.0])


def test_representative_shapes_cover_the_bucket() -> None:
    workload = make_workload(P.bucket(3000, 3000))
    assert workload.bucket.seqlen == 4096
    lengths = sorted({s.seqlen_q for s in workload.shapes})
    assert lengths == [3072, 4096]  # 3/4 N and N: both inside the bucket (N/2, N]
    for s in workload.shapes:  # the standard sweep: hidden 2048, ~16k tokens
        assert s.heads_q * P.head_dim == 2048 and s.batch == max(1, 16384 // s.seqlen_q)
    assert workload.verify_shape.seqlen_q % 16 != 0  # partial tiles are verified
    custom = make_workload(P.bucket(1024, 1024), parse_batch_heads("4x8,1x32"))
    assert {(s.batch, s.heads_q) for s in custom.shapes} == {(4, 8), (1, 32)}


def test_parsers() -> None:
    assert parse_seqlens("1024, 4k,16384") == (1024, 4096, 16384)
    assert parse_batch_heads("2x16") == (BatchHeads(2, 16),)
    assert parse_budget("20m") == 1200 and parse_budget("1h30m") == 5400
    assert parse_budget("90") == 90
    for bad in ("abc", "1024,x", "0"):
        with pytest.raises(TuningError):
            parse_seqlens(bad)
    for bad in ("", "20x", "m20", "5%"):  # a share needs a landscape (--replay)
        with pytest.raises(TuningError):
            parse_budget(bad)
    with pytest.raises(TuningError):
        BatchHeads.parse("4*")


def test_encoding_presents_each_parameter_as_the_index_of_its_value() -> None:
    encoding = SearchEncoding(P, ARCH)
    dists = encoding.distributions()
    for param in FORWARD.space(P).params:
        dist = dists[param.name]
        assert isinstance(dist, optuna.distributions.IntDistribution)
        assert (dist.low, dist.high, dist.step) == (0, len(param.values) - 1, 1)
    config = encoding.candidates()[0]
    encoded = encoding.encode(config)
    assert {n: FORWARD.space(P)[n].values[i] for n, i in encoded.items()} == \
        FORWARD.point(config)


def test_named_modes_are_ranked_in_declared_order() -> None:
    modes = SearchSpace(ParamSpace((Param("dqmode", ("atomic", "split")),
                                    Param("block_n", (32, 64)))), lambda point: None)
    assert modes.encode({"dqmode": "split", "block_n": 32}) == {"dqmode": 1, "block_n": 0}
    assert modes.decode({"dqmode": 0, "block_n": 1}) == {"dqmode": "atomic", "block_n": 64}
    with pytest.raises(InvalidConfig):
        modes.encode({"dqmode": "ordered", "block_n": 32})
    with pytest.raises(InvalidConfig):
        ParamSpace((Param("dqmode", ("split", "split")),))


def test_encoding_round_trips_every_candidate_and_rejects_the_rest() -> None:
    encoding = SearchEncoding(P, ARCH)
    candidates = encoding.candidates()
    assert candidates == FORWARD.candidates(P, ARCH)
    for config in candidates:
        assert encoding.decode(encoding.encode(config)) == config
    legal = set(candidates)
    impossible = [c for c in encoding.space() if c not in legal]
    for config in impossible[::max(1, len(impossible) // 2000)]:  # ~2000 spread over them
        reason = encoding.decode(encoding.encode(config))
        assert isinstance(reason, str) and reason == space.static_check(P, config, ARCH)
    # combinations KernelConfig itself refuses (64 rows over 8 warps) decode to a reason
    raw = {"block_m": 0, "block_n": 1, "num_warps": 1, "num_stages": 1}  # m64 over 8 warps
    assert isinstance(encoding.decode(raw), str)
    assert "outside" in str(encoding.decode({**raw, "block_n": 7}))
    dists = encoding.distributions()
    assert all(isinstance(d, optuna.distributions.IntDistribution) for d in dists.values())


def _scored(config: KernelConfig, tflops: float, default: bool = False) -> Scored:
    shape = Shape(1, 1, 1, 64, 64)
    timing = ShapeTiming(shape, 1.0, 1.0, 1.0, 1)
    return Scored(TrialResult(config, TrialStatus.OK, timings=(timing,), tflops=tflops),
                  default)


def test_choose_prefers_default_then_simplest_within_tolerance() -> None:
    workload = make_workload(P.bucket(1024, 1024))
    big = KernelConfig(128, 128, 8, 3)
    small = KernelConfig(64, 64, 4, 2)
    default = KernelConfig(128, 64, 4, 2)
    # a clear winner wins
    assert choose(workload, [_scored(big, 300), _scored(small, 250)]).config == big
    # within 2 %: the default, whatever the order
    tied = [_scored(big, 300), _scored(default, 295, default=True), _scored(small, 296)]
    for order in (tied, tied[::-1]):
        assert choose(workload, order).config == default
    # within 2 % and no default among them: the least shared memory
    tied = [_scored(big, 300), _scored(small, 297)]
    assert choose(workload, tied).config == small
    assert choose(workload, tied, tolerance=0.0).config == big
    with pytest.raises(TuningError):
        choose(workload, [])


def test_study_names_separate_devices_buckets_and_template_digests() -> None:
    digest = templates_digest()
    assert len(digest) == 64 and digest == templates_digest()
    a = study_name("NVIDIA H200", P.bucket(1024, 1024), digest)
    assert a == f"flashtune/NVIDIA-H200/fwd_d128_bf16_full_n1024/{digest[:12]}"
    assert a != study_name("NVIDIA H200", P.bucket(4096, 4096), digest)
    assert a != study_name("NVIDIA H200", P.bucket(1024, 1024), "f" * 64)
    assert study_name("x", P.bucket(64, 64), digest, "mine") == "mine/fwd_d128_bf16_full_n64"
    with pytest.raises(TuningError):
        study_name("x", P.bucket(64, 64), digest, "bad name!")


def test_progress_tables_and_database_summaries(tmp_path: Path) -> None:
    from collections import Counter

    from rich.console import Console

    from flashtune.commands.tune_progress import final_table, live_table
    from flashtune.db.records import Keyed, TrialRecord
    from flashtune.tuner.options import BucketSummary
    from flashtune.tuner.results import summarize_records

    bucket = P.bucket(1024, 1024)
    best, default = KernelConfig(128, 64, 4, 2), KernelConfig(64, 64, 4, 2)
    summary = BucketSummary(bucket, "s", 20, measured=3,
                            statuses=Counter({"ok": 2, "wrong_result": 1}),
                            winner=best, winner_tflops=330.0, default=default,
                            default_tflops=300.0)
    console = Console(width=200, record=True, file=(tmp_path / "out.txt").open("w"))
    console.print(final_table([summary]))
    console.print(live_table([summary], budget=10))
    text = console.export_text()
    assert "m128_n64_w4_s2" in text and "1.10x" in text and "wrong_result 1" in text

    def record(config: KernelConfig, status: str, ms: float | None) -> TrialRecord:
        timed = ms is not None
        return TrialRecord(device="gpu", problem=Keyed.of(P), seqlen=1024,
                           config=Keyed.of(config), status=TrialStatus(status),
                           template_digest="ab" * 8, median_ms=ms, min_ms=ms, max_ms=ms,
                           count=1 if timed else 0, tflops=100.0 / ms if ms else None,
                           error=None if timed else "x")

    rows = [record(best, "ok", 0.5), record(default, "ok", 1.0),
            record(KernelConfig(64, 32, 4, 1), "compile_failed", None)]
    filled = summarize_records(BucketSummary(bucket, "s", 20), rows)
    assert filled.measured == 3 and filled.statuses["compile_failed"] == 1
    assert filled.best_config == best and filled.best_tflops == pytest.approx(200.0)
