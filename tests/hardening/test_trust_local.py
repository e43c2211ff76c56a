"""A bundle that names this machine's own device cannot displace what was measured here
(issue: what a hostile or careless user still breaks, "trust"). Regression: the physics
check bounded a bucket by its smallest call (one query row), so an invented 1e-4 ms timing
of this very device passed it, displaced the locally measured 0.05 ms best and was served.
"""

from __future__ import annotations

import random
from datetime import datetime, timezone
from pathlib import Path

import pytest
from dbfactories import CONFIGS, H100, PROBLEMS, trial
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.codegen.spec import ProblemBucket
from flashtune.db import TuningStore, import_bundle, read_bundle, write_bundle
from flashtune.db.bundle import Bundle
from flashtune.db.records import TrialRecord
from flashtune.errors import BundleError
from flashtune.runtime.dispatch import Dispatcher, NamedDevice, Tier

P, N = PROBLEMS[1], 4096
LOCAL, IMPORTED = CONFIGS[1], CONFIGS[2]
THIS = NamedDevice(H100.name, "sm_90", arch_specific_kernels=False)
FIXED = datetime(2026, 6, 1, tzinfo=timezone.utc)


def _bundle(path: Path, trials: list[TrialRecord]) -> Path:
    """A bundle written as-is (no store: what a hostile exporter can write)."""
    write_bundle(Bundle((H100,), tuple(trials), frozenset(t.uid for t in trials), "0.1.0",
                        FIXED), path)
    return path


@pytest.fixture
def local_db(tmp_path: Path) -> Path:
    """This machine's database: the H100's own measurement of P at N, 0.05 ms."""
    path = tmp_path / "local.db"
    with TuningStore(path) as store:
        store.record_device(H100)
        store.record_trial(trial(H100, P, N, LOCAL, median_ms=0.05, rng=random.Random(1)))
    return path


def _served(path: Path) -> str:
    decision = Dispatcher(lambda: TuningStore(path, create=False)).decide(ProblemBucket(P, N),
                                                                         THIS)
    assert decision.tier is Tier.EXACT
    return decision.config.key()


@pytest.mark.parametrize("tflops", [None, 100.0])
def test_a_timing_below_the_buckets_workload_is_refused(tmp_path: Path,
                                                        tflops: float | None) -> None:
    """1e-4 ms is more than moving one query row takes, but doing the bucket's tuning
    workload (3072 x 3072, one head, d=64: 2.4 GFLOP) takes 1.5 us at an H100's bound."""
    invented = trial(H100, P, N, IMPORTED, median_ms=1e-4, rng=random.Random(2),
                     tflops=tflops, host="elsewhere")
    path = _bundle(tmp_path / "invented.json", [invented])
    with pytest.raises(BundleError, match="tuning workload"):
        read_bundle(path)


def test_an_import_never_displaces_a_local_measurement_by_default(
        local_db: Path, tmp_path: Path) -> None:
    faster = trial(H100, P, N, IMPORTED, median_ms=0.02, rng=random.Random(3),
                   host="elsewhere")  # plausible, and faster than ours
    path = _bundle(tmp_path / "faster.json", [faster])
    out = CliRunner(env={"COLUMNS": "250"}).invoke(
        app, ["db", "--db", str(local_db), "import", str(path)])
    assert out.exit_code == 0, out.output
    assert "kept the best measured here" in " ".join(out.output.split())
    assert _served(local_db) == LOCAL.key()
    with TuningStore(local_db, create=False) as store:  # the trial is kept, as data
        assert faster.uid in {t.uid for t in store.trials()}
    # The user says so: an explicit policy lets the import displace it.
    with TuningStore(local_db) as store:
        report = import_bundle(store, read_bundle(path), prefer="faster")
        assert report.updated["best"] == 1 and report.kept_local == 0
    assert _served(local_db) == IMPORTED.key()


def test_imported_results_still_compete_with_each_other(tmp_path: Path) -> None:
    """Only local measurements are protected: a faster import replaces an imported best."""
    slow = trial(H100, P, N, LOCAL, median_ms=0.5, rng=random.Random(5), host="a")
    fast = trial(H100, P, N, IMPORTED, median_ms=0.05, rng=random.Random(6), host="b")
    db = tmp_path / "imports.db"
    with TuningStore(db) as store:
        import_bundle(store, read_bundle(_bundle(tmp_path / "slow.json", [slow])))
        report = import_bundle(store, read_bundle(_bundle(tmp_path / "fast.json", [fast])))
        assert report.updated["best"] == 1 and report.kept_local == 0
    assert _served(db) == IMPORTED.key()


@pytest.mark.parametrize("seqlen", [64, 1024, 16384])
def test_the_compute_floor_never_refuses_a_real_tuning_workload(seqlen: int) -> None:
    """physics.tuned_flops holds its own table (db imports nothing above codegen): every
    family's smallest tuning shape (batch and heads 1x1) has at least that many FLOPs by
    the family's own count, so a real measurement is never below the floor."""
    from flashtune import families
    from flashtune.db import physics
    from flashtune.runtime.precompile import all_problems
    from flashtune.tuner.measure.workload import BatchHeads, make_workload

    for family in families.all_families():
        assert family.op in physics._OPS, f"{family.op}: add it to physics._OPS"
        for problem in all_problems(head_dims=(64, 128), ops=(family.op,)):
            bucket = ProblemBucket(problem, seqlen)
            least = physics.tuned_flops(problem, seqlen)
            assert least is not None
            for shape in make_workload(bucket, [BatchHeads(1, 1)]).shapes:
                assert family.flops(problem, shape) >= least * (1 - 1e-12), (bucket, shape)
