"""A lock that serialises proposals of one study across workers, processes and machines.

Proposing (ask, then look at every running and finished trial for the same config) is
made atomic by this lock, so two workers never both decide to measure one config: the
second one sees the first's running trial. It is held for milliseconds, never while
compiling or measuring.

- SQLite: a file lock beside the database file (SQLite serves one machine anyway);
- PostgreSQL: a session-level advisory lock, released by the server if the worker dies;
- in-memory databases: a process-local lock.
"""

from __future__ import annotations

import hashlib
import threading
from types import TracebackType

import filelock
import sqlalchemy as sa
from sqlalchemy.engine import URL

from flashtune.db.engine import describe, make_engine, resolve_url, sqlite_file
from flashtune.errors import TuningError

LOCK_TIMEOUT_S = 120.0


def _lock_id(study: str) -> int:
    """A stable signed 64-bit id for PostgreSQL's advisory locks."""
    return int.from_bytes(hashlib.sha256(study.encode()).digest()[:8], "big", signed=True)


class ProposalLock:
    """``with lock: ...`` runs the block while no other worker of the study is proposing."""

    def __init__(self, url: str | URL | None, study: str) -> None:
        self._url = resolve_url(url)
        self._study = study
        self._engine: sa.Engine | None = None
        self._conn: sa.Connection | None = None
        self._local = threading.RLock()
        self._file: filelock.BaseFileLock | None = None
        backend = self._url.get_backend_name()
        path = sqlite_file(self._url)
        if backend == "sqlite" and path is not None:
            digest = hashlib.sha256(study.encode()).hexdigest()[:16]
            self._file = filelock.FileLock(f"{path}.propose-{digest}.lock",
                                           timeout=LOCK_TIMEOUT_S)
        elif backend == "postgresql":
            self._engine = make_engine(self._url, create=False)
        elif backend != "sqlite":
            raise TuningError(f"several tuning workers need SQLite or PostgreSQL, not "
                              f"{describe(self._url)}")

    def __enter__(self) -> ProposalLock:
        self._local.acquire()
        try:
            if self._file is not None:
                self._file.acquire()
            elif self._engine is not None:
                if self._conn is None:
                    self._conn = self._engine.connect()
                self._conn.execute(sa.text("SELECT pg_advisory_lock(:k)"),
                                   {"k": _lock_id(self._study)})
                self._conn.commit()
        except filelock.Timeout as exc:
            self._local.release()
            raise TuningError(f"another worker held the proposal lock of {self._study} for "
                              f"{LOCK_TIMEOUT_S:.0f} s; is a worker hung? ({exc})") from exc
        except BaseException:
            self._local.release()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if self._file is not None:
                self._file.release()
            elif self._conn is not None:
                self._conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"),
                                   {"k": _lock_id(self._study)})
                self._conn.commit()
        finally:
            self._local.release()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._engine is not None:
            self._engine.dispose()

