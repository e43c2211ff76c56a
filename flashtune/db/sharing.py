"""Export, import and merge of tuning results between databases.

- ``export_bundle``: a Bundle of the devices, trials and best entries of a database
  (optionally only some devices / problems, or only the best trials).
- ``import_bundle``: writes a validated Bundle in one transaction, all or nothing. Trials
  are identified by uid (already present: skipped); for each bucket the bundle's best is
  kept according to ``prefer``: ``local-first`` (the default: as ``faster``, except that a
  best measured in this database, not imported, is never displaced by an imported one --
  a bundle may name this very device with invented timings), ``faster`` (the faster median
  wins, ties keep ours: the user lets imports displace local measurements), ``ours`` (only
  fills buckets we lack) or ``theirs`` (theirs replaces ours).
- ``merge_databases``: the same, with another database as the source.

Results measured on different kernel sources are never mixed silently: if a (problem,
config) pair was measured with one template digest here and another there, the import is
refused with the list of differing digests, unless ``allow_mixed_digests`` is given (the
report then lists them). Imported results from other kernel sources than the installed
ones are kept but stale (never served until re-measured or re-verified; see
``BestEntry.state``), and the report counts them.

Every import records its provenance (``ft_imports``: the bundle's content digest, the
source, the claimed exporter and export time, when and on which host it was imported, and
whether it was marked trusted); its trials point to it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.orm import Session

from flashtune.db import rows
from flashtune.db.bundle import Bundle, check_bundle
from flashtune.db.engine import session_scope
from flashtune.db.models import BestRow, ConfigRow, ProblemRow, TrialRow
from flashtune.db.records import (
    PREFER_CHOICES,
    DigestOf,
    Prefer,
    Provenance,
    now_utc,
    this_host,
    this_version,
)
from flashtune.db.store import TuningStore
from flashtune.errors import BundleError, DatabaseError

__all__ = ["PREFER_CHOICES", "DigestConflict", "Prefer", "ShareReport", "export_bundle",
           "import_bundle", "merge_databases"]

_REPLACE = {"local-first": "faster", "faster": "faster", "ours": "never", "theirs": "always"}
_CHUNK = 500  # bound on bound parameters per IN (...) query


@dataclass(frozen=True)
class DigestConflict:
    """A (problem, config) measured on different kernel sources here and in the source."""

    problem: str
    config: str
    ours: tuple[str, ...]
    theirs: tuple[str, ...]

    def describe(self) -> str:
        return (f"{self.problem} {self.config}: ours {', '.join(d[:12] for d in self.ours)} "
                f"vs theirs {', '.join(d[:12] for d in self.theirs)}")


@dataclass
class ShareReport:
    """What an import or merge did (or, with dry_run, would do), counted per kind."""

    added: Counter[str] = field(default_factory=Counter)
    updated: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    digest_conflicts: list[DigestConflict] = field(default_factory=list)
    dry_run: bool = False
    #: Trials of the source measured on other kernel sources than the installed ones
    #: (counted when the installed digests are known).
    stale: int = 0
    #: Buckets whose local best (measured here) was kept over a faster imported one
    #: (``prefer="local-first"``).
    kept_local: int = 0
    provenance: Provenance | None = None

    def rows(self) -> list[tuple[str, int, int, int]]:
        return [(kind, self.added[kind], self.updated[kind], self.skipped[kind])
                for kind in ("devices", "trials", "best")]


class _DryRun(Exception):
    """Raised inside the import transaction to roll it back after counting."""


def export_bundle(store: TuningStore, *, devices: Sequence[str] = (),
                  problems: Sequence[str] = (), best_only: bool = False,
                  created_at: datetime | None = None) -> Bundle:
    """A Bundle of ``store`` (restricted to the named devices / problem keys if given)."""
    with session_scope(store.engine, write=False, action="exporting a bundle") as session:
        device_records = rows.select_devices(session, devices)
        missing = sorted(set(devices) - {d.name for d in device_records})
        if missing:
            known = [d.name for d in rows.select_devices(session)]
            raise DatabaseError(f"no device named {missing} in {store.where}; known: {known}")
        best = rows.select_best(session, devices=devices, problems=problems)
        if best_only:
            trials = [entry.trial for entry in best]
        else:
            trials = rows.select_trials(session, devices=devices, problems=problems)
    return Bundle(tuple(device_records), tuple(trials), frozenset(e.trial.uid for e in best),
                  this_version(), created_at or now_utc())


def merge_databases(store: TuningStore, other: TuningStore, *, prefer: Prefer = "local-first",
                    allow_mixed_digests: bool = False, dry_run: bool = False,
                    trusted: bool = False, installed: DigestOf | None = None) -> ShareReport:
    """Merge every result of ``other`` into ``store`` (see the module doc for the rules)."""
    bundle = export_bundle(other)
    try:
        check_bundle(bundle)
    except BundleError as exc:
        raise BundleError(f"{other.where}: {exc}") from None
    return import_bundle(store, bundle, prefer=prefer, allow_mixed_digests=allow_mixed_digests,
                         dry_run=dry_run, source=other.where, trusted=trusted,
                         installed=installed)


def import_bundle(store: TuningStore, bundle: Bundle, *, prefer: Prefer = "local-first",
                  allow_mixed_digests: bool = False, dry_run: bool = False,
                  source: str = "bundle", trusted: bool = False,
                  installed: DigestOf | None = None) -> ShareReport:
    """Write an already validated ``bundle`` into ``store``, all or nothing.

    ``source`` (the file or database it came from) and ``trusted`` (the user vouches for
    it: its results may serve other devices) are recorded as the import's provenance.
    ``installed`` (the installed kernel sources' digests, default the store's) counts the
    stale trials and keeps a stale result from displacing a current best.
    """
    installed = installed if installed is not None else store.installed
    if prefer not in _REPLACE:
        raise ValueError(f"prefer={prefer!r}; expected one of {PREFER_CHOICES}")
    shown = source if len(source) <= 255 else "..." + source[-252:]
    provenance = Provenance(bundle.content_sha256, shown or "bundle",
                            bundle.flashtune_version, bundle.created_at, now_utc(),
                            this_host(), trusted)
    report = ShareReport(dry_run=dry_run, provenance=provenance)
    if installed is not None:
        report.stale = sum(installed(t.problem.key, t.config.key) != t.template_digest
                           for t in bundle.trials)
    try:
        with session_scope(store.engine, write=True, action="importing a bundle") as session:
            _check_conflicts(session, bundle, report, allow_mixed_digests)
            _write(session, bundle, report, _REPLACE[prefer], provenance, installed,
                   keep_local=prefer == "local-first")
            if dry_run:
                raise _DryRun
    except _DryRun:
        pass
    return report


def _chunks(items: Sequence[str]) -> Iterable[Sequence[str]]:
    for start in range(0, len(items), _CHUNK):
        yield items[start:start + _CHUNK]


def _check_conflicts(session: Session, bundle: Bundle, report: ShareReport,
                     allow_mixed_digests: bool) -> None:
    """Refuse (BundleError) what cannot be merged; record digest conflicts in ``report``."""
    ours_devices = {d.name: d for d in rows.select_devices(session, [d.name for d in
                                                                     bundle.devices])}
    for device in bundle.devices:
        if device.name in ours_devices:
            conflict = rows.hardware_conflict(ours_devices[device.name], device)
            if conflict:
                raise BundleError(conflict)
    uids = sorted(t.uid for t in bundle.trials)
    existing = {}
    for chunk in _chunks(uids):
        existing.update({t.uid: t for t in rows.select_trials(session, uids=chunk)})
    for trial in bundle.trials:
        if trial.uid in existing and existing[trial.uid] != trial:
            raise BundleError(f"trial {trial.uid} exists here with different content; the "
                              "bundle was altered or the uid reused")

    theirs: dict[tuple[str, str], set[str]] = {}
    for trial in bundle.trials:
        theirs.setdefault((trial.problem.key, trial.config.key), set()).add(
            trial.template_digest)
    ours: dict[tuple[str, str], set[str]] = {}
    problem_keys = sorted({key for key, _ in theirs})
    for chunk in _chunks(problem_keys):
        stmt = (sa.select(ProblemRow.key, ConfigRow.key, TrialRow.template_digest).distinct()
                .join(TrialRow, TrialRow.problem_id == ProblemRow.id)
                .join(ConfigRow, TrialRow.config_id == ConfigRow.id)
                .where(ProblemRow.key.in_(chunk)))
        for problem, config, digest in session.execute(stmt):
            ours.setdefault((problem, config), set()).add(digest)
    for pair in sorted(theirs):
        if ours.get(pair) and theirs[pair] - ours[pair]:
            report.digest_conflicts.append(DigestConflict(
                pair[0], pair[1], tuple(sorted(ours[pair])), tuple(sorted(theirs[pair]))))
    if report.digest_conflicts and not allow_mixed_digests:
        shown = "\n  ".join(c.describe() for c in report.digest_conflicts[:10])
        more = len(report.digest_conflicts) - 10
        raise BundleError(
            f"{len(report.digest_conflicts)} (problem, config) pairs were measured on "
            f"different kernel sources (template digests) here and in the source:\n  {shown}"
            + (f"\n  ... and {more} more" if more > 0 else "")
            + "\nTheir timings are not comparable. Re-tune with the same flashtune version, "
            "or pass --allow-mixed-digests to merge anyway"
        )


def _write(session: Session, bundle: Bundle, report: ShareReport, replace: str,
           provenance: Provenance, installed: DigestOf | None, *, keep_local: bool) -> None:
    writer = rows.Writer(session, installed)
    import_id = writer.import_row(provenance)
    for device in bundle.devices:
        new = writer.device_id(device.name) is None
        writer.device(device, update_software=False)
        (report.added if new else report.skipped)["devices"] += 1
    trial_rows: dict[str, TrialRow] = {}
    for chunk in _chunks(sorted(t.uid for t in bundle.trials)):
        found = session.execute(sa.select(TrialRow).where(TrialRow.uid.in_(chunk))).scalars()
        trial_rows.update((row.uid, row) for row in found)
    if trial_rows:
        report.skipped["trials"] += len(trial_rows)
    for trial in sorted(bundle.trials, key=lambda t: (t.created_at, t.uid)):
        if trial.uid not in trial_rows:
            trial_rows[trial.uid] = writer.trial(trial, import_id=import_id)
            report.added["trials"] += 1
    for uid in sorted(bundle.best):
        row = trial_rows[uid]
        before = session.execute(sa.select(BestRow.trial_id).filter_by(
            device_id=row.device_id, problem_id=row.problem_id, seqlen=row.seqlen,
            shape_class=row.shape_class)).scalar()
        if before is not None and before != row.id and keep_local and session.execute(
                sa.select(TrialRow.import_id).where(TrialRow.id == before)).scalar() is None:
            report.skipped["best"] += 1  # measured here: an import never displaces it
            report.kept_local += 1
        elif before == row.id or not writer.offer_best(row, replace=replace):
            report.skipped["best"] += 1
        else:
            (report.added if before is None else report.updated)["best"] += 1
