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
        Index("ix_ft_trials_bucket", "device_id", "problem_id", "seqlen"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    uid: Mapped[str] = mapped_column(String(32), unique=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("ft_devices.id"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("ft_problems.id"))
    seqlen: Mapped[int] = mapped_column(Integer)
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


class BestRow(Base):
    """The best ok trial per (device, problem, seqlen bucket).

    ``median_ms`` repeats the trial's median so that "replace only if faster" is a single
    atomic upsert, safe under concurrent writers on any backend.
    """

    __tablename__ = "ft_best"

    device_id: Mapped[int] = mapped_column(ForeignKey("ft_devices.id"), primary_key=True)
    problem_id: Mapped[int] = mapped_column(ForeignKey("ft_problems.id"), primary_key=True)
    seqlen: Mapped[int] = mapped_column(Integer, primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("ft_trials.id"))
    median_ms: Mapped[float] = mapped_column(Double)
