"""The first schema: devices, problems, configs, trials and the best trial per bucket.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_STATUSES = ("ok", "verified_untimed", "invalid", "compile_failed", "runtime_failed",
             "wrong_result")


def upgrade() -> None:
    op.create_table(
        "ft_devices",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("cc_major", sa.Integer(), nullable=False),
        sa.Column("cc_minor", sa.Integer(), nullable=False),
        sa.Column("sm_count", sa.Integer(), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("driver_version", sa.String(64), nullable=False),
        sa.Column("cuda_version", sa.String(64), nullable=False),
        sa.Column("nvrtc_version", sa.String(64), nullable=False),
        sa.Column("cupy_version", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_ft_devices"),
        sa.UniqueConstraint("name", name="uq_ft_devices_name"),
    )
    for table in ("ft_problems", "ft_configs"):
        op.create_table(
            table,
            sa.Column("id", sa.Integer(), nullable=False),
            sa.Column("key", sa.String(128), nullable=False),
            sa.Column("fields", sa.JSON(), nullable=False),
            sa.PrimaryKeyConstraint("id", name=f"pk_{table}"),
            sa.UniqueConstraint("key", name=f"uq_{table}_key"),
        )
    op.create_table(
        "ft_trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("uid", sa.String(32), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("problem_id", sa.Integer(), nullable=False),
        sa.Column("seqlen", sa.Integer(), nullable=False),
        sa.Column("config_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(24), nullable=False),
        sa.Column("median_ms", sa.Double(), nullable=True),
        sa.Column("min_ms", sa.Double(), nullable=True),
        sa.Column("max_ms", sa.Double(), nullable=True),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("tflops", sa.Double(), nullable=True),
        sa.Column("predicted_ms", sa.Double(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("template_digest", sa.String(128), nullable=False),
        sa.Column("flashtune_version", sa.String(64), nullable=False),
        sa.Column("host", sa.String(253), nullable=False),
        sa.Column("study", sa.String(128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("status IN (" + ", ".join(f"'{s}'" for s in _STATUSES) + ")",
                           name="ck_ft_trials_status"),
        sa.ForeignKeyConstraint(["device_id"], ["ft_devices.id"],
                                name="fk_ft_trials_device_id_ft_devices"),
        sa.ForeignKeyConstraint(["problem_id"], ["ft_problems.id"],
                                name="fk_ft_trials_problem_id_ft_problems"),
        sa.ForeignKeyConstraint(["config_id"], ["ft_configs.id"],
                                name="fk_ft_trials_config_id_ft_configs"),
        sa.PrimaryKeyConstraint("id", name="pk_ft_trials"),
        sa.UniqueConstraint("uid", name="uq_ft_trials_uid"),
    )
    op.create_index("ix_ft_trials_bucket", "ft_trials", ["device_id", "problem_id", "seqlen"])
    op.create_table(
        "ft_best",
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("problem_id", sa.Integer(), nullable=False),
        sa.Column("seqlen", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("median_ms", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(["device_id"], ["ft_devices.id"],
                                name="fk_ft_best_device_id_ft_devices"),
        sa.ForeignKeyConstraint(["problem_id"], ["ft_problems.id"],
                                name="fk_ft_best_problem_id_ft_problems"),
        sa.ForeignKeyConstraint(["trial_id"], ["ft_trials.id"],
                                name="fk_ft_best_trial_id_ft_trials"),
        sa.PrimaryKeyConstraint("device_id", "problem_id", "seqlen", name="pk_ft_best"),
    )


def downgrade() -> None:
    op.drop_table("ft_best")
    op.drop_index("ix_ft_trials_bucket", table_name="ft_trials")
    op.drop_table("ft_trials")
    op.drop_table("ft_configs")
    op.drop_table("ft_problems")
    op.drop_table("ft_devices")
