"""Database URLs, engines and the one transaction helper every read and write goes through.

URLs come from ``--db`` or the knob ``FLASHTUNE_DB`` (``flashtune.knobs.DB_URL``): either a
SQLAlchemy URL or a plain file path, which means SQLite. Supported backends are SQLite and
PostgreSQL (``postgresql://`` is read as ``postgresql+psycopg://``, the driver flashtune
ships with).

SQLite runs in WAL mode with a busy timeout, so readers never block the writer and writers
wait for each other instead of failing. SQLAlchemy, not the sqlite3 module, emits BEGIN: write
transactions start with ``BEGIN IMMEDIATE`` and take the write lock up front, because a
deferred transaction that reads first and writes later can fail at once with "database is
locked" when another writer got there in between (SQLite cannot wait in that case).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.exc import ArgumentError, IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session

from flashtune import knobs
from flashtune.errors import DatabaseError

#: How long a SQLite writer waits for another writer before giving up.
BUSY_TIMEOUT_MS = 60_000
SUPPORTED_BACKENDS = ("sqlite", "postgresql")
_WRITE = "flashtune_write"


def resolve_url(url: str | Path | URL | None = None) -> URL:
    """The SQLAlchemy URL for ``url``, a plain path (SQLite) or, if None, the knob's value."""
    if isinstance(url, URL):
        return url
    raw = knobs.DB_URL.get() if url is None else str(url)
    if "://" not in raw:
        path = Path(raw).expanduser().absolute()
        return URL.create("sqlite", database=str(path))
    try:
        parsed = sa.make_url(raw)
    except ArgumentError as exc:
        raise DatabaseError(
            f"database URL {raw!r} is malformed ({exc}); expected e.g. 'sqlite:////path/to/"
            "tuning.db', 'postgresql://user@host/dbname' or a plain file path"
        ) from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
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


def make_engine(url: URL, *, create: bool) -> Engine:
    """An engine for ``url``; with ``create``, the parent directory of a SQLite file is made.

    Without ``create`` a missing SQLite file is an error instead of a new empty database.
    """
    backend = url.get_backend_name()
    if backend not in SUPPORTED_BACKENDS:
        raise DatabaseError(
            f"database backend {backend!r} of {describe(url)} is not supported; use SQLite "
            "(a file path or sqlite:///...) or PostgreSQL (postgresql://...)"
        )
    path = sqlite_file(url)
    if path is not None:
        if create:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DatabaseError(
                    f"cannot create the directory of the database {path}: {exc}; choose "
                    "another path with --db or FLASHTUNE_DB") from exc
        elif not path.is_file():
            raise DatabaseError(f"no database file at {path}; check the path or URL")
    if backend == "sqlite":
        engine = sa.create_engine(url)
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
    else:
        engine = sa.create_engine(url, pool_pre_ping=True,
                                  connect_args={"connect_timeout": 10})
    return engine


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Let SQLAlchemy emit BEGIN (see _sqlite_on_begin) instead of the sqlite3 module, which
    # would skip it before SELECT and DDL statements.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        # The busy timeout first: switching to WAL itself may have to wait for a lock.
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        # NORMAL is safe with WAL against process crashes; only a power loss may drop the
        # last commits, never corrupt the file.
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.execute("PRAGMA foreign_keys = ON")
    finally:
        cursor.close()


def _sqlite_on_begin(connection: Connection) -> None:
    write = connection.get_execution_options().get(_WRITE, False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


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
                f"{action} failed: {where} stayed locked by another writer for more than "
                f"{BUSY_TIMEOUT_MS // 1000} s ({detail}); retry, or stop the process holding "
                "it (for many concurrent writers, use a PostgreSQL server)"
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
