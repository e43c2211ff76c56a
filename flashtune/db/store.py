"""TuningStore: the tuning database as the tuner and the dispatcher see it.

Open one with ``TuningStore(url)`` (default: the setting ``FLASHTUNE_DB``). Opening checks the
schema version (see ``flashtune.db.schema``) and creates a new database on first use;
``TuningStore(url, create=False)`` opens an existing database read-only and never writes to
it. Opening an existing SQLite file runs SQLite's quick check once per file and process:
a damaged file is refused by writers and read with one warning by readers. Every method is
one transaction; writes are atomic and safe with concurrent writers
(several processes on one SQLite file, or several machines on one PostgreSQL server).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType

from sqlalchemy.engine import URL

from flashtune.codegen.arch import get_arch
from flashtune.db import rows
from flashtune.db.engine import (
    describe,
    integrity_problems,
    make_engine,
    resolve_url,
    session_scope,
    sqlite_file,
)
from flashtune.db.lookup import Match, nearest, resolve
from flashtune.db.models import DeviceRow
from flashtune.db.records import (
    FAILED_STATUSES,
    BestEntry,
    DeviceRecord,
    DigestOf,
    Provenance,
    TrialRecord,
    TrialStatus,
)
from flashtune.db.schema import MIGRATIONS_DIR, SchemaState, ensure_schema
from flashtune.db.trust import trusted, trusted_condition
from flashtune.errors import DatabaseError

log = logging.getLogger("flashtune.db")

#: SQLite files checked in this process ((path, inode) -> what the quick check found).
_checked: dict[tuple[str, int], list[str]] = {}
_checked_lock = threading.Lock()


class TuningStore:
    """Devices, trials and the best trial per (device, problem, seqlen bucket).

    ``create=False`` refuses to create a new database (e.g. the source of a merge) and,
    unless ``read_only=False`` is given, opens it read-only (nothing is ever written, so a
    database in a read-only directory can be read); ``upgrade=True`` migrates an older
    schema instead of raising ``SchemaVersionError``.
    """

    def __init__(self, url: str | Path | URL | None = None, *, create: bool = True,
                 upgrade: bool = False, migrations: Path = MIGRATIONS_DIR,
                 read_only: bool | None = None, installed: DigestOf | None = None) -> None:
        self.url = resolve_url(url)
        #: The installed kernel sources' digests (``flashtune.runtime.installed``), when the
        #: caller knows them: lookups then skip stale results, and a stale result never
        #: displaces a current best.
        self.installed = installed
        self.read_only = (not create) if read_only is None else read_only
        self.engine = make_engine(self.url, create=create, read_only=self.read_only)
        try:
            self._check_integrity()
            self.schema: SchemaState = ensure_schema(self.engine, create=create,
                                                     upgrade=upgrade, migrations=migrations)
        except BaseException:
            self.engine.dispose()
            raise

    def _check_integrity(self) -> None:
        """SQLite's quick check, once per file and process, at open: a damaged file is
        refused by writers (every open) and read with one warning by readers."""
        path = sqlite_file(self.url)
        try:
            inode = os.stat(path).st_ino if path is not None else None
        except OSError:
            inode = None  # a new database: nothing to check yet
        if path is None or inode is None:
            return
        key = (str(path), inode)
        with _checked_lock:
            first = key not in _checked
            if first:
                _checked[key] = integrity_problems(self.engine, quick=True)
            problems = _checked[key]
        if not problems:
            return
        shown = "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)"
                                           if len(problems) > 3 else "")
        fix = (f"restore {path} from a backup, or save what still reads (`flashtune db "
               f"export --db {path} -o saved.json`) and import it into a new database "
               "(`flashtune db import --db NEW.db saved.json`)")
        if not self.read_only:
            raise DatabaseError(f"{path} failed SQLite's integrity check ({shown}); flashtune "
                                f"does not write into a damaged database. Fix: {fix}")
        if first:
            log.warning("the tuning database %s failed SQLite's integrity check (%s); what "
                        "it returns may be incomplete or wrong. Fix: %s", path, shown, fix)

    @property
    def where(self) -> str:
        """The database URL without its password, for messages."""
        return describe(self.url)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> TuningStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ----------------------------------------------------------------- writes

    def record_device(self, device: DeviceRecord) -> None:
        """Insert the device, or update its software versions if already known.

        Raises DatabaseError if a device of the same name has different hardware.
        """
        with session_scope(self.engine, write=True, action="recording a device") as session:
            rows.Writer(session).device(device, update_software=True)

    def record_trial(self, trial: TrialRecord) -> bool:
        """Store one trial; True if it became the best of its bucket."""
        return self.record_trials([trial]) == 1

    def record_trials(self, trials: Iterable[TrialRecord]) -> int:
        """Store trials in one transaction; returns how many became the best of their bucket.

        An ``ok`` trial replaces the bucket's best only when strictly faster (median), so
        the first of equally fast configs stays. The devices must have been recorded.
        """
        became_best = 0
        with session_scope(self.engine, write=True, action="recording trials") as session:
            writer = rows.Writer(session, self.installed)
            for trial in trials:
                became_best += writer.offer_best(writer.trial(trial), replace="faster")
        return became_best

    def set_best(self, trial_uid: str) -> BestEntry:
        """Make the stored trial ``trial_uid`` the best of its bucket outright; returns the
        bucket's new best entry.

        For a winner chosen by more than one median (the tuner re-measures its finalists and
        breaks near-ties by a tolerance), it replaces the current best even if that one is
        faster; later ``record_trial`` calls compare against the new best as usual. Raises
        DatabaseError, writing nothing, if no trial has this uid or if the trial is not
        ``ok`` with a median time (a failed or untimed trial can never be a best).
        """
        with session_scope(self.engine, write=True, action="setting a bucket's best") as session:
            row = rows.find_trial(session, trial_uid)
            if row is None:
                raise DatabaseError(f"no trial with uid {trial_uid!r} is recorded; record it "
                                    "(TuningStore.record_trial) before making it the best")
            if row.status != TrialStatus.OK.value or row.median_ms is None:
                raise DatabaseError(
                    f"trial {trial_uid!r} has status {row.status!r} and median time "
                    f"{row.median_ms!r} ms; only an 'ok' trial with a median time can be the "
                    "best of its bucket")
            rows.Writer(session).offer_best(row, replace="always")
            (entry,) = rows.select_best(session, uids=[trial_uid])
        return entry

    # ------------------------------------------------------------------ reads

    def devices(self, names: Sequence[str] = ()) -> list[DeviceRecord]:
        with session_scope(self.engine, write=False, action="reading devices") as session:
            return rows.select_devices(session, names)

    def device(self, name: str) -> DeviceRecord | None:
        found = self.devices([name])
        return found[0] if found else None

    def trials(self, *, device: str | None = None, problem: str | None = None,
               seqlen: int | None = None, status: TrialStatus | None = None,
               limit: int | None = None, shape_class: str | None = None
               ) -> list[TrialRecord]:
        """Trials matching the given filters (a None filter matches all), oldest first."""
        with session_scope(self.engine, write=False, action="reading trials") as session:
            return rows.select_trials(
                session, devices=[device] if device else [], problems=[problem] if problem else [],
                seqlen=seqlen, statuses=[status] if status else [], limit=limit,
                shape_class=shape_class)

    def best_entries(self, *, device: str | None = None, problem: str | None = None,
                     seqlen: int | None = None, arch: str | None = None) -> list[BestEntry]:
        """Best entries matching the given filters, by device, problem and seqlen."""
        with session_scope(self.engine, write=False, action="reading best results") as session:
            return rows.select_best(
                session, devices=[device] if device else [], problems=[problem] if problem else [],
                seqlen=seqlen, cc=get_arch(arch).compute_capability if arch else None)

    def serving_best(self, device: str, arch: str) -> list[BestEntry]:
        """What may serve ``device`` (of ``arch``): its own best entries and those of other
        devices of its arch from trusted sources (``trust.trusted``), read in one
        transaction; nothing else is read (the dispatcher loads this, lazily)."""
        with session_scope(self.engine, write=False, action="reading best results") as session:
            own = rows.select_best(session, devices=[device])
            others = rows.select_best(session, cc=get_arch(arch).compute_capability,
                                      where=[DeviceRow.name != device, trusted_condition()])
        return own + [e for e in others if trusted(e)]

    def all_best(self) -> list[BestEntry]:
        """Every best entry at once (the dispatcher reads this once per process)."""
        return self.best_entries()

    def best(self, device: str, problem: str, seqlen: int,
             shape_class: str = "") -> BestEntry | None:
        """The best entry of exactly this bucket (and shape class) on this device."""
        found = [e for e in self.best_entries(device=device, problem=problem, seqlen=seqlen)
                 if e.shape_class == shape_class]
        return found[0] if found else None

    def nearest_best(self, device: str, problem: str, seqlen: int,
                     shape_class: str = "") -> BestEntry | None:
        """This device's best entry for ``problem`` and ``shape_class`` in the bucket
        nearest in log2(seqlen)."""
        return nearest([e for e in self.best_entries(device=device, problem=problem)
                        if e.shape_class == shape_class], seqlen)

    def family_best(self, arch: str, problem: str, seqlen: int, *,
                    exclude_device: str | None = None,
                    shape_class: str = "") -> BestEntry | None:
        """The nearest-bucket best entry of another device of the same arch (e.g. sm_90)."""
        entries = [e for e in self.best_entries(arch=arch, problem=problem)
                   if e.device != exclude_device and e.shape_class == shape_class]
        return nearest(entries, seqlen)

    def lookup(self, *, device: str, arch: str, problem: str, seqlen: int,
               shape_class: str = "") -> Match | None:
        """Exact, else nearest bucket on this device, else the same arch (lookup.py)."""
        with session_scope(self.engine, write=False, action="looking up a config") as session:
            entries = rows.select_best(session, problems=[problem],
                                       cc=get_arch(arch).compute_capability)
            entries += rows.select_best(session, devices=[device], problems=[problem])
        return resolve(entries, device=device, arch=arch, problem=problem, seqlen=seqlen,
                       shape_class=shape_class, installed=self.installed)

    def outcomes(self, device: str, problem: str, seqlen: int,
                 shape_class: str = "") -> dict[str, dict[str, frozenset[TrialStatus]]]:
        """config key -> template digest -> statuses seen, for every trial of the bucket."""
        with session_scope(self.engine, write=False, action="reading trial outcomes") as session:
            found = rows.outcomes(session, device, problem, seqlen, shape_class)
        result: dict[str, dict[str, set[TrialStatus]]] = {}
        for key, digest, status in found:
            result.setdefault(key, {}).setdefault(digest, set()).add(status)
        return {key: {d: frozenset(s) for d, s in by_digest.items()}
                for key, by_digest in result.items()}

    def tried_configs(self, device: str, problem: str, seqlen: int, *,
                      template_digest: str | None = None,
                      shape_class: str = "") -> frozenset[str]:
        """Config keys with any trial in the bucket (only with this digest, if given)."""
        found = self.outcomes(device, problem, seqlen, shape_class)
        return frozenset(key for key, by_digest in found.items()
                         if template_digest is None or template_digest in by_digest)

    def failed_configs(self, device: str, problem: str, seqlen: int, *,
                       template_digest: str | None = None,
                       shape_class: str = "") -> frozenset[str]:
        """Config keys known to fail in the bucket (invalid, compile/runtime failure, wrong
        result), only with this digest if given. The tuner never retries these."""
        return frozenset(
            key for key, by_digest in self.outcomes(device, problem, seqlen, shape_class).items()
            if any(statuses & FAILED_STATUSES for digest, statuses in by_digest.items()
                   if template_digest is None or digest == template_digest))

    def record_verification(self, trial_uid: str, template_digest: str, passed: bool,
                            backend: str, detail: str | None = None) -> None:
        """Record a re-check of trial ``trial_uid``'s config on the kernel sources of
        ``template_digest`` (``flashtune db verify``): a pass on the installed sources makes
        a stale best servable again, a failure keeps it from being served."""
        with session_scope(self.engine, write=True, action="recording a verification") as session:
            row = rows.find_trial(session, trial_uid)
            if row is None:
                raise DatabaseError(f"no trial with uid {trial_uid!r} is recorded")
            rows.Writer(session).verification(row, template_digest, passed, backend, detail)

    def provenance(self, uids: Sequence[str]) -> dict[str, Provenance]:
        """The provenance of each imported trial among ``uids`` (local ones have none)."""
        with session_scope(self.engine, write=False, action="reading provenance") as session:
            return rows.provenances(session, list(uids))

    def integrity_problems(self) -> list[str]:
        """What SQLite's integrity check finds wrong with the file ([] when sound)."""
        return integrity_problems(self.engine)

    def counts(self) -> dict[str, int]:
        """Row counts: devices, problems, configs, trials, best."""
        with session_scope(self.engine, write=False, action="counting rows") as session:
            return rows.counts(session)
