"""Row-level operations inside an open session: records in, records out.

Shared by the store (one trial at a time) and by bundle import/merge (many at once). Every
function here runs inside a transaction opened by ``engine.session_scope``; none commits.
Every trial written is held to codegen's rules (its problem, config and bucket must be
legal, with fields matching their keys) and to physics (``physics.implausible``); a bucket's
best prefers results on the installed kernel sources over stale ones (``trust.py``).
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

from flashtune.db.checks import physics_problem, semantic_problem
from flashtune.db.models import (
    BestRow,
    ConfigRow,
    DeviceRow,
    ImportRow,
    KeyedRow,
    ProblemRow,
    TrialRow,
    VerificationRow,
)
from flashtune.db.records import (
    BestEntry,
    DeviceRecord,
    DigestOf,
    Keyed,
    Provenance,
    TrialRecord,
    TrialStatus,
    now_utc,
    this_host,
)
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

    def __init__(self, session: Session, installed: DigestOf | None = None) -> None:
        self.session = session
        #: The installed kernel sources' digests: with it, a best measured on them is never
        #: displaced by a stale result, and always displaces one.
        self.installed = installed
        self._devices: dict[str, int] = {}
        self._records: dict[str, DeviceRecord] = {}
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

    def device_record(self, name: str) -> DeviceRecord | None:
        if name not in self._records:
            row = self.session.execute(sa.select(DeviceRow).where(DeviceRow.name == name)
                                       ).scalar_one_or_none()
            if row is None:
                return None
            self._records[name] = device_to_record(row)
        return self._records[name]

    def import_row(self, provenance: Provenance) -> int:
        """Record one import and return its id (its trials point to it)."""
        row = ImportRow(
            bundle_sha256=provenance.bundle_sha256, source=provenance.source,
            exported_by=provenance.exported_by, exported_at=provenance.exported_at,
            imported_at=provenance.imported_at, imported_by=provenance.imported_by,
            trusted=provenance.trusted)
        self.session.add(row)
        self.session.flush()
        return row.id

    def trial(self, trial: TrialRecord, *, import_id: int | None = None) -> TrialRow:
        """Insert ``trial`` (its device must exist) and return its row.

        Raises DatabaseError, writing nothing, for a trial that breaks codegen's rules or
        whose timing is physically impossible on its device.
        """
        dev = self.device_id(trial.device)
        if dev is None:
            raise DatabaseError(f"device {trial.device!r} is not recorded; record the device "
                                "(TuningStore.record_device) before its trials")
        device = self.device_record(trial.device)
        assert device is not None
        reason = semantic_problem(trial) or physics_problem(trial, device)
        if reason is not None:
            raise DatabaseError(reason)
        row = TrialRow(
            uid=trial.uid, device_id=dev, problem_id=self.keyed(ProblemRow, trial.problem),
            seqlen=trial.seqlen, shape_class=trial.shape_class,
            config_id=self.keyed(ConfigRow, trial.config),
            status=trial.status.value, median_ms=trial.median_ms, min_ms=trial.min_ms,
            max_ms=trial.max_ms, count=trial.count, tflops=trial.tflops,
            predicted_ms=trial.predicted_ms, error=trial.error,
            template_digest=trial.template_digest, flashtune_version=trial.flashtune_version,
            host=trial.host, study=trial.study, created_at=trial.created_at,
            import_id=import_id,
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
        key = {"device_id": row.device_id, "problem_id": row.problem_id, "seqlen": row.seqlen,
               "shape_class": row.shape_class}
        if replace != "always" and self.installed is not None:
            old = self.session.execute(
                sa.select(TrialRow).join(BestRow, BestRow.trial_id == TrialRow.id)
                .where(BestRow.device_id == row.device_id, BestRow.problem_id == row.problem_id,
                       BestRow.seqlen == row.seqlen, BestRow.shape_class == row.shape_class)
            ).scalar_one_or_none()
            if old is not None:
                new_current, old_current = self._current(row), self._current(old)
                if new_current and not old_current:
                    replace = "always"  # a result on the installed sources beats a stale one
                elif old_current and not new_current:
                    return False  # a stale result never displaces a current one
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


    def _current(self, row: TrialRow) -> bool:
        """Whether ``row`` may be served on the installed kernel sources."""
        assert self.installed is not None
        problem = self.session.get(ProblemRow, row.problem_id)
        config = self.session.get(ConfigRow, row.config_id)
        if problem is None or config is None:
            return False
        digest = self.installed(problem.key, config.key)
        if digest is None:
            return False
        if row.template_digest == digest:
            return True
        return _verdicts(self.session, [row.id]).get(row.id, {}).get(digest) is True

    def verification(self, row: TrialRow, template_digest: str, passed: bool, backend: str,
                     detail: str | None) -> None:
        """Record a re-check of ``row``'s config on the sources of ``template_digest``."""
        self.session.add(VerificationRow(
            trial_id=row.id, template_digest=template_digest, passed=passed, backend=backend,
            host=this_host(), checked_at=now_utc(), detail=detail))
        self.session.flush()


def _verdicts(session: Session, trial_ids: Sequence[int]) -> dict[int, dict[str, bool]]:
    """Per trial, per template digest, the verdict of its latest verification."""
    found: dict[int, dict[str, bool]] = {}
    for start in range(0, len(trial_ids), 500):
        chunk = list(trial_ids[start:start + 500])
        stmt = (sa.select(VerificationRow.trial_id, VerificationRow.template_digest,
                          VerificationRow.passed)
                .where(VerificationRow.trial_id.in_(chunk))
                .order_by(VerificationRow.checked_at, VerificationRow.id))
        for trial_id, digest, passed in session.execute(stmt):
            found.setdefault(trial_id, {})[digest] = bool(passed)
    return found


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
             uids: Sequence[str], shape_class: str | None = None
             ) -> list[sa.ColumnElement[bool]]:
    """Conditions on a ``_trial_query`` for every non-empty filter (none: match all)."""
    found: list[sa.ColumnElement[bool]] = []
    if devices:
        found.append(DeviceRow.name.in_(devices))
    if problems:
        found.append(ProblemRow.key.in_(problems))
    if seqlen is not None:
        found.append(TrialRow.seqlen == seqlen)
    if shape_class is not None:
        found.append(TrialRow.shape_class == shape_class)
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
        shape_class=row.shape_class,
        config=Keyed.from_mapping(conf.key, conf.fields), status=TrialStatus(row.status),
        template_digest=row.template_digest, median_ms=row.median_ms, min_ms=row.min_ms,
        max_ms=row.max_ms, count=row.count, tflops=row.tflops, predicted_ms=row.predicted_ms,
        error=row.error, study=row.study, host=row.host,
        flashtune_version=row.flashtune_version, created_at=_utc(row.created_at), uid=row.uid,
    )


def select_trials(session: Session, *, devices: Sequence[str] = (),
                  problems: Sequence[str] = (), seqlen: int | None = None,
                  statuses: Sequence[TrialStatus] = (), uids: Sequence[str] = (),
                  limit: int | None = None, shape_class: str | None = None
                  ) -> list[TrialRecord]:
    """Trials matching every given filter (empty filters, a None ``shape_class``: match
    all), oldest first."""
    stmt = _trial_query().where(*_filters(devices, problems, seqlen, uids, shape_class))
    if statuses:
        stmt = stmt.where(TrialRow.status.in_([s.value for s in statuses]))
    stmt = stmt.order_by(TrialRow.created_at, TrialRow.uid).limit(limit)
    return [_to_trial(*row) for row in session.execute(stmt)]


def select_best(session: Session, *, devices: Sequence[str] = (),
                problems: Sequence[str] = (), seqlen: int | None = None,
                cc: tuple[int, int] | None = None,
                uids: Sequence[str] = (),
                where: Sequence[sa.ColumnElement[bool]] = (),
                shape_class: str | None = None) -> list[BestEntry]:
    """Best entries matching every given filter, ordered by device, problem, seqlen and
    shape class. ``where``: further conditions on the trial, its device and its import
    (ImportRow)."""
    stmt = (_trial_query().add_columns(BestRow.trial_id)
            .join(BestRow, BestRow.trial_id == TrialRow.id)
            .where(*_filters(devices, problems, seqlen, uids, shape_class), *where))
    if cc is not None:
        stmt = stmt.where(DeviceRow.cc_major == cc[0], DeviceRow.cc_minor == cc[1])
    stmt = (stmt.add_columns(ImportRow).outerjoin(ImportRow, TrialRow.import_id == ImportRow.id)
            .order_by(DeviceRow.name, ProblemRow.key, TrialRow.seqlen, TrialRow.shape_class))
    found = [(row, _to_trial(row, dev, prob, conf), f"sm_{dev.cc_major}{dev.cc_minor}", imp)
             for row, dev, prob, conf, _, imp in session.execute(stmt)]
    verdicts = _verdicts(session, [row.id for row, _, _, _ in found])
    entries = []
    for row, trial, arch, imp in found:
        verdict = verdicts.get(row.id, {})
        entries.append(BestEntry(
            trial, arch, _provenance(imp),
            verified=frozenset(d for d, ok in verdict.items() if ok),
            refuted=frozenset(d for d, ok in verdict.items() if not ok)))
    return entries


def provenances(session: Session, uids: Sequence[str]) -> dict[str, Provenance]:
    """The provenance of each imported trial among ``uids`` (local trials have none)."""
    found: dict[str, Provenance] = {}
    for start in range(0, len(uids), 500):
        stmt = (sa.select(TrialRow.uid, ImportRow)
                .join(ImportRow, TrialRow.import_id == ImportRow.id)
                .where(TrialRow.uid.in_(list(uids[start:start + 500]))))
        for uid, imp in session.execute(stmt):
            provenance = _provenance(imp)
            if provenance is not None:
                found[uid] = provenance
    return found


def _provenance(row: ImportRow | None) -> Provenance | None:
    if row is None:
        return None
    try:
        return Provenance(row.bundle_sha256, row.source, row.exported_by, _utc(row.exported_at),
                          _utc(row.imported_at), row.imported_by, bool(row.trusted))
    except ValueError as exc:
        raise _invalid_row("ft_imports", row.id, exc) from None


def select_devices(session: Session, names: Sequence[str] = ()) -> list[DeviceRecord]:
    stmt = sa.select(DeviceRow).order_by(DeviceRow.name)
    if names:
        stmt = stmt.where(DeviceRow.name.in_(names))
    return [device_to_record(row) for row in session.execute(stmt).scalars()]


def outcomes(session: Session, device: str, problem: str, seqlen: int,
             shape_class: str = "") -> list[tuple[str, str, TrialStatus]]:
    """(config key, template digest, status) of every trial in this bucket, deduplicated."""
    stmt = (sa.select(ConfigRow.key, TrialRow.template_digest, TrialRow.status).distinct()
            .join(TrialRow, TrialRow.config_id == ConfigRow.id)
            .join(DeviceRow, TrialRow.device_id == DeviceRow.id)
            .join(ProblemRow, TrialRow.problem_id == ProblemRow.id)
            .where(DeviceRow.name == device, ProblemRow.key == problem,
                   TrialRow.seqlen == seqlen, TrialRow.shape_class == shape_class))
    return [(key, digest, TrialStatus(status))
            for key, digest, status in session.execute(stmt)]


def counts(session: Session) -> dict[str, int]:
    """Row counts of the flashtune tables, by short name."""
    return {name: session.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
            for name, table in (("devices", DeviceRow), ("problems", ProblemRow),
                                ("configs", ConfigRow), ("trials", TrialRow),
                                ("best", BestRow), ("imports", ImportRow),
                                ("verifications", VerificationRow))}
