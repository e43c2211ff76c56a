"""Several processes on one study, a worker killed with SIGKILL then resumed, concurrent
dry runs, and workers that die with their parent."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy as sa
from tuner_synthetic import DEVICE, read_log
from tuner_testlib import FAST, subprocess_env, tile_space

from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, Problem
from flashtune.db.store import TuningStore
from flashtune.tuner.search.encoding import SearchEncoding
from flashtune.tuner.search.proposers import CONFIG_ATTR, DUPLICATE_ATTR
from flashtune.tuner.workers import (
    WorkerSpec,
    run_spec,
    run_workers,
    start_worker,
    tune_parallel,
)

PROBLEM = Problem(128, DType.BF16)
with tile_space():
    CANDIDATES = {c.key() for c in SearchEncoding(PROBLEM, get_arch("sm_90")).candidates()}
PG_URL = os.environ.get("FLASHTUNE_TEST_PG_URL")


def spec_for(db: str, log: str, **measurer: object) -> WorkerSpec:
    opts = dataclasses.replace(FAST, trials=len(CANDIDATES), sampler="tpe")
    return WorkerSpec(head_dim=128, dtype="bf16", causal=False, op="fwd", seqlens=(1024,), db=db,
                      measurer="tuner_synthetic:synthetic_measurer",
                      measurer_options={"log_path": log, **measurer}, options=opts)


def measured_configs(db: str) -> Counter[str]:
    [summary] = optuna.get_all_study_summaries(db)
    study = optuna.load_study(study_name=summary.study_name, storage=db)
    return Counter(t.user_attrs[CONFIG_ATTR] for t in study.get_trials(deepcopy=False)
                   if t.state is optuna.trial.TrialState.COMPLETE
                   and DUPLICATE_ATTR not in t.user_attrs)


def check_shared_study(db: str, log: str, workers: int) -> None:
    calls = read_log(log)
    pids = {pid for pid, phase, _ in calls if phase == "time"}
    # the search workers and the one that re-measures the finalists
    assert len(pids) == workers + 1, f"expected {workers} workers + 1, got pids {pids}"
    # the search measured every candidate exactly once across all workers ...
    done = measured_configs(db)
    assert set(done) == CANDIDATES and max(done.values()) == 1, done
    # ... and the final re-measurement ran once, in one process after the workers
    with TuningStore(db) as store:
        best = store.best(DEVICE.name, PROBLEM.key(), 1024)
        invalid = [t for t in store.trials(device=DEVICE.name) if t.status.value == "invalid"]
    assert best is not None
    # statically impossible configs are never written (counted in each summary only)
    assert invalid == []


def test_a_worker_spec_carries_the_problem_features(db_url: str, call_log: str) -> None:
    spec = dataclasses.replace(spec_for(db_url, call_log), features=("window", "alibi"))
    again = WorkerSpec.from_json(spec.to_json())
    assert again == spec
    assert again.problem.key() == "fwd_d128_bf16_local_alibi"


def test_concurrent_dry_runs_verify_each_config_once(db_url: str, call_log: str) -> None:
    spec = spec_for(db_url, call_log, is_timed=False, verify_delay_s=0.05)
    run_workers(spec, 2, env=subprocess_env(), poll_interval_s=0.2)
    verified = [(pid, key) for pid, phase, key in read_log(call_log) if phase == "verify"]
    assert len({pid for pid, _ in verified}) == 2, "both dry runs must have verified configs"
    counts = Counter(key for _, key in verified)
    assert set(counts) == CANDIDATES and max(counts.values()) == 1, counts
    with TuningStore(db_url) as store:
        rows = [t for t in store.trials(device=DEVICE.name) if t.status.value != "invalid"]
    assert sorted(t.config.key for t in rows) == sorted(CANDIDATES)


def test_several_workers_share_one_study_on_sqlite(db_url: str, call_log: str) -> None:
    """Through tune_parallel (what `tune --workers` runs): the bucket's summary also counts
    the configs the static rules excluded, which no worker writes."""
    arch = get_arch("sm_90")
    with tile_space():
        static = SearchEncoding(PROBLEM, arch).static_rejections()
        [summary] = tune_parallel(spec_for(db_url, call_log, time_delay_s=0.05, min_workers=3),
                                  3, device=DEVICE.name, arch=arch, env=subprocess_env(),
                                  poll_interval_s=0.2)
    check_shared_study(db_url, call_log, 3)
    assert static > 0 and summary.statuses["invalid (static)"] == static, summary.statuses
    assert summary.winner is not None


@pytest.fixture
def pg_url() -> Iterator[str]:
    if not PG_URL:
        pytest.skip("FLASHTUNE_TEST_PG_URL is not set: PostgreSQL worker test SKIPPED "
                    "(start a server with `source <(bash .ci/postgres.sh)`)")
    # a fresh schema per test keeps studies apart on the shared server
    schema = f"t_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(PG_URL)
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    engine.dispose()
    sep = "&" if "?" in PG_URL else "?"
    yield f"{PG_URL}{sep}options=-csearch_path%3D{schema}"
    engine = sa.create_engine(PG_URL)
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
    engine.dispose()


@pytest.mark.postgres
def test_several_workers_share_one_study_on_postgresql(pg_url: str, call_log: str) -> None:
    run_workers(spec_for(pg_url, call_log, time_delay_s=0.05, min_workers=3), 3,
                env=subprocess_env(),
                poll_interval_s=0.2)
    check_shared_study(pg_url, call_log, 3)


def test_sigkill_mid_study_then_resume(db_url: str, call_log: str, tmp_path: Path) -> None:
    spec = spec_for(db_url, call_log, time_delay_s=0.3)
    proc = start_worker(spec, subprocess_env())
    try:
        deadline = time.monotonic() + 120
        while sum(phase == "time" for _, phase, _ in read_log(call_log)) < 3:
            assert proc.poll() is None, "the worker ended before it could be killed"
            assert time.monotonic() < deadline, "the worker measured nothing in 120 s"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    before = measured_configs(db_url)
    assert 2 <= sum(before.values()) < len(CANDIDATES)
    # resume in this process: the killed worker's running trial is reaped at once (its
    # pid is dead) and its config measured again; everything else exactly once
    resumed = dataclasses.replace(spec, options=dataclasses.replace(spec.options, resume=True),
                                  measurer_options={"log_path": call_log})
    [summary] = run_spec(resumed)
    done = measured_configs(db_url)
    assert set(done) == CANDIDATES and max(done.values()) == 1
    # the killed worker lost at most the one trial it was measuring
    killed = {k for pid, phase, k in read_log(call_log) if pid == proc.pid and phase == "time"}
    assert len(killed - set(before)) <= 1
    assert summary.winner is not None


def _gone(pid: int) -> bool:
    """The process is gone or a zombie (a dead worker nobody has reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_workers_die_with_the_process_that_started_them(db_url: str, call_log: str,
                                                        tmp_path: Path) -> None:
    spec = spec_for(db_url, call_log, time_delay_s=60.0)
    parent = tmp_path / "parent.py"
    parent.write_text(
        "import sys, time\n"
        "from flashtune.tuner.workers import WorkerSpec, start_worker\n"
        "worker = start_worker(WorkerSpec.from_json(sys.argv[1]))\n"
        "print(worker.pid, flush=True)\n"
        "time.sleep(600)\n")
    env = {**os.environ, **subprocess_env()}
    proc = subprocess.Popen([sys.executable, str(parent), spec.to_json()], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        worker = int(proc.stdout.readline())
        deadline = time.monotonic() + 120
        while not any(phase == "time" for _, phase, _ in read_log(call_log)):
            assert not _gone(worker), "the worker ended before its parent was killed"
            assert time.monotonic() < deadline, "the worker measured nothing in 120 s"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    deadline = time.monotonic() + 30
    while not _gone(worker):
        assert time.monotonic() < deadline, f"worker {worker} outlived its killed parent"
        time.sleep(0.05)


def test_the_database_url_is_never_on_a_workers_command_line(
        monkeypatch: pytest.MonkeyPatch, call_log: str) -> None:
    """A PostgreSQL URL (password included) reaches a worker through its environment, which
    only its owner can read, not through its command line (``ps``, /proc/PID/cmdline); the
    worker takes it out of its environment before it starts anything."""
    from flashtune.tuner import workers

    url = "postgresql://tuner:s3cret-pw@db.example:5432/tuning"
    started: list[tuple[list[str], dict[str, str]]] = []

    def popen(argv: list[str], env: dict[str, str]) -> Any:
        started.append((argv, env))
        return None

    monkeypatch.setattr(subprocess, "Popen", popen)  # what workers calls
    start_worker(spec_for(url, call_log), {"CUDA_VISIBLE_DEVICES": "1"})
    [(argv, env)] = started
    assert not any("s3cret-pw" in arg or "db.example" in arg for arg in argv), argv
    assert env[workers.WORKER_DB_ENV] == url and env["CUDA_VISIBLE_DEVICES"] == "1"

    ran: list[WorkerSpec] = []
    monkeypatch.setattr(workers, "run_spec", ran.append)
    monkeypatch.setenv(workers.WORKER_DB_ENV, url)
    assert workers.main(argv[4:]) == 0  # the spec (not the parent-death flag: pytest's own)
    assert ran[0] == spec_for(url, call_log)
    assert workers.WORKER_DB_ENV not in os.environ


def test_a_resumed_dry_run_continues_to_its_trials_in_total(db_url: str,
                                                           call_log: str) -> None:
    """--trials N is the bucket's total for --resume, as in a timed study: a finished dry
    run resumed verifies nothing more, a larger N continues up to N; a run without
    --resume verifies N configs not verified yet."""
    spec = spec_for(db_url, call_log, is_timed=False)

    def run(trials: int, resume: bool) -> int:
        before = len([1 for _, phase, _ in read_log(call_log) if phase == "verify"])
        run_spec(spec.with_options(trials=trials, resume=resume))
        verified = [key for _, phase, key in read_log(call_log) if phase == "verify"]
        assert len(set(verified)) == len(verified), "a config was verified twice"
        return len(verified) - before

    assert run(3, False) == 3
    assert run(3, True) == 0  # finished: --resume continues to 3, not 3 more
    assert run(5, True) == 2
    assert run(2, False) == 2  # without --resume: 2 more
