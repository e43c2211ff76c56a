"""Databases that must not be read as if they were sound: committed WAL content a read-only
open cannot see, and files that fail SQLite's integrity check (issue: what a hostile or
careless user still breaks, "stale data" and "integrity")."""

from __future__ import annotations

import random
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dbfactories import CONFIGS, H100, PROBLEMS, trial
from hardening_helpers import damage_table_page, is_root

from flashtune.codegen.spec import ProblemBucket
from flashtune.db import TuningStore
from flashtune.errors import DatabaseError
from flashtune.runtime.dispatch import Dispatcher, NamedDevice, Tier

P, N = PROBLEMS[1], 4096
DEVICE = NamedDevice(H100.name, "sm_90", arch_specific_kernels=False)


def _decide(path: Path) -> Tier:
    return Dispatcher(lambda: TuningStore(path, create=False)).decide(
        ProblemBucket(P, N), DEVICE).tier


@pytest.fixture
def tuned(tmp_path: Path) -> Path:
    """A database (WAL mode, checkpointed) with one best entry of P on the H100."""
    path = tmp_path / "ro" / "tuning.db"
    with TuningStore(path) as store:
        store.record_device(H100)
        store.record_trial(trial(H100, P, N, CONFIGS[1], median_ms=0.05,
                                 rng=random.Random(3)))
    connection = sqlite3.connect(path)
    connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    connection.close()
    return path


def _killed_writer_deletes_the_best(path: Path) -> None:
    """A writer commits the deletion of every best entry into the -wal file and is killed
    before any checkpoint: the committed deletion lives only in the -wal."""
    code = ("import os, sqlite3, sys\n"
            "c = sqlite3.connect(sys.argv[1])\n"
            "c.execute('PRAGMA wal_autocheckpoint = 0')\n"
            "c.execute('DELETE FROM ft_best')\n"
            "c.commit()\n"
            "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)
    wal = Path(f"{path}-wal")
    assert wal.stat().st_size > 0
    # Without its -shm (removed, or unreadable to this user) a reader in a read-only
    # directory cannot open the WAL database in mode=ro; that is what sends the engine to
    # its fallback.
    Path(f"{path}-shm").unlink(missing_ok=True)


@pytest.fixture
def read_only_directory(tuned: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The database's directory as a reader who cannot write it sees it. Root writes
    anywhere, so for root the engine's plain ``mode=ro`` open fails as it does there
    (SQLite cannot create the -shm file: 'unable to open database file')."""
    directory = tuned.parent
    if not is_root():
        directory.chmod(0o555)
    else:
        real = sqlite3.connect

        def connect(target: str, *args: Any, **kwargs: Any) -> sqlite3.Connection:
            if (kwargs.get("uri") and str(target).startswith(f"file:{directory}")
                    and "mode=ro" in target and "immutable=1" not in target
                    and Path(f"{tuned}-wal").exists() and not Path(f"{tuned}-shm").exists()):
                raise sqlite3.OperationalError("unable to open database file")
            connection: sqlite3.Connection = real(target, *args, **kwargs)
            return connection

        monkeypatch.setattr(sqlite3, "connect", connect)  # what flashtune.db.engine calls
    yield tuned
    directory.chmod(0o755)


def test_committed_wal_content_is_never_ignored(read_only_directory: Path) -> None:
    """Regression: the database was opened with immutable=1, which ignores the -wal, and
    the dispatcher (and `explain`) served the deleted best entry."""
    path = read_only_directory
    with TuningStore(path, create=False) as store:  # sound: the plain read-only open works
        assert len(store.all_best()) == 1
    _killed_writer_deletes_the_best(path)
    with pytest.raises(DatabaseError) as info:
        TuningStore(path, create=False)
    text = str(info.value)
    assert str(path) in text and f"{path}-wal" in text
    assert "wal_checkpoint" in text and "copy" in text  # the two fixes
    assert _decide(path) is Tier.DEFAULT  # never the deleted entry


def test_an_empty_wal_in_a_read_only_directory_still_reads(read_only_directory: Path) -> None:
    """Nothing is lost without committed -wal content: the file is read as it is."""
    path = read_only_directory
    Path(f"{path}-wal").write_bytes(b"")
    Path(f"{path}-shm").unlink(missing_ok=True)
    with TuningStore(path, create=False) as store:
        assert len(store.all_best()) == 1
    assert _decide(path) is Tier.EXACT


# ------------------------------------------------------------------ integrity


def test_writers_refuse_a_damaged_database(tuned: Path) -> None:
    """Regression: `tune` (and every writer) wrote into a file that fails SQLite's check."""
    damage_table_page(tuned)
    for attempt in range(2):  # refused on every open, not only the first
        with pytest.raises(DatabaseError) as info:
            TuningStore(tuned)
        text = str(info.value)
        assert str(tuned) in text and "integrity check" in text, attempt
        assert "backup" in text and "db export" in text  # the fix
    before = tuned.read_bytes()
    with pytest.raises(DatabaseError, match="integrity check"), TuningStore(tuned) as store:
        store.record_device(H100)
    assert tuned.read_bytes() == before  # nothing written


def test_readers_warn_once_about_a_damaged_database(tuned: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Regression: `db list`, `explain` and the runtime read it without a word."""
    damage_table_page(tuned)
    caplog.set_level("WARNING", logger="flashtune")
    for _ in range(3):
        with TuningStore(tuned, create=False) as store:
            store.devices()
    _decide(tuned)
    warned = [r for r in caplog.records if "integrity check" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert str(tuned) in warned[0].getMessage() and "backup" in warned[0].getMessage()


def test_a_sound_database_is_checked_once_per_process(tuned: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is cheap: one quick_check per file and process, at open."""
    from flashtune.db import store as store_module
    from flashtune.db.engine import integrity_problems as real  # what store_module calls

    ran: list[bool] = []

    def counting(engine: Any, **kwargs: Any) -> list[str]:
        ran.append(kwargs.get("quick", False))
        return real(engine, **kwargs)

    monkeypatch.setattr(store_module, "integrity_problems", counting)
    for create in (True, False, False):
        with TuningStore(tuned, create=create) as store:
            assert store.devices()
    assert ran == [True]
