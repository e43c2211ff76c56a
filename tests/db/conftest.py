"""Fixtures of the database tests: one contract suite over SQLite and PostgreSQL.

PostgreSQL tests use the server named by FLASHTUNE_TEST_PG_URL (``.ci/postgres.sh`` starts
one and prints the export line). Each test gets a database of its own, dropped afterwards.
Without the variable, or with the server unreachable, the PostgreSQL tests skip and say so
loudly: in the skip reason, as a warning, and as a line in the terminal summary.
"""

from __future__ import annotations

import os
import random
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

PG_ENV = "FLASHTUNE_TEST_PG_URL"
_pg_state: dict[str, str | None] = {}


def _pg_admin_url() -> tuple[str | None, str | None]:
    """(server URL, None) if the PostgreSQL test server answers, else (None, reason)."""
    if "url" in _pg_state or "reason" in _pg_state:
        return _pg_state.get("url"), _pg_state.get("reason")
    raw = os.environ.get(PG_ENV)
    url: str | None = None
    reason: str | None = None
    if not raw:
        reason = f"{PG_ENV} is not set (start a server with: source <(bash .ci/postgres.sh))"
    else:
        try:
            engine = sa.create_engine(raw, connect_args={"connect_timeout": 5})
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
            engine.dispose()
            url = raw
        except Exception as exc:  # any failure means: no usable server
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            reason = f"cannot connect to {PG_ENV}: {first}"
    _pg_state["url"], _pg_state["reason"] = url, reason
    return url, reason


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    reason = _pg_state.get("reason")
    if reason:
        terminalreporter.write_line(f"PostgreSQL tests SKIPPED: {reason}", red=True, bold=True)


def _skip_pg() -> str:
    url, reason = _pg_admin_url()
    if url is None:
        message = f"PostgreSQL tests SKIPPED: {reason}"
        warnings.warn(message, pytest.PytestWarning, stacklevel=2)
        pytest.skip(message)
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "postgres":
        _skip_pg()
    return str(request.param)


@pytest.fixture
def new_db(backend: str, tmp_path: Path) -> Iterator[Callable[[], str]]:
    """A factory of fresh, empty database URLs on the test's backend.

    On PostgreSQL each URL gets a schema of its own (``search_path`` set through the
    connection options), which is much faster to create than a database and as isolated for
    these tests; the schemas are dropped afterwards.
    """
    created: list[str] = []
    admin: sa.Engine | None = None

    def make() -> str:
        nonlocal admin
        name = f"ft_test_{uuid.uuid4().hex[:12]}"
        if backend == "sqlite":
            return str(tmp_path / "dbs" / f"{name}.db")
        server = _skip_pg()
        if admin is None:
            admin = sa.create_engine(server, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{name}"'))
        created.append(name)
        url = sa.make_url(server).update_query_dict({"options": f"-csearch_path={name}"})
        return url.render_as_string(hide_password=False)

    yield make
    if admin is not None:
        with admin.connect() as conn:
            for name in created:
                conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
        admin.dispose()


@pytest.fixture
def db_url(new_db: Callable[[], str]) -> str:
    return new_db()


@pytest.fixture
def rng() -> random.Random:
    """A fresh random generator; its seed is printed so a failure can be replayed."""
    seed = random.SystemRandom().randrange(2**32)
    print(f"random seed: {seed}")
    return random.Random(seed)
