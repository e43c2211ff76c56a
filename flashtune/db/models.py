"""SQLAlchemy tables of the tuning database.

Every table name starts with ``ft_`` so that Optuna's tables (``studies``, ``trials``,
``version_info``, ``alembic_version``, ...) can live in the same database. The schema is
created and changed only by the Alembic migrations in ``flashtune/db/migrations``; a test
checks that they produce exactly these models.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from flashtune.db.records import TrialStatus

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Constant SQL built from the enum, never from input.
STATUS_CHECK = "status IN (" + ", ".join(f"'{s.value}'" for s in TrialStatus) + ")"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class DeviceRow(Base):
    __tablename__ = "ft_devices"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    cc_major: Mapped[int] = mapped_column(Integer)
    cc_minor: Mapped[int] = mapped_column(Integer)
    sm_count: Mapped[int] = mapped_column(Integer)
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    driver_version: Mapped[str] = mapped_column(String(64))
    cuda_version: Mapped[str] = mapped_column(String(64))
    nvrtc_version: Mapped[str] = mapped_column(String(64))
    cupy_version: Mapped[str] = mapped_column(String(64))


class KeyedRow:
    """Columns of a table of canonical keys and their fields (problems, configs)."""

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(128), unique=True)
    fields: Mapped[dict[str, Any]] = mapped_column(JSON)


class ProblemRow(KeyedRow, Base):
    __tablename__ = "ft_problems"


class ConfigRow(KeyedRow, Base):
    __tablename__ = "ft_configs"


class TrialRow(Base):
    __tablename__ = "ft_trials"
    __table_args__ = (
        CheckConstraint(STATUS_CHECK, name="status"),
        Index("ix_ft_trials_bucket", "device_id", "problem_id", "seqlen", "shape_class"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uid: Mapped[str] = mapped_column(String(32), unique=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("ft_devices.id"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("ft_problems.id"))
    seqlen: Mapped[int] = mapped_column(Integer)
    #: The bucket's shape class (``ProblemBucket.shape_class``; '' for none).
    shape_class: Mapped[str] = mapped_column(String(32), server_default="")
    config_id: Mapped[int] = mapped_column(ForeignKey("ft_configs.id"))
    status: Mapped[str] = mapped_column(String(24))
    median_ms: Mapped[float | None] = mapped_column(Double)
    min_ms: Mapped[float | None] = mapped_column(Double)
    max_ms: Mapped[float | None] = mapped_column(Double)
    count: Mapped[int] = mapped_column(Integer)
    tflops: Mapped[float | None] = mapped_column(Double)
    predicted_ms: Mapped[float | None] = mapped_column(Double)
    error: Mapped[str | None] = mapped_column(Text)
    template_digest: Mapped[str] = mapped_column(String(128))
    flashtune_version: Mapped[str] = mapped_column(String(64))
    host: Mapped[str] = mapped_column(String(253))
    study: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    #: The import this trial came with; NULL for trials tuned into this database.
    import_id: Mapped[int | None] = mapped_column(ForeignKey("ft_imports.id"))


class ImportRow(Base):
    """One import of a bundle or merge of another database: the provenance of its rows."""

    __tablename__ = "ft_imports"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    bundle_sha256: Mapped[str] = mapped_column(String(64))
    source: Mapped[str] = mapped_column(String(255))
    exported_by: Mapped[str] = mapped_column(String(64))
    exported_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    imported_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    imported_by: Mapped[str] = mapped_column(String(253))
    trusted: Mapped[bool] = mapped_column(Boolean)


class VerificationRow(Base):
    """A re-check of a stored trial's config on the kernel sources of ``template_digest``
    (``flashtune db verify``): passed or not, where, when and how."""

    __tablename__ = "ft_verifications"
    __table_args__ = (Index("ix_ft_verifications_trial", "trial_id", "template_digest"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("ft_trials.id"))
    template_digest: Mapped[str] = mapped_column(String(128))
    passed: Mapped[bool] = mapped_column(Boolean)
    backend: Mapped[str] = mapped_column(String(32))
    host: Mapped[str] = mapped_column(String(253))
    checked_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    detail: Mapped[str | None] = mapped_column(Text)


class BestRow(Base):
    """The best ok trial per (device, problem, seqlen bucket, shape class).

    ``median_ms`` repeats the trial's median so that "replace only if faster" is a single
    atomic upsert, safe under concurrent writers on any backend.
    """

    __tablename__ = "ft_best"

    device_id: Mapped[int] = mapped_column(ForeignKey("ft_devices.id"), primary_key=True)
    problem_id: Mapped[int] = mapped_column(ForeignKey("ft_problems.id"), primary_key=True)
    seqlen: Mapped[int] = mapped_column(Integer, primary_key=True)
    shape_class: Mapped[str] = mapped_column(String(32), primary_key=True, server_default="")
    trial_id: Mapped[int] = mapped_column(ForeignKey("ft_trials.id"))
    median_ms: Mapped[float] = mapped_column(Double)
