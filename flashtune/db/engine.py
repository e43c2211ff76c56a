"""Database URLs, engines and the one transaction helper every read and write goes through.

URLs come from ``--db`` or the setting ``FLASHTUNE_DB`` (``flashtune.settings.DB_URL``): either a
SQLAlchemy URL or a plain file path, which means SQLite. Supported backends are SQLite and
PostgreSQL (``postgresql://`` is read as ``postgresql+psycopg://``, the driver flashtune
ships with).

SQLite runs in WAL mode with a busy timeout (setting FLASHTUNE_DB_BUSY_TIMEOUT_S), so readers
never block the writer and writers wait for each other instead of failing. Read-only opens
(``make_engine(..., read_only=True)``, what every read command and the runtime use) never
write: SQLite gets no WAL switch and ``query_only`` (a file in a read-only directory still
reads, unless its -wal holds committed changes it cannot see: that is refused with the
fix); PostgreSQL sessions are READ ONLY.
SQLAlchemy, not the sqlite3 module, emits BEGIN: write transactions start with ``BEGIN
IMMEDIATE`` and take the write lock up front, because a deferred transaction that reads
first and writes later can fail at once with "database is locked" when another writer got
there in between (SQLite cannot wait in that case).
"""

from __future__ import annotations

import functools
import math
import re
import sqlite3
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.exc import ArgumentError, IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from flashtune import settings
from flashtune.errors import DatabaseError

SUPPORTED_BACKENDS = ("sqlite", "postgresql")
_WRITE = "flashtune_write"
#: Query parameters a SQLite URL may carry, and their legal values.
_SQLITE_QUERY = {"mode": ("ro", "rw", "rwc"), "timeout": None, "immutable": ("0", "1"),
                 "uri": ("true", "false")}
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
#: A -wal file no longer than its header holds no frames (no changes the file lacks).
_WAL_HEADER_BYTES = 32


def busy_timeout_s() -> float:
    """How long a SQLite writer waits for another writer (setting FLASHTUNE_DB_BUSY_TIMEOUT_S)."""
    return settings.DB_BUSY_TIMEOUT_S.get()


def _bad_url(raw: str, why: str) -> DatabaseError:
    shown = raw if len(raw) <= 200 else raw[:197] + "..."
    return DatabaseError(
        f"database URL {shown!r} {why}; expected e.g. 'sqlite:////path/to/tuning.db', "
        "'postgresql://user@host/dbname' or a plain file path")


def _check_sqlite_query(raw: str, url: URL) -> None:
    for name, value in url.query.items():
        values = (value,) if isinstance(value, str) else tuple(value)
        legal = _SQLITE_QUERY.get(name, ())
        if name not in _SQLITE_QUERY:
            raise _bad_url(raw, f"has the unknown SQLite parameter {name!r} (known: "
                           f"{sorted(_SQLITE_QUERY)})")
        for item in values:
            if legal is None:
                try:
                    seconds = float(item)
                except ValueError:
                    seconds = math.nan
                if not (math.isfinite(seconds) and 0 < seconds <= 3600):
                    raise _bad_url(raw, f"has timeout={item!r}; expected seconds in (0, 3600]")
            elif item not in legal:
                raise _bad_url(raw, f"has {name}={item!r}; expected one of {list(legal)}")


def resolve_url(url: str | Path | URL | None = None) -> URL:
    """The SQLAlchemy URL for ``url``, a plain path (SQLite) or, if None, the setting's value.

    Refused with DatabaseError: an empty URL, a scheme without ``//`` (``sqlite:``), a SQLite
    URL without a file (``sqlite:///``), unknown or malformed SQLite parameters.
    """
    if isinstance(url, URL):
        return url
    raw = settings.DB_URL.get() if url is None else str(url)
    if not raw.strip():
        raise _bad_url(raw, "is empty")
    if "://" not in raw:
        if _SCHEME.match(raw) and not Path(raw).exists():
            raise _bad_url(raw, "looks like a URL without '//' after the scheme")
        path = Path(raw).expanduser().absolute()
        return URL.create("sqlite", database=str(path))
    try:
        parsed = sa.make_url(raw)
    except ArgumentError as exc:
        raise _bad_url(raw, f"is malformed ({exc})") from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() == "sqlite":
        if parsed.database == "":
            raise _bad_url(raw, "names no database file")
        _check_sqlite_query(raw, parsed)
    return parsed


def describe(url: URL) -> str:
    """The URL as it may be printed: without the password."""
    return url.render_as_string(hide_password=True)


def sqlite_file(url: URL) -> Path | None:
    """The file of a SQLite URL, or None for in-memory and URI-style databases."""
    if url.get_backend_name() != "sqlite":
        return None
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        return None
    return Path(database)


def is_read_only(url: URL) -> bool:
    """True for a SQLite URL that asks for a read-only connection (``?mode=ro``)."""
    return url.get_backend_name() == "sqlite" and (
        url.query.get("mode") == "ro" or url.query.get("immutable") == "1")


def require_existing(url: str | Path | URL | None) -> URL:
    """The resolved URL, after checking that a SQLite file exists (read commands must not
    create a database on a mistyped path)."""
    resolved = resolve_url(url)
    path = sqlite_file(resolved)
    if path is not None and not path.is_file():
        raise DatabaseError(f"no database file at {path}; check the path or URL (read "
                            "commands never create a database)")
    return resolved


def make_engine(url: URL, *, create: bool, read_only: bool = False) -> Engine:
    """An engine for ``url``; with ``create``, the parent directory of a SQLite file is made.

    Without ``create`` a missing SQLite file is an error instead of a new empty database.
    ``read_only`` (or ``?mode=ro`` in the URL) opens a SQLite file without ever writing to it
    (no WAL switch), so a database in a read-only directory can be read.
    """
    backend = url.get_backend_name()
    if backend not in SUPPORTED_BACKENDS:
        raise DatabaseError(
            f"database backend {backend!r} of {describe(url)} is not supported; use SQLite "
            "(a file path or sqlite:///...) or PostgreSQL (postgresql://...)"
        )
    read_only = read_only or is_read_only(url)
    path = sqlite_file(url)
    if path is not None:
        if create and not read_only:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DatabaseError(
                    f"cannot create the directory of the database {path}: {exc}; choose "
                    "another path with --db or FLASHTUNE_DB") from exc
        elif not path.is_file():
            raise DatabaseError(f"no database file at {path}; check the path or URL")
    if backend != "sqlite":
        engine = sa.create_engine(url, pool_pre_ping=True,
                                  connect_args={"connect_timeout": 10})
        if read_only:
            event.listen(engine, "connect", _postgres_read_only_connect)
        return engine
    given = url.query.get("timeout")
    timeout = float(given) if isinstance(given, str) else busy_timeout_s()
    plain = url if path is None else url.difference_update_query(list(_SQLITE_QUERY))
    if read_only and path is not None:
        engine = _read_only_engine(plain, path, timeout)
    else:
        engine = sa.create_engine(plain, connect_args={"timeout": timeout})
        event.listen(engine, "connect", functools.partial(_sqlite_on_connect, timeout=timeout))
    event.listen(engine, "begin", _sqlite_on_begin)
    return engine


def _read_only_engine(url: URL, path: Path, timeout: float) -> Engine:
    """A SQLite engine that never writes: ``mode=ro``, or, where even that needs a write
    (a WAL database in a read-only directory has no shared-memory file to create),
    ``immutable=1``, which reads the file as it is -- only when no -wal file holds content
    that the file lacks (immutable ignores the -wal: a writer killed before its checkpoint
    leaves committed changes there, and reading without them would serve deleted results).
    """
    quoted = urllib.parse.quote(str(path))
    for query in ("mode=ro", "mode=ro&immutable=1"):
        if "immutable" in query:
            _refuse_unseen_wal(path)
        def connect(target: str = f"file:{quoted}?{query}") -> sqlite3.Connection:
            return sqlite3.connect(target, uri=True, timeout=timeout,
                                   check_same_thread=False)

        try:
            probe = connect()
            try:
                probe.execute("SELECT count(*) FROM sqlite_master").fetchone()
            finally:
                probe.close()
        except sqlite3.Error:
            continue
        engine = sa.create_engine(url, creator=connect, poolclass=NullPool)
        event.listen(engine, "connect", functools.partial(_sqlite_read_only_connect,
                                                          timeout=timeout))
        return engine
    raise DatabaseError(f"cannot open the database {path} for reading; check that the file "
                        "is readable and is a SQLite database")


def _refuse_unseen_wal(path: Path) -> None:
    """DatabaseError when ``path``'s -wal file holds frames (committed changes a read-only
    open that cannot use the WAL would ignore)."""
    wal = Path(f"{path}-wal")
    try:
        size = wal.stat().st_size
    except FileNotFoundError:
        return
    except OSError as exc:
        size = -1
        detail = exc.strerror or str(exc)
    else:
        detail = f"{size} bytes"
    if 0 <= size <= _WAL_HEADER_BYTES:  # empty, or a header without frames
        return
    raise DatabaseError(
        f"the database {path} cannot be read as it is: its write-ahead log {wal} ({detail}) "
        "holds changes a writer committed but never copied into the file (it was stopped "
        "before its checkpoint), and this open cannot use the log (the directory is "
        "read-only to you). Reading the file alone would serve results that were changed or "
        "deleted. Fix: as a user who can write the directory, run "
        f"`sqlite3 {path} 'PRAGMA wal_checkpoint(TRUNCATE)'`, or copy {path} and {wal} "
        "together into a directory you can write and point --db/FLASHTUNE_DB at the copy")


def _postgres_read_only_connect(dbapi_connection: Any, _record: Any) -> None:
    """Every transaction of a read-only PostgreSQL engine is READ ONLY: the server refuses
    any write, as SQLite's ``query_only`` does."""
    with dbapi_connection.cursor() as cursor:
        cursor.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
    dbapi_connection.commit()  # the SET opened a transaction; make it the session's


def _sqlite_read_only_connect(dbapi_connection: Any, _record: Any, *, timeout: float) -> None:
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
        cursor.execute("PRAGMA query_only = ON")
    finally:
        cursor.close()


def sqlite_pragmas(dbapi_connection: Any, _record: Any = None, *, timeout: float) -> None:
    """The pragmas of every writing SQLite connection (flashtune's and Optuna's): the busy
    timeout, WAL and ``synchronous = NORMAL``. Usable as a "connect" event listener with
    ``functools.partial(sqlite_pragmas, timeout=...)``."""
    cursor = dbapi_connection.cursor()
    try:
        # The busy timeout first: switching to WAL itself may have to wait for a lock.
        cursor.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
        _switch_to_wal(cursor, timeout)
        # NORMAL is safe with WAL against process crashes; only a power loss may drop the
        # last commits, never corrupt the file.
        cursor.execute("PRAGMA synchronous = NORMAL")
    finally:
        cursor.close()


def _switch_to_wal(cursor: Any, timeout: float) -> None:
    """``PRAGMA journal_mode = WAL``, retried until ``timeout`` while the file is locked.

    The switch reads the header under a shared lock and then needs the exclusive one. When
    several connections open a new file at once, each can hold the shared lock while it
    waits for the exclusive one; SQLite sees that waiting would deadlock and answers
    "database is locked" at once, without the busy handler. Backing off and retrying lets
    one of them win; the others then find the file in WAL mode already.
    """
    deadline = time.monotonic() + timeout
    pause = 0.002
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            message = str(exc).lower()
            if ("locked" not in message and "busy" not in message) \
                    or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(2 * pause, 0.1)


def _sqlite_on_connect(dbapi_connection: Any, _record: Any, *, timeout: float) -> None:
    # Let SQLAlchemy emit BEGIN (see _sqlite_on_begin) instead of the sqlite3 module, which
    # would skip it before SELECT and DDL statements.
    dbapi_connection.isolation_level = None
    sqlite_pragmas(dbapi_connection, timeout=timeout)
    dbapi_connection.execute("PRAGMA foreign_keys = ON")


def _sqlite_on_begin(connection: Connection) -> None:
    write = connection.get_execution_options().get(_WRITE, False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def integrity_problems(engine: Engine, *, quick: bool = False) -> list[str]:
    """What SQLite's integrity check finds wrong with the database ([] when sound; always []
    on PostgreSQL, which checks its pages itself). ``quick``: ``PRAGMA quick_check``, which
    skips the comparison of indexes with their tables (linear in the file's size)."""
    if engine.url.get_backend_name() != "sqlite":
        return []
    pragma = "quick_check" if quick else "integrity_check"
    try:
        with engine.connect() as connection:
            rows = connection.exec_driver_sql(f"PRAGMA {pragma}").fetchall()
    except SQLAlchemyError as exc:
        return [str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]]
    found = [str(row[0]) for row in rows]
    return [] if found == ["ok"] else found


@contextmanager
def session_scope(engine: Engine, *, write: bool, action: str) -> Iterator[Session]:
    """A session in one transaction: committed on success, rolled back on any exception.

    ``write`` takes SQLite's write lock at the start. Driver errors come out as
    ``DatabaseError`` naming ``action`` (e.g. "recording a trial") and how to fix them;
    flashtune's own errors raised inside pass through unchanged (after the rollback).
    """
    try:
        with engine.connect() as connection:
            if write:
                connection.execution_options(**{_WRITE: True})
            with Session(bind=connection, expire_on_commit=False) as session, session.begin():
                yield session
    except SQLAlchemyError as exc:
        raise database_error(exc, action, engine.url) from exc


def database_error(exc: SQLAlchemyError, action: str, url: URL) -> DatabaseError:
    """A DatabaseError that says what failed, on which database, and what to do about it."""
    where = describe(url)
    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
    if isinstance(exc, OperationalError):
        lowered = detail.lower()
        if "locked" in lowered or "busy" in lowered:
            return DatabaseError(
                f"{action} failed: {where} stayed locked by another writer for longer than "
                f"the busy timeout ({detail}); retry, raise FLASHTUNE_DB_BUSY_TIMEOUT_S, or "
                "stop the process holding it (for many concurrent writers, use a PostgreSQL "
                "server)"
            )
        if "no such table" in lowered or "does not exist" in lowered:
            return DatabaseError(
                f"{action} failed: {where} lacks a flashtune table ({detail}); it was not "
                "created by flashtune or was damaged; point --db/FLASHTUNE_DB at another "
                "database"
            )
        return DatabaseError(
            f"{action} failed: cannot use {where} ({detail}); check that the file is readable "
            "and writable or that the server is running and the URL is right"
        )
    if isinstance(exc, IntegrityError):
        return DatabaseError(
            f"{action} failed: a write to {where} violated a constraint ({detail}); another "
            "writer probably changed the same rows at the same time; retry the command"
        )
    return DatabaseError(f"{action} failed on {where}: {type(exc).__name__}: {detail}")
