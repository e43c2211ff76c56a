"""GPU tier: a short real tuning run whose winner the dispatcher then serves."""

from __future__ import annotations

import math

import pytest
import torch

from flashtune.codegen.spec import DType, Problem
from flashtune.db.store import TuningStore
from flashtune.runtime.device import DeviceInfo
from flashtune.runtime.dispatch import Dispatcher, Tier
from flashtune.tuner.driver import tune
from flashtune.tuner.measure.base import TimingPlan
from flashtune.tuner.measure.factory import make_measurer
from flashtune.tuner.options import TuneOptions

pytestmark = pytest.mark.gpu


def test_short_tuning_run_on_the_gpu_is_served_by_the_dispatcher(db_url: str) -> None:
    options = TuneOptions(trials=4, sampler="tpe", compile_workers=2,
                          plan=TimingPlan(warmup=2, repeats=10),
                          final_plan=TimingPlan(warmup=2, repeats=20), final_top=2,
                          final_rounds=2)
    measurer = make_measurer("cuda")
    [summary] = tune(128, "bf16", False, [2048], measurer=measurer, db=db_url, options=options)
    assert summary.winner is not None and summary.winner_tflops is not None
    # a plausible rate: positive and below any GPU's dense bf16 peak
    assert 1.0 < summary.winner_tflops < 2000.0
    with TuningStore(db_url) as store:
        best = store.best(measurer.device.name, Problem(128, DType.BF16).key(), 2048)
        trials = store.trials(device=measurer.device.name)
    assert best is not None and best.config.key == summary.winner.key()
    assert best.trial.tflops is not None and math.isfinite(best.trial.tflops)
    assert all(t.status.value != "ok" or t.count >= 10 for t in trials)

    dispatcher = Dispatcher(lambda: TuningStore(db_url, create=False))
    bucket = Problem(128, DType.BF16).bucket(1500, 1500)  # same bucket as 2048
    decision = dispatcher.decide(bucket, DeviceInfo.current())
    assert decision.tier is Tier.EXACT
    assert decision.config == summary.winner
    torch.cuda.synchronize()
