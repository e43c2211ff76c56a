"""Shape classes: tuning buckets of a family that tunes call shapes apart.

Revision ID: 0003
Revises: 0002

Adds ``shape_class`` to ``ft_trials`` and to ``ft_best``'s primary key (``''`` for every
existing row: a bucket without a class, as before). A family that tunes classes of call
shapes within a sequence bucket apart (decoding: GQA group, query rows and page size) keeps
one best trial per (device, problem, seqlen, shape class).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_BUCKET = ["device_id", "problem_id", "seqlen"]


def upgrade() -> None:
    op.drop_index("ix_ft_trials_bucket", table_name="ft_trials")
    with op.batch_alter_table("ft_trials") as batch:
        batch.add_column(sa.Column("shape_class", sa.String(32), nullable=False,
                                   server_default=""))
    op.create_index("ix_ft_trials_bucket", "ft_trials", [*_BUCKET, "shape_class"])
    with op.batch_alter_table("ft_best", recreate="always") as batch:
        batch.add_column(sa.Column("shape_class", sa.String(32), nullable=False,
                                   server_default=""))
        batch.drop_constraint("pk_ft_best", type_="primary")
        batch.create_primary_key("pk_ft_best", [*_BUCKET, "shape_class"])


def downgrade() -> None:
    # Rows of a class other than '' have no place in the old schema.
    op.execute(sa.text("DELETE FROM ft_best WHERE shape_class <> ''"))
    with op.batch_alter_table("ft_best", recreate="always") as batch:
        batch.drop_constraint("pk_ft_best", type_="primary")
        batch.drop_column("shape_class")
        batch.create_primary_key("pk_ft_best", _BUCKET)
    op.drop_index("ix_ft_trials_bucket", table_name="ft_trials")
    op.execute(sa.text("DELETE FROM ft_verifications WHERE trial_id IN "
                       "(SELECT id FROM ft_trials WHERE shape_class <> '')"))
    op.execute(sa.text("DELETE FROM ft_trials WHERE shape_class <> ''"))
    # Not a batch copy: on SQLite that drops ft_trials, which ft_best and ft_verifications
    # reference (SQLite 3.35 and PostgreSQL drop a column in place).
    op.execute(sa.text("ALTER TABLE ft_trials DROP COLUMN shape_class"))
    op.create_index("ix_ft_trials_bucket", "ft_trials", _BUCKET)
