"""Alembic environment of the flashtune tables, run programmatically by flashtune.db.schema.

The caller passes an open connection, already inside a transaction, in
``config.attributes["connection"]``; migrations run in that transaction, so a failed
migration leaves the database as it was. The version table is ``ft_alembic_version`` so
that Optuna's own ``alembic_version`` table can live in the same database.
"""

from __future__ import annotations

from alembic import context

from flashtune.db.schema import VERSION_TABLE

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "flashtune migrations run only through flashtune (`flashtune db upgrade` or "
        "flashtune.db.schema.upgrade), which passes an open connection"
    )
context.configure(
    connection=connection,
    version_table=VERSION_TABLE,
    transactional_ddl=True,
    render_as_batch=True,
)
with context.begin_transaction():
    context.run_migrations()
