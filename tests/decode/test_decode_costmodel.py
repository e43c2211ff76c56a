"""The decoding cost model: traffic at the minimum for a covering tile, K/V re-read per row
block otherwise, partials only with several splits; bandwidth-bound for long caches,
launch-bound for tiny ones, on the H200's 4.8 TB/s (a PREDICTION, never a measurement)."""

from __future__ import annotations

import pytest

from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families.decode import DECODE
from flashtune.perf.model.decode import HBM_EFFICIENCY, decode_traffic, predict_decode


@pytest.mark.parametrize("dims", [(128, 128), (192, 128)], ids=["d128", "d192v128"])
def test_traffic_is_the_minimum_for_one_split_and_a_covering_tile(dims: tuple[int, int]
                                                                   ) -> None:
    d, dv = dims
    problem = Problem(d, DType.BF16, causal=True, op="decode",
                      head_dim_v=None if dv == d else dv)
    shape = Shape(8, 32, 4, 4, 8192)  # group 8 x 4 query rows = 32 packed rows
    traffic = decode_traffic(problem, KernelConfig(64, 64, 4, 2), shape, 1)
    assert traffic.total == DECODE.min_bytes(problem, shape)
    assert traffic.partials == 0
    split = decode_traffic(problem, KernelConfig(64, 64, 4, 2), shape, 4)
    assert split.kv == traffic.kv and split.partials == 2 * 4 * 8 * 32 * 4 * (4 * dv + 4)
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


@pytest.mark.emulator
@pytest.mark.parametrize("page", [None, 16])
def test_window_buckets_are_timed_and_charged_with_the_timing_window(page: int | None
                                                                      ) -> None:
    """A tuning run times a window decode problem with ``timing_window`` (a quarter of the
    cache to the left), and the model charges the key tiles the kernel then reads: the
    emulator's cp.async bytes of that call equal ``decode_traffic``'s K/V and Q bytes (one
    split, a tile covering the packed rows), a fraction of the unbounded call's."""
    import os

    from flashtune import families
    from flashtune.codegen.arch import get_arch
    from flashtune.families.base import Inputs, timing_window
    from flashtune.families.decode import DecodeCase
    from flashtune.families.decode.space import covering_config
    from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions
    from flashtune.runtime.launch import prepare

    shape = Shape(1, 4, 1, 2, 300)
    window = Problem(64, DType.FP16, window=True, op="decode")
    timed = DECODE.timing_inputs(window, shape, "cpu", "g4q2p16")
    assert (timed.scalars["window_left"], timed.scalars["window_right"]) == (75, 0)
    assert "window_left" not in DECODE.timing_inputs(
        Problem(64, DType.FP16, op="decode"), shape, "cpu", "g4q2p16").scalars

    arch = get_arch("sm_90")
    config = covering_config(window, DECODE.default_config(window, arch), 8, arch)
    case = DecodeCase(page, (298,), 2, 1)
    drawn = DECODE.random_inputs(window, shape, "cpu", case=case,
                                 seed=int(os.environ["FLASHTUNE_TEST_SEED"]))
    left, right = timing_window(shape)
    inputs = Inputs(drawn.tensors, {**drawn.scalars, "window_left": left,
                                    "window_right": right})
    kernel = EmulatorBackend(options=LaunchOptions(counters=True)).load(
        families.render(window, config))
    launch = prepare(kernel, shape, "cpu", inputs=inputs, poison=True)
    launch.run()
    verdict = launch.verdict()
    got = kernel.last_counters
    assert got is not None and verdict.ok, verdict.message
    traffic = decode_traffic(window, config, shape, 1)
    assert got.cp_async_bytes == traffic.kv + traffic.q, (got.cp_async_bytes, traffic)
    full = decode_traffic(Problem(64, DType.FP16, op="decode"), config, shape, 1)
    assert traffic.kv < full.kv * 0.6  # 172 of 300 keys: tiles from key 128 on
    assert DECODE.min_bytes(window, shape) <= traffic.total
