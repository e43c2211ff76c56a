"""The cost model in the tuner: predictions recorded beside measurements, the predicted
order of the first candidates, pruning by prediction, the dry run's predicted ranking and
the rank correlation command."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from rich.console import Console
from tuner_synthetic import DEVICE, SyntheticMeasurer, read_log
from tuner_testlib import FAST, tile_space
from typer.testing import CliRunner

from flashtune import families
from flashtune.cli import app
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.commands.tune_progress import predicted_tables
from flashtune.db.records import DeviceRecord, Keyed, TrialRecord, TrialStatus
from flashtune.db.store import TuningStore
from flashtune.families.fwd import FORWARD
from flashtune.perf import predict
from flashtune.tuner.driver import tune
from flashtune.tuner.measure.workload import make_workload
from flashtune.tuner.results import source_digest
from flashtune.tuner.search.encoding import SearchEncoding
from flashtune.tuner.search.prediction import resolve_gpu

PROBLEM = Problem(128, DType.BF16)
with tile_space():
    CANDIDATES = SearchEncoding(PROBLEM, get_arch("sm_90")).candidates()
DEFAULT = KernelConfig(64, 64, 4, 2)
runner = CliRunner()


@pytest.fixture(autouse=True)
def fixed_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FORWARD, "default_config", lambda problem, arch: DEFAULT)


def reference_ms(config: KernelConfig, seqlen: int = 1024) -> float | None:
    """Geometric mean over the bucket's shapes of the model's per-shape predictions on H100,
    computed here from the model directly (None when no block fits)."""
    shapes = make_workload(PROBLEM.bucket(seqlen, seqlen)).shapes
    try:
        times = [predict(PROBLEM, config, s, "H100").time_ms for s in shapes]
    except Exception:
        return None
    return math.exp(sum(math.log(t) for t in times) / len(times))


def ranked_reference() -> list[KernelConfig]:
    found = [(reference_ms(c), c) for c in CANDIDATES]
    return [c for t, c in sorted(((t, c) for t, c in found if t is not None),
                                 key=lambda tc: tc[0])]


def test_gpu_of_a_device_by_name_arch_and_sm_count() -> None:
    def dev(name: str, sms: int, cc: tuple[int, int] = (9, 0)) -> DeviceRecord:
        return DeviceRecord(name, cc[0], cc[1], sms, 80 << 30, "0", "0", "0", "0")

    found = resolve_gpu(dev("NVIDIA H100 80GB HBM3", 132))
    assert found is not None and found.name == "H100"
    rtx = resolve_gpu(dev("NVIDIA GeForce RTX 4090", 128, (8, 9)))
    assert rtx is not None and rtx.name == "RTX4090"
    assert resolve_gpu(dev("NVIDIA H100 PCIe", 114)) is None  # another product
    assert resolve_gpu(DEVICE) is None                        # the synthetic fixture
    virtual = resolve_gpu(dev("virtual-sm_90", 1))
    assert virtual is not None and virtual.name == "H100"     # the arch's reference GPU
    override = resolve_gpu(DEVICE, "H200")
    assert override is not None and override.name == "H200"


def test_predictions_are_recorded_and_the_best_predicted_are_measured_first(
        db_url: str, call_log: str) -> None:
    measurer = SyntheticMeasurer(log_path=call_log)
    opts = dataclasses.replace(FAST, trials=8, cost_model_gpu="H100", sampler="random")
    [summary] = tune(128, "bf16", False, [1024], measurer=measurer, db=db_url, options=opts)
    assert summary.cost_model is not None and "H100" in summary.cost_model
    compiled = [key for _, phase, key in read_log(call_log) if phase == "compile"]
    expected = [DEFAULT.key()] + [c.key() for c in ranked_reference() if c != DEFAULT][:3]
    assert compiled[:4] == expected
    with TuningStore(db_url) as store:
        trials = [t for t in store.trials(device=DEVICE.name)
                  if "static" not in (t.error or "") and t.config.key in
                  {c.key() for c in CANDIDATES}]
    assert len(trials) >= 8
    for t in trials:
        ref = reference_ms(KernelConfig.from_key(t.config.key))
        assert ref is not None and t.predicted_ms == pytest.approx(ref, rel=1e-9)


def test_without_a_known_gpu_nothing_is_predicted(db_url: str) -> None:
    opts = dataclasses.replace(FAST, trials=4, final_top=1, final_rounds=1)
    [summary] = tune(128, "bf16", False, [1024], measurer=SyntheticMeasurer(), db=db_url,
                     options=opts)
    assert summary.cost_model is None
    with TuningStore(db_url) as store:
        assert all(t.predicted_ms is None for t in store.trials(device=DEVICE.name))


def test_prune_predicted_skips_hopeless_configs_without_recording_failures(
        db_url: str, call_log: str) -> None:
    factor = 1.3
    ranked = ranked_reference()
    best = reference_ms(ranked[0])
    assert best is not None
    hopeless = {c.key() for c in ranked
                if c != DEFAULT and (reference_ms(c) or 0.0) > factor * best}
    assert 0 < len(hopeless) < len(CANDIDATES) - 1, "the factor must split the candidates"
    opts = dataclasses.replace(FAST, trials=len(CANDIDATES), cost_model_gpu="H100",
                               prune_predicted=factor, final_top=1, final_rounds=1)
    measurer = SyntheticMeasurer(log_path=call_log)
    [summary] = tune(128, "bf16", False, [1024], measurer=measurer, db=db_url, options=opts)
    assert summary.pruned_by_model == len(hopeless)
    compiled = {key for _, phase, key in read_log(call_log) if phase == "compile"}
    assert not compiled & hopeless
    assert DEFAULT.key() in compiled
    with TuningStore(db_url) as store:
        recorded = {t.config.key for t in store.trials(device=DEVICE.name)}
        failed = store.failed_configs(DEVICE.name, PROBLEM.key(), 1024)
    assert not recorded & hopeless and not failed & hopeless
    # not permanent: the same study resumed without pruning measures them
    again = dataclasses.replace(opts, prune_predicted=None, resume=True)
    tune(128, "bf16", False, [1024], measurer=measurer, db=db_url, options=again)
    compiled = {key for _, phase, key in read_log(call_log) if phase == "compile"}
    assert hopeless <= compiled


def test_dry_run_reports_a_labelled_predicted_ranking(db_url: str) -> None:
    measurer = SyntheticMeasurer(is_timed=False, wrong=frozenset({CANDIDATES[1].key()}))
    opts = dataclasses.replace(FAST, trials=6, cost_model_gpu="H100")
    summaries = tune(128, "bf16", False, [1024], measurer=measurer, db=db_url, options=opts)
    [table] = predicted_tables(summaries)
    console = Console(record=True, width=200)
    console.print(table)
    text = console.export_text()
    assert "PREDICTED ranking" in text and "not a measurement" in text and "H100" in text
    rows = [line.split("│") for line in text.splitlines() if "│" in line]
    keys = [r[2].strip() for r in rows if r[2].strip() and r[2].strip() != "config"]
    times = [float(r[3]) for r in rows if r[2].strip() and r[2].strip() != "config"]
    assert times == sorted(times) and len(keys) == len(summaries[0].predicted)
    assert CANDIDATES[1].key() not in keys  # only configs that verified are ranked
    for key, ms in zip(keys, times, strict=True):
        ref = reference_ms(KernelConfig.from_key(key))
        assert ref is not None and ms == pytest.approx(ref, rel=1e-3)


def _seed(store: TuningStore, seqlen: int, predicted: list[float], measured: list[float]
          ) -> None:
    store.record_device(DEVICE)
    for config, p, m in zip(CANDIDATES, predicted, measured, strict=False):
        store.record_trial(TrialRecord(
            device=DEVICE.name, problem=Keyed.of(PROBLEM), seqlen=seqlen, config=Keyed.of(config),
            status=TrialStatus.OK, template_digest=source_digest(PROBLEM, config),
            median_ms=m, min_ms=m, max_ms=m, count=1,
            tflops=families.of(PROBLEM).flops(
                PROBLEM, make_workload(PROBLEM.bucket(seqlen, seqlen)).shapes[0]) / m / 1e9,
            predicted_ms=p))


def test_correlate_reports_rho_per_bucket_and_overall(db_url: str) -> None:
    rng = random.Random()
    n = 6
    predicted = [rng.uniform(0.1, 5.0) for _ in range(n)]
    with TuningStore(db_url) as store:
        # Times a GPU can reach (the database refuses faster than physics allows).
        _seed(store, 1024, predicted, [2.0 * p ** 1.7 + 0.2 for p in predicted])  # rho = 1
        _seed(store, 4096, predicted, [10.0 / p for p in predicted])              # rho = -1
        _seed(store, 16384, predicted[:2], [20.0 + p for p in predicted[:2]])  # too few: left out
    result = runner.invoke(app, ["correlate", "--db", db_url])
    assert result.exit_code == 0, result.output
    lines = {line.split("│")[3].strip(): line for line in result.output.splitlines()
             if line.count("│") >= 5 and line.split("│")[3].strip().isdigit()}
    assert set(lines) == {"1024", "4096"}
    assert "+1.000" in lines["1024"] and f"│ {n} " in lines["1024"]
    assert "-1.000" in lines["4096"]
    assert f"n={2 * n}): +0.000" in " ".join(result.output.split())


def test_correlate_says_when_there_are_no_measurements(db_url: str) -> None:
    with TuningStore(db_url) as store:
        store.record_device(DEVICE)
    result = runner.invoke(app, ["correlate", "--db", db_url])
    assert result.exit_code == 0, result.output
    assert "no GPU measurements in this database yet" in " ".join(result.output.split())
