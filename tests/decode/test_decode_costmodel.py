"""The decoding cost model: traffic at the minimum for a covering tile, K/V re-read per row
block otherwise, partials only with several splits; bandwidth-bound for long caches,
launch-bound for tiny ones, on the H200's 4.8 TB/s (a PREDICTION, never a measurement)."""

from __future__ import annotations

import pytest

from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families.decode import DECODE
from flashtune.perf.model.decode import HBM_EFFICIENCY, decode_traffic, predict_decode


def test_traffic_is_the_minimum_for_one_split_and_a_covering_tile() -> None:
    problem = Problem(128, DType.BF16, causal=True, op="decode")
    shape = Shape(8, 32, 4, 4, 8192)  # group 8 x 4 query rows = 32 packed rows
    traffic = decode_traffic(problem, KernelConfig(64, 64, 4, 2), shape, 1)
    assert traffic.total == DECODE.min_bytes(problem, shape)
    assert traffic.partials == 0
    split = decode_traffic(problem, KernelConfig(64, 64, 4, 2), shape, 4)
    assert split.kv == traffic.kv and split.partials == 2 * 4 * 8 * 32 * 4 * (4 * 128 + 4)
    reread = decode_traffic(problem, KernelConfig(16, 64, 1, 2), shape, 1)
    assert reread.kv == 2 * traffic.kv  # 32 packed rows in two 16-row blocks


def test_long_caches_are_bandwidth_bound_and_tiny_ones_launch_bound() -> None:
    problem = Problem(128, DType.BF16, causal=True, op="decode")
    long = predict_decode(problem, KernelConfig(64, 64, 4, 2), Shape(64, 32, 8, 1, 131072),
                          8, "H200")
    assert long.bound == "bandwidth"
    assert long.gb_per_s == pytest.approx(4800 * HBM_EFFICIENCY)
    tiny = predict_decode(problem, KernelConfig(64, 64, 4, 2), Shape(1, 32, 8, 1, 64), 1,
                          "H200")
    assert tiny.bound == "launch" and tiny.launches == 1


def test_decode_tuning_times_serving_shapes_and_records_gb_per_s() -> None:
    """A decode bucket's workload spans query rows 1 and 4 and groups 4 and 8; a trial's
    bandwidth figure is the shapes' least bytes over their median times (geometric mean),
    recorded in the trial's attributes beside the time."""
    import math

    from flashtune.codegen.spec import ProblemBucket
    from flashtune.db.records import TrialStatus
    from flashtune.tuner.measure.evaluate import TrialResult
    from flashtune.tuner.measure.workload import make_workload

    problem = Problem(128, DType.BF16, causal=True, op="decode")
    workload = make_workload(ProblemBucket(problem, 4096))
    kinds = {(s.heads_q // s.heads_kv, s.seqlen_q) for s in workload.shapes}
    assert kinds == {(4, 1), (8, 4)}
    times = [0.01 * (i + 1) for i in range(len(workload.shapes))]
    want = math.exp(sum(math.log(DECODE.min_bytes(problem, s) / (t * 1e-3) / 1e9)
                        for s, t in zip(workload.shapes, times, strict=True)) / len(times))
    assert workload.bandwidth(times) == pytest.approx(want)
    result = TrialResult(KernelConfig(64, 64, 4, 2), TrialStatus.OK, tflops=1.0,
                         gb_per_s=want, timings=())
    assert result.attrs()["gb_per_s"] == want
