"""Concurrent writers on one SQLite file, and writers killed in the middle of a transaction.

Workers are forked: the parent opens no database before forking, so no connection is shared,
and forking avoids re-importing flashtune in every worker on a 2-core machine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import sqlite3
import time
import traceback
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path

import pytest
from dbfactories import CONFIGS, DEVICES, H100, PROBLEMS, expected_best, random_trials, trial

from flashtune.db import TrialRecord, TuningStore, session_scope
from flashtune.db.engine import sqlite_pragmas
from flashtune.db.rows import Writer

WORKERS = 8
PER_WORKER = 40
BATCH = 7

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
_fork = mp.get_context("fork") if hasattr(os, "fork") else None


def _writer(path: str, trials: list[TrialRecord], barrier: Barrier,
            errors: Queue[str]) -> None:
    try:
        barrier.wait()          # all workers open the (new) database at the same moment
        with TuningStore(path) as store:
            for device in DEVICES:
                store.record_device(device)
            for t in trials:
                store.record_trial(t)
    except BaseException:
        errors.put(traceback.format_exc())


def test_eight_processes_write_at_once_and_lose_nothing(tmp_path: Path,
                                                        rng: random.Random) -> None:
    assert _fork is not None
    path = str(tmp_path / "shared.db")
    work = [random_trials(rng, PER_WORKER) for _ in range(WORKERS)]
    barrier = _fork.Barrier(WORKERS)
    errors: Queue[str] = _fork.Queue()
    procs = [_fork.Process(target=_writer, args=(path, trials, barrier, errors))
             for trials in work]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, f"worker exit code {p.exitcode}"
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, "\n".join(failures)       # no "database is locked", nothing else

    everything = [t for trials in work for t in trials]
    with TuningStore(path) as store:
        stored = store.trials()
        assert len(stored) == WORKERS * PER_WORKER
        assert {t.uid for t in stored} == {t.uid for t in everything}
        best = {(e.device, e.problem, e.seqlen): e.trial.uid for e in store.all_best()}
        assert best == expected_best(everything)
    _assert_intact(path)


def _assert_intact(path: str) -> None:
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []


def _hold_open_transaction(path: str, trials: list[TrialRecord], ready: Event) -> None:
    store = TuningStore(path)
    with session_scope(store.engine, write=True, action="test") as session:
        writer = Writer(session)
        for t in trials:
            writer.offer_best(writer.trial(t), replace="faster")
        session.flush()
        ready.set()
        time.sleep(120)     # killed here, with the write lock held and rows uncommitted


def test_writer_killed_mid_transaction_leaves_a_consistent_database(
        tmp_path: Path, rng: random.Random) -> None:
    assert _fork is not None
    path = str(tmp_path / "killed.db")
    committed = trial(H100, PROBLEMS[0], 1024, CONFIGS[0], median_ms=3.0, rng=rng)
    with TuningStore(path) as store:
        for device in DEVICES:
            store.record_device(device)
        store.record_trial(committed)
    pending = [trial(H100, PROBLEMS[0], 1024, c, median_ms=1.0, rng=rng) for c in CONFIGS]
    ready = _fork.Event()
    proc = _fork.Process(target=_hold_open_transaction, args=(path, pending, ready))
    proc.start()
    assert ready.wait(timeout=60), "the writer never reached its open transaction"
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)
    assert proc.exitcode == -signal.SIGKILL

    _assert_intact(path)
    start = time.monotonic()
    with TuningStore(path) as store:
        assert store.trials() == [committed]
        entry = store.best(H100.name, PROBLEMS[0].key(), 1024)
        assert entry is not None and entry.trial == committed
        # The dead writer's lock is gone: a new write goes through at once.
        later = trial(H100, PROBLEMS[0], 1024, CONFIGS[1], median_ms=2.0, rng=rng)
        assert store.record_trial(later)
    assert time.monotonic() - start < 10


def _write_batches_forever(path: str, seed: int) -> None:
    rng = random.Random(seed)
    with TuningStore(path) as store:
        while True:
            store.record_trials(random_trials(rng, BATCH))


def test_writers_killed_at_random_moments_leave_whole_batches(
        tmp_path: Path, rng: random.Random) -> None:
    assert _fork is not None
    path = str(tmp_path / "random-kill.db")
    with TuningStore(path) as store:
        for device in DEVICES:
            store.record_device(device)
    for round_ in range(3):
        procs = [_fork.Process(target=_write_batches_forever, args=(path, rng.random()))
                 for _ in range(2)]
        for p in procs:
            p.start()
        time.sleep(rng.uniform(0.8, 1.6))
        for p in procs:
            assert p.pid is not None
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(timeout=30)
        _assert_intact(path)
        with TuningStore(path) as store:
            stored = store.trials()
            assert len(stored) % BATCH == 0, f"a partial batch survived (round {round_})"
            best = {(e.device, e.problem, e.seqlen): e.trial.uid for e in store.all_best()}
            assert best == expected_best(stored)
    assert len(stored) > 0


class _ScriptedCursor:
    """A DB-API cursor whose WAL switch fails with the given errors before it succeeds."""

    def __init__(self, failures: list[str]) -> None:
        self.failures = failures
        self.statements: list[str] = []

    def execute(self, statement: str) -> None:
        self.statements.append(statement)
        if "journal_mode" in statement and self.failures:
            raise sqlite3.OperationalError(self.failures.pop(0))

    def close(self) -> None:
        pass


class _ScriptedConnection:
    def __init__(self, cursor: _ScriptedCursor) -> None:
        self._cursor = cursor

    def cursor(self) -> _ScriptedCursor:
        return self._cursor


def test_wal_switch_retries_a_lock_that_sqlite_will_not_wait_for() -> None:
    # Connections that open a new file at once can deadlock on the switch; SQLite then
    # answers "database is locked" without waiting. The switch backs off and retries.
    cursor = _ScriptedCursor(["database is locked"] * 3)
    sqlite_pragmas(_ScriptedConnection(cursor), timeout=5.0)
    assert cursor.statements.count("PRAGMA journal_mode = WAL") == 4
    assert cursor.statements[0].startswith("PRAGMA busy_timeout = 5000")
    assert cursor.statements[-1] == "PRAGMA synchronous = NORMAL"


def test_wal_switch_gives_up_at_the_busy_timeout_and_not_on_other_errors() -> None:
    cursor = _ScriptedCursor(["database is locked"] * 10_000)
    start = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        sqlite_pragmas(_ScriptedConnection(cursor), timeout=0.3)
    assert 0.1 < time.monotonic() - start < 2.0
    other = _ScriptedCursor(["disk I/O error", "database is locked"])
    with pytest.raises(sqlite3.OperationalError, match="disk I/O"):
        sqlite_pragmas(_ScriptedConnection(other), timeout=5.0)
    assert other.statements.count("PRAGMA journal_mode = WAL") == 1
