"""Row-level operations inside an open session: records in, records out.

Shared by the store (one trial at a time) and by bundle import/merge (many at once). Every
function here runs inside a transaction opened by ``engine.session_scope``; none commits.
Inserts that may race with another writer use the backend's ``INSERT ... ON CONFLICT``, so
concurrent writers on PostgreSQL never fail on a duplicate key and SQLite (whose writers are
serialised by ``BEGIN IMMEDIATE``) takes the same path.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from flashtune.db.models import BestRow, ConfigRow, DeviceRow, KeyedRow, ProblemRow, TrialRow
from flashtune.db.records import BestEntry, DeviceRecord, Keyed, TrialRecord, TrialStatus
from flashtune.errors import DatabaseError

_SOFTWARE = ("driver_version", "cuda_version", "nvrtc_version", "cupy_version")


def _insert(session: Session, table: type[Any]) -> Any:
    """An INSERT with ``on_conflict_do_*`` for the session's backend."""
    if session.get_bind().dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def _invalid_row(table: str, ident: object, exc: ValueError) -> DatabaseError:
    return DatabaseError(f"{table} row {ident!r} holds an invalid value ({exc}); the database "
                         "was written by something other than flashtune or damaged")


def device_to_record(row: DeviceRow) -> DeviceRecord:
    try:
        return DeviceRecord(row.name, row.cc_major, row.cc_minor, row.sm_count,
                            row.memory_bytes, row.driver_version, row.cuda_version,
                            row.nvrtc_version, row.cupy_version)
    except ValueError as exc:
        raise _invalid_row("ft_devices", row.name, exc) from None


def hardware_conflict(old: DeviceRecord, new: DeviceRecord) -> str | None:
    """Why ``new`` cannot be the same device as ``old``, or None if it can."""
    if old.hardware == new.hardware:
        return None
    return (f"device {new.name!r} is recorded as {old.arch} with {old.sm_count} SMs and "
            f"{old.memory_bytes} bytes, but is now described as {new.arch} with "
            f"{new.sm_count} SMs and {new.memory_bytes} bytes; a device name must identify one "
            "kind of GPU")


class Writer:
    """Writes within one session, remembering row ids so that a batch of trials costs few
    round trips (one INSERT per trial, plus one upsert for an ok trial)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._devices: dict[str, int] = {}
        self._keyed: dict[tuple[str, str], int] = {}

    def device(self, device: DeviceRecord, *, update_software: bool) -> int:
        """The id of ``device``'s row, inserting it if new; software versions updated if asked.

        Raises DatabaseError if a device of that name has different hardware.
        """
        session = self.session
        values = {name: getattr(device, name) for name in (
            "name", "cc_major", "cc_minor", "sm_count", "memory_bytes", *_SOFTWARE)}
        session.execute(_insert(session, DeviceRow).values(values)
                        .on_conflict_do_nothing(index_elements=["name"]))
        row = session.execute(sa.select(DeviceRow).where(DeviceRow.name == device.name)
                              ).scalar_one()
        conflict = hardware_conflict(device_to_record(row), device)
        if conflict:
            raise DatabaseError(conflict)
        if update_software:
            for name in _SOFTWARE:
                setattr(row, name, getattr(device, name))
        self._devices[device.name] = row.id
        return row.id

    def device_id(self, name: str) -> int | None:
        if name not in self._devices:
            found = self.session.execute(sa.select(DeviceRow.id).where(DeviceRow.name == name)
                                         ).scalar()
            if found is None:
                return None
            self._devices[name] = found
        return self._devices[name]

    def keyed(self, table: type[KeyedRow], keyed: Keyed) -> int:
        """The id of the problem or config row with ``keyed.key``, inserting it if new."""
        cache_key = (table.__name__, keyed.key)
        if cache_key in self._keyed:
            return self._keyed[cache_key]
        session = self.session
        session.execute(_insert(session, table).values(key=keyed.key, fields=keyed.as_dict())
                        .on_conflict_do_nothing(index_elements=["key"]))
        row = session.execute(sa.select(table).where(table.key == keyed.key)).scalar_one()
        if row.fields != keyed.as_dict():
            raise DatabaseError(
                f"{table.__name__} {keyed.key!r} is stored with fields {row.fields} but the "
                f"new record has {keyed.as_dict()}; the same key must always mean the same "
                "fields")
        self._keyed[cache_key] = row.id
        return row.id

    def trial(self, trial: TrialRecord) -> TrialRow:
        """Insert ``trial`` (its device must exist) and return its row."""
        dev = self.device_id(trial.device)
        if dev is None:
            raise DatabaseError(f"device {trial.device!r} is not recorded; record the device "
                                "(TuningStore.record_device) before its trials")
        row = TrialRow(
            uid=trial.uid, device_id=dev, problem_id=self.keyed(ProblemRow, trial.problem),
            seqlen=trial.seqlen, config_id=self.keyed(ConfigRow, trial.config),
            status=trial.status.value, median_ms=trial.median_ms, min_ms=trial.min_ms,
            max_ms=trial.max_ms, count=trial.count, tflops=trial.tflops,
            predicted_ms=trial.predicted_ms, error=trial.error,
            template_digest=trial.template_digest, flashtune_version=trial.flashtune_version,
            host=trial.host, study=trial.study, created_at=trial.created_at,
        )
        self.session.add(row)
        self.session.flush()
        return row

    def offer_best(self, row: TrialRow, *, replace: str) -> bool:
        """Make trial ``row`` the best of its bucket if ``replace`` allows; True if it did.

        ``replace`` is ``"faster"`` (only if strictly faster than the current best, or
        none), ``"always"`` or ``"never"`` (only if the bucket has no best yet). Trials that
        are not ``ok`` with a time are never made best.
        """
        if row.status != TrialStatus.OK.value or row.median_ms is None:
            return False
        key = {"device_id": row.device_id, "problem_id": row.problem_id, "seqlen": row.seqlen}
        stmt = _insert(self.session, BestRow).values(**key, trial_id=row.id,
                                                     median_ms=row.median_ms)
        if replace == "never":
            stmt = stmt.on_conflict_do_nothing(index_elements=list(key))
        else:
            excluded = stmt.excluded
            where = BestRow.median_ms > excluded.median_ms if replace == "faster" else None
            stmt = stmt.on_conflict_do_update(
                index_elements=list(key),
                set_={"trial_id": excluded.trial_id, "median_ms": excluded.median_ms},
                where=where,
            )
        # A row comes back only if the insert or the update happened.
        return self.session.execute(stmt.returning(BestRow.trial_id)).first() is not None


def find_trial(session: Session, uid: str) -> TrialRow | None:
    """The row of the trial with this uid, or None."""
    return session.execute(sa.select(TrialRow).where(TrialRow.uid == uid)).scalar_one_or_none()


def _utc(value: datetime) -> datetime:
    # SQLite hands back naive datetimes; everything stored is UTC.
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


def _trial_query() -> sa.Select[TrialRow, DeviceRow, ProblemRow, ConfigRow]:
    return (sa.select(TrialRow, DeviceRow, ProblemRow, ConfigRow)
            .join(DeviceRow, TrialRow.device_id == DeviceRow.id)
            .join(ProblemRow, TrialRow.problem_id == ProblemRow.id)
            .join(ConfigRow, TrialRow.config_id == ConfigRow.id))


def _filters(devices: Sequence[str], problems: Sequence[str], seqlen: int | None,
             uids: Sequence[str]) -> list[sa.ColumnElement[bool]]:
    """Conditions on a ``_trial_query`` for every non-empty filter (none: match all)."""
    found: list[sa.ColumnElement[bool]] = []
    if devices:
        found.append(DeviceRow.name.in_(devices))
    if problems:
        found.append(ProblemRow.key.in_(problems))
    if seqlen is not None:
        found.append(TrialRow.seqlen == seqlen)
    if uids:
        found.append(TrialRow.uid.in_(uids))
    return found


def _to_trial(row: TrialRow, dev: DeviceRow, prob: ProblemRow, conf: ConfigRow) -> TrialRecord:
    try:
        return _build_trial(row, dev, prob, conf)
    except ValueError as exc:
        raise _invalid_row("ft_trials", row.uid, exc) from None


def _build_trial(row: TrialRow, dev: DeviceRow, prob: ProblemRow,
                 conf: ConfigRow) -> TrialRecord:
    return TrialRecord(
        device=dev.name, problem=Keyed.from_mapping(prob.key, prob.fields), seqlen=row.seqlen,
        config=Keyed.from_mapping(conf.key, conf.fields), status=TrialStatus(row.status),
        template_digest=row.template_digest, median_ms=row.median_ms, min_ms=row.min_ms,
        max_ms=row.max_ms, count=row.count, tflops=row.tflops, predicted_ms=row.predicted_ms,
        error=row.error, study=row.study, host=row.host,
        flashtune_version=row.flashtune_version, created_at=_utc(row.created_at), uid=row.uid,
    )


def select_trials(session: Session, *, devices: Sequence[str] = (),
                  problems: Sequence[str] = (), seqlen: int | None = None,
                  statuses: Sequence[TrialStatus] = (), uids: Sequence[str] = (),
                  limit: int | None = None) -> list[TrialRecord]:
    """Trials matching every given filter (empty filters match all), oldest first."""
    stmt = _trial_query().where(*_filters(devices, problems, seqlen, uids))
    if statuses:
        stmt = stmt.where(TrialRow.status.in_([s.value for s in statuses]))
    stmt = stmt.order_by(TrialRow.created_at, TrialRow.uid).limit(limit)
    return [_to_trial(*row) for row in session.execute(stmt)]


def select_best(session: Session, *, devices: Sequence[str] = (),
                problems: Sequence[str] = (), seqlen: int | None = None,
                cc: tuple[int, int] | None = None,
                uids: Sequence[str] = ()) -> list[BestEntry]:
    """Best entries matching every given filter, ordered by device, problem and seqlen."""
    stmt = (_trial_query().add_columns(BestRow.trial_id)
            .join(BestRow, BestRow.trial_id == TrialRow.id)
            .where(*_filters(devices, problems, seqlen, uids)))
    if cc is not None:
        stmt = stmt.where(DeviceRow.cc_major == cc[0], DeviceRow.cc_minor == cc[1])
    stmt = stmt.order_by(DeviceRow.name, ProblemRow.key, TrialRow.seqlen)
    entries = []
    for row, dev, prob, conf, _ in session.execute(stmt):
        entries.append(BestEntry(_to_trial(row, dev, prob, conf),
                                 f"sm_{dev.cc_major}{dev.cc_minor}"))
    return entries


def select_devices(session: Session, names: Sequence[str] = ()) -> list[DeviceRecord]:
    stmt = sa.select(DeviceRow).order_by(DeviceRow.name)
    if names:
        stmt = stmt.where(DeviceRow.name.in_(names))
    return [device_to_record(row) for row in session.execute(stmt).scalars()]


def outcomes(session: Session, device: str, problem: str,
             seqlen: int) -> list[tuple[str, str, TrialStatus]]:
    """(config key, template digest, status) of every trial in this bucket, deduplicated."""
    stmt = (sa.select(ConfigRow.key, TrialRow.template_digest, TrialRow.status).distinct()
            .join(TrialRow, TrialRow.config_id == ConfigRow.id)
            .join(DeviceRow, TrialRow.device_id == DeviceRow.id)
            .join(ProblemRow, TrialRow.problem_id == ProblemRow.id)
            .where(DeviceRow.name == device, ProblemRow.key == problem,
                   TrialRow.seqlen == seqlen))
    return [(key, digest, TrialStatus(status))
            for key, digest, status in session.execute(stmt)]


def counts(session: Session) -> dict[str, int]:
    """Row counts of the flashtune tables, by short name."""
    return {name: session.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
            for name, table in (("devices", DeviceRow), ("problems", ProblemRow),
                                ("configs", ConfigRow), ("trials", TrialRow),
                                ("best", BestRow))}
