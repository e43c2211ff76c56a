"""Schema versions and migrations, on both backends."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from dbfactories import CONFIGS, H100, PROBLEMS, trial

from flashtune.db import TuningStore, resolve_url
from flashtune.db.engine import make_engine
from flashtune.db.models import Base
from flashtune.db.schema import MIGRATIONS_DIR, VERSION_TABLE, head_revision
from flashtune.errors import DatabaseError, SchemaVersionError

_EXTRA_REVISION_TEMPLATE = '''"""test-only second revision"""
import sqlalchemy as sa
from alembic import op

revision = "0099"
down_revision = HEAD
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("ft_extra", sa.Column("id", sa.Integer(), primary_key=True))


def downgrade() -> None:
    op.drop_table("ft_extra")
'''


@pytest.fixture
def newer_migrations(tmp_path: Path) -> Path:
    """The shipped migrations plus a revision 0099: what a future flashtune would ship."""
    target = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS_DIR, target, ignore=shutil.ignore_patterns("__pycache__"))
    (target / "versions" / "0099_extra.py").write_text(
        _EXTRA_REVISION_TEMPLATE.replace("HEAD", repr(head_revision())))
    return target


def _tables(url: str) -> set[str]:
    engine = sa.create_engine(resolve_url(url))
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_migrations_create_exactly_the_models(db_url: str) -> None:
    with TuningStore(db_url) as store:
        assert store.schema.current == head_revision() == "0003"
        with store.engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            assert compare_metadata(context, Base.metadata) == []
    assert _tables(db_url) == {"ft_alembic_version", "ft_devices", "ft_problems", "ft_configs",
                               "ft_trials", "ft_best", "ft_imports", "ft_verifications"}


def test_older_database_needs_an_explicit_upgrade(db_url: str, newer_migrations: Path) -> None:
    original = trial(H100, PROBLEMS[0], 1024, CONFIGS[0])
    with TuningStore(db_url) as store:
        store.record_device(H100)
        store.record_trial(original)
    with pytest.raises(SchemaVersionError, match="flashtune db upgrade") as info:
        TuningStore(db_url, migrations=newer_migrations)
    assert f"'{head_revision()}'" in str(info.value) and "'0099'" in str(info.value)
    assert "ft_extra" not in _tables(db_url)           # refusing changed nothing
    with TuningStore(db_url, migrations=newer_migrations, upgrade=True) as store:
        assert store.schema.current == "0099"
        assert store.trials() == [original]
    assert "ft_extra" in _tables(db_url)
    # The upgraded database is now newer than the shipped code.
    with pytest.raises(SchemaVersionError, match="newer than this flashtune"):
        TuningStore(db_url)


def test_unknown_revision_is_refused(db_url: str) -> None:
    TuningStore(db_url).close()
    engine = make_engine(resolve_url(db_url), create=False)
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = 'abc123'"))
    engine.dispose()
    with pytest.raises(SchemaVersionError, match=r"'abc123'.*Upgrade flashtune"):
        TuningStore(db_url)
    with pytest.raises(SchemaVersionError):
        TuningStore(db_url, upgrade=True)


def test_tables_without_version_are_refused(db_url: str) -> None:
    engine = make_engine(resolve_url(db_url), create=True)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE ft_devices (id INTEGER PRIMARY KEY)"))
    engine.dispose()
    with pytest.raises(SchemaVersionError, match="no schema version"):
        TuningStore(db_url)


def test_create_false_refuses_an_empty_database(new_db: Callable[[], str], backend: str) -> None:
    url = new_db()
    if backend == "sqlite":
        with pytest.raises(DatabaseError, match="no database file"):
            TuningStore(url, create=False)
        assert not Path(url).exists()
    else:
        with pytest.raises(DatabaseError, match="holds no flashtune tuning database"):
            TuningStore(url, create=False)


def test_default_database_from_the_knob_creates_its_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a" / "b" / "tuning.db"
    monkeypatch.setenv("FLASHTUNE_DB", str(path))
    with TuningStore() as store:
        assert store.url.database == str(path)
    assert path.is_file()
    with TuningStore(f"sqlite:///{path}") as store:
        assert store.counts()["trials"] == 0
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    engine.dispose()


def test_url_forms() -> None:
    assert resolve_url("rel/x.db").database == str(Path("rel/x.db").absolute())
    assert resolve_url("postgresql://u@h/d").drivername == "postgresql+psycopg"
    assert resolve_url("postgres://u:secret@h/d").drivername == "postgresql+psycopg"
    with pytest.raises(DatabaseError, match="not supported"):
        TuningStore("mysql://u@h/d")
    with pytest.raises(DatabaseError, match="malformed"):
        resolve_url("://nothing")


def test_error_messages_hide_the_password() -> None:
    with pytest.raises(DatabaseError) as info:
        TuningStore("postgresql://user:hunter2@127.0.0.1:1/nowhere")
    assert "hunter2" not in str(info.value)
    assert "127.0.0.1:1" in str(info.value)
