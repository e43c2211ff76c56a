"""Provenance of imported trials and re-verifications of stored configs.

Revision ID: 0002
Revises: 0001

Adds ``ft_imports`` (one row per import or merge: bundle digest, source, claimed export,
time and host of the import, whether it was marked trusted), ``ft_trials.import_id`` (NULL
for trials tuned into the database itself, which is every trial before this revision) and
``ft_verifications`` (re-checks of a trial's config on given kernel sources).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ft_imports",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("bundle_sha256", sa.String(64), nullable=False),
        sa.Column("source", sa.String(255), nullable=False),
        sa.Column("exported_by", sa.String(64), nullable=False),
        sa.Column("exported_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("imported_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("imported_by", sa.String(253), nullable=False),
        sa.Column("trusted", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_ft_imports"),
    )
    with op.batch_alter_table("ft_trials") as batch:
        batch.add_column(sa.Column("import_id", sa.Integer(), nullable=True))
        batch.create_foreign_key("fk_ft_trials_import_id_ft_imports", "ft_imports",
                                 ["import_id"], ["id"])
    op.create_table(
        "ft_verifications",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("template_digest", sa.String(128), nullable=False),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("backend", sa.String(32), nullable=False),
        sa.Column("host", sa.String(253), nullable=False),
        sa.Column("checked_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["trial_id"], ["ft_trials.id"],
                                name="fk_ft_verifications_trial_id_ft_trials"),
        sa.PrimaryKeyConstraint("id", name="pk_ft_verifications"),
    )
    op.create_index("ix_ft_verifications_trial", "ft_verifications",
                    ["trial_id", "template_digest"])


def downgrade() -> None:
    op.drop_index("ix_ft_verifications_trial", table_name="ft_verifications")
    op.drop_table("ft_verifications")
    with op.batch_alter_table("ft_trials") as batch:
        batch.drop_constraint("fk_ft_trials_import_id_ft_imports", type_="foreignkey")
        batch.drop_column("import_id")
    op.drop_table("ft_imports")
