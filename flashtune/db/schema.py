"""Schema versions: check the database against the code, create it, migrate it.

The schema version is the Alembic revision stored in ``ft_alembic_version``. Opening a
database compares it with the newest revision shipped in ``flashtune/db/migrations``:

- no flashtune tables yet: the schema is created (all migrations run), unless told not to;
- same revision: nothing to do;
- older revision: ``SchemaVersionError`` telling to run ``flashtune db upgrade``. Upgrades
  are never automatic: a database may be shared by several machines or flashtune versions,
  and an older flashtune cannot read a database once it has been upgraded, so the user
  decides when (and makes a copy first);
- unknown revision (written by a newer flashtune): ``SchemaVersionError`` telling to
  upgrade flashtune or use another database.

Creation and upgrades run in one write transaction (under an advisory lock on PostgreSQL),
so processes opening a new database at once create it exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine

from flashtune.db.engine import describe, session_scope
from flashtune.db.records import this_version
from flashtune.errors import DatabaseError, SchemaVersionError

VERSION_TABLE = "ft_alembic_version"
MIGRATIONS_DIR = Path(__file__).with_name("migrations")
TABLE_PREFIX = "ft_"
#: Key of the PostgreSQL advisory lock held while creating or upgrading the schema.
_PG_LOCK_KEY = 0x66746462  # "ftdb"


@dataclass(frozen=True)
class SchemaState:
    """Where a database stands: its revision (None: no flashtune tables) and the code's."""

    current: str | None
    head: str
    has_tables: bool

    @property
    def up_to_date(self) -> bool:
        return self.current == self.head


def _script(migrations: Path) -> ScriptDirectory:
    return ScriptDirectory(str(migrations))


def head_revision(migrations: Path = MIGRATIONS_DIR) -> str:
    heads = _script(migrations).get_heads()
    if len(heads) != 1:
        raise DatabaseError(f"the migrations in {migrations} have {len(heads)} heads {heads}; "
                            "expected exactly one (merge the branches)")
    return heads[0]


def _read_state(connection: Connection, migrations: Path) -> SchemaState:
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    tables = sa.inspect(connection).get_table_names()
    has_tables = any(t.startswith(TABLE_PREFIX) and t != VERSION_TABLE for t in tables)
    return SchemaState(context.get_current_revision(), head_revision(migrations), has_tables)


def schema_state(engine: Engine, migrations: Path = MIGRATIONS_DIR) -> SchemaState:
    with session_scope(engine, write=False, action="reading the schema version") as session:
        return _read_state(session.connection(), migrations)


def _check(state: SchemaState, engine: Engine, *, create: bool, upgrade: bool,
           migrations: Path) -> None:
    """Raise unless ``state`` is current or may be brought there (create/upgrade allowed)."""
    where = describe(engine.url)
    if state.current is None:
        if state.has_tables:
            raise SchemaVersionError(
                f"{where} has flashtune tables (ft_*) but no schema version in "
                f"{VERSION_TABLE}; it was not written by flashtune or was damaged. Point "
                "--db/FLASHTUNE_DB at another database"
            )
        if not create:
            raise DatabaseError(f"{where} holds no flashtune tuning database")
        return
    known = {rev.revision for rev in _script(migrations).walk_revisions()}
    if state.current not in known:
        raise SchemaVersionError(
            f"{where} has schema revision {state.current!r}, which is newer than this "
            f"flashtune {this_version()} knows (newest: {state.head!r}). Upgrade flashtune "
            "(pip install -U flashtune) or use another database (--db or FLASHTUNE_DB)"
        )
    if state.current != state.head and not upgrade:
        raise SchemaVersionError(
            f"{where} has schema revision {state.current!r} but this flashtune "
            f"{this_version()} needs {state.head!r}. Back it up, then run "
            f"`flashtune db upgrade --db '{where}'` (older flashtune versions cannot read it "
            "afterwards)"
        )


def ensure_schema(engine: Engine, *, create: bool = True, upgrade: bool = False,
                  migrations: Path = MIGRATIONS_DIR) -> SchemaState:
    """Make sure the database has the code's schema; see the module doc for the rules."""
    state = schema_state(engine, migrations)
    if state.up_to_date:
        return state
    _check(state, engine, create=create, upgrade=upgrade, migrations=migrations)
    with session_scope(engine, write=True, action="creating or upgrading the schema") as session:
        connection = session.connection()
        if connection.dialect.name == "postgresql":
            connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"),
                               {"key": _PG_LOCK_KEY})
        # Another process may have done the work while we waited for the lock.
        state = _read_state(connection, migrations)
        if not state.up_to_date:
            _check(state, engine, create=create, upgrade=upgrade, migrations=migrations)
            config = Config()
            config.set_main_option("script_location", str(migrations))
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
            state = _read_state(connection, migrations)
    return state
