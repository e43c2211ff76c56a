"""Export, import and merge, on both backends (and across them)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from dbfactories import (
    A100,
    CONFIGS,
    DEVICES,
    H100,
    H200,
    PROBLEMS,
    SEQLENS,
    expected_best,
    random_trials,
    trial,
)

from flashtune.db import (
    DeviceRecord,
    TrialRecord,
    TuningStore,
    dumps,
    export_bundle,
    import_bundle,
    merge_databases,
    read_bundle,
    write_bundle,
)
from flashtune.db.bundle import content_digest, to_dict
from flashtune.db.models import ProblemRow, TrialRow
from flashtune.errors import BundleError, DatabaseError

P128, P64 = PROBLEMS
FIXED = datetime(2026, 6, 1, tzinfo=timezone.utc)


def _filled(url: str, trials: list[TrialRecord],
            devices: tuple[DeviceRecord, ...] = DEVICES) -> TuningStore:
    store = TuningStore(url)
    for device in devices:
        store.record_device(device)
    store.record_trials(trials)
    return store


def _snapshot(store: TuningStore) -> str:
    return dumps(export_bundle(store, created_at=FIXED))


def _without_time(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k != "created_at"}


def test_round_trip_export_import_export(new_db: Callable[[], str], tmp_path: Path,
                                         rng: random.Random) -> None:
    trials = random_trials(rng, 80)
    with _filled(new_db(), trials) as source, TuningStore(new_db()) as target:
        path = tmp_path / "out" / "bundle.json"
        write_bundle(export_bundle(source), path)
        first = json.loads(path.read_text())
        assert first["format"] == "flashtune-tuning-bundle" and first["schema_version"] == 1
        assert len(first["trials"]) == len(trials)
        assert sorted(first["best"]) == sorted(expected_best(trials).values())

        report = import_bundle(target, read_bundle(path))
        assert report.added == {"devices": len(DEVICES), "trials": len(trials),
                                "best": len(first["best"])}
        assert not report.updated and not report.skipped
        second = to_dict(export_bundle(target))
        assert _without_time(second) == _without_time(first)
        assert second["content_sha256"] == first["content_sha256"]

        again = import_bundle(target, read_bundle(path))
        assert not again.added and not again.updated
        assert again.skipped == {"devices": len(DEVICES), "trials": len(trials),
                                 "best": len(first["best"])}
        assert _snapshot(target) == _snapshot(source)


def test_export_filters(db_url: str, rng: random.Random) -> None:
    trials = random_trials(rng, 60)
    with _filled(db_url, trials) as store:
        only = export_bundle(store, devices=[H100.name], problems=[P64.key()])
        assert [d.name for d in only.devices] == [H100.name]
        assert sorted(t.uid for t in only.trials) == sorted(
            t.uid for t in trials if t.device == H100.name and t.problem.key == P64.key())
        best = export_bundle(store, best_only=True)
        assert {t.uid for t in best.trials} == set(best.best) == set(
            expected_best(trials).values())
        with pytest.raises(Exception, match="no device named"):
            export_bundle(store, devices=["NVIDIA B200"])


def _policy_stores(new_db: Callable[[], str], rng: random.Random
                   ) -> tuple[TuningStore, TuningStore, list[TrialRecord], list[TrialRecord]]:
    ours, theirs = [], []
    for i, seqlen in enumerate(SEQLENS):
        # 256: only ours; 1024: only theirs; 4096: theirs faster; 16384: ours faster.
        ours_ms, theirs_ms = {256: (1.0, None), 1024: (None, 1.0), 4096: (2.0, 1.5),
                              16384: (1.0, 3.0)}[seqlen]
        if ours_ms is not None:
            ours.append(trial(H100, P128, seqlen, CONFIGS[i], median_ms=ours_ms, rng=rng))
        if theirs_ms is not None:
            theirs.append(trial(H100, P128, seqlen, CONFIGS[i + 1], median_ms=theirs_ms,
                                rng=rng, host="other-node"))
    return _filled(new_db(), ours), _filled(new_db(), theirs), ours, theirs


@pytest.mark.parametrize("prefer", ["faster", "ours", "theirs"])
def test_merge_policies(new_db: Callable[[], str], rng: random.Random, prefer: str) -> None:
    ours_store, theirs_store, ours, theirs = _policy_stores(new_db, rng)
    with ours_store, theirs_store:
        report = merge_databases(ours_store, theirs_store,
                                 prefer=prefer)  # type: ignore[arg-type]
        by_bucket: dict[int, dict[str, TrialRecord]] = {}
        for side, trials in (("ours", ours), ("theirs", theirs)):
            for t in trials:
                by_bucket.setdefault(t.seqlen, {})[side] = t
        expected = {}
        for seqlen, sides in by_bucket.items():
            if len(sides) == 1:
                expected[seqlen] = next(iter(sides.values())).uid
            elif prefer == "faster":
                expected[seqlen] = min(sides.values(), key=lambda t: t.median_ms or 0).uid
            else:
                expected[seqlen] = sides[prefer].uid
        got = {e.seqlen: e.trial.uid for e in ours_store.all_best()}
        assert got == expected
        assert report.added["trials"] == len(theirs)
        winner = next(e for e in ours_store.all_best() if e.seqlen == 1024)
        assert winner.trial.host == "other-node"          # provenance travels with it
        replaced = sum(1 for s, uid in expected.items() if s in (4096, 16384)
                       and uid in {t.uid for t in theirs})
        assert report.updated["best"] == replaced
        assert len(ours_store.trials()) == len(ours) + len(theirs)
        assert _snapshot(theirs_store) != _snapshot(ours_store)


def test_merge_across_backends(new_db: Callable[[], str], tmp_path: Path, backend: str,
                               rng: random.Random) -> None:
    """A local SQLite file merged into the backend under test (SQLite or PostgreSQL)."""
    trials = random_trials(rng, 40)
    with _filled(str(tmp_path / "local.db"), trials) as local, \
            TuningStore(new_db()) as shared:
        report = merge_databases(shared, local)
        assert report.added["trials"] == len(trials)
        assert _snapshot(shared) == _snapshot(local)


def test_mixed_template_digests_are_refused_unless_allowed(new_db: Callable[[], str],
                                                           rng: random.Random) -> None:
    old = [trial(H100, P128, 1024, CONFIGS[0], median_ms=1.0, rng=rng, template="v1")]
    new = [trial(H200, P128, 1024, CONFIGS[0], median_ms=0.5, rng=rng, template="v2"),
           trial(H200, P128, 1024, CONFIGS[1], median_ms=0.7, rng=rng, template="v2")]
    with _filled(new_db(), old) as ours, _filled(new_db(), new) as theirs:
        before = _snapshot(ours)
        with pytest.raises(BundleError, match="different kernel sources") as info:
            merge_databases(ours, theirs)
        message = str(info.value)
        assert f"{P128.key()} {CONFIGS[0].key()}" in message
        assert old[0].template_digest[:12] in message and new[0].template_digest[:12] in message
        assert CONFIGS[1].key() not in message            # never measured here: no conflict
        assert _snapshot(ours) == before
        report = merge_databases(ours, theirs, allow_mixed_digests=True)
        assert [(c.problem, c.config) for c in report.digest_conflicts] == [
            (P128.key(), CONFIGS[0].key())]
        assert report.added["trials"] == 2


def test_dry_run_writes_nothing(new_db: Callable[[], str], rng: random.Random) -> None:
    with _filled(new_db(), random_trials(rng, 20)) as source, \
            _filled(new_db(), random_trials(rng, 5)) as target:
        before = _snapshot(target)
        report = import_bundle(target, export_bundle(source), dry_run=True)
        assert report.dry_run and report.added["trials"] == 20
        assert _snapshot(target) == before


def test_conflicting_device_hardware_is_refused(new_db: Callable[[], str],
                                                rng: random.Random) -> None:
    fake = DeviceRecord(H100.name, 9, 0, 114, H100.memory_bytes, "1", "1", "1", "1")
    with _filled(new_db(), [trial(H100, P128, 1024, CONFIGS[0], rng=rng)]) as ours, \
            _filled(new_db(), [trial(fake, P128, 4096, CONFIGS[1], rng=rng)],
                    devices=(fake,)) as theirs:
        before = _snapshot(ours)
        with pytest.raises(BundleError, match="114 SMs"):
            merge_databases(ours, theirs)
        assert _snapshot(ours) == before


def test_altered_trial_with_a_known_uid_is_refused(db_url: str, tmp_path: Path,
                                                   rng: random.Random) -> None:
    original = trial(A100, P64, 256, CONFIGS[2], median_ms=2.0, rng=rng)
    with _filled(db_url, [original]) as store:
        data = to_dict(export_bundle(store))
        data["trials"][0]["host"] = "someone-else"
        data["content_sha256"] = content_digest(data)  # a consistent, re-hashed bundle
        path = tmp_path / "altered.json"
        path.write_text(json.dumps(data))
        before = _snapshot(store)
        with pytest.raises(BundleError, match="different content"):
            import_bundle(store, read_bundle(path))
        assert _snapshot(store) == before


def test_merge_from_a_tampered_database_is_refused(new_db: Callable[[], str],
                                                   rng: random.Random) -> None:
    with _filled(new_db(), random_trials(rng, 5)) as ours, \
            _filled(new_db(), random_trials(rng, 5)) as theirs:
        before = _snapshot(ours)
        with theirs.engine.begin() as conn:
            conn.execute(sa.update(TrialRow).values(host="x'; DROP TABLE ft_best; --"))
        with pytest.raises(DatabaseError, match="invalid value"):
            merge_databases(ours, theirs)
        with theirs.engine.begin() as conn:
            conn.execute(sa.update(TrialRow).values(host="fine"))
            conn.execute(sa.update(ProblemRow).values(fields={"op": "fwd", "head_dim": 100,
                                                              "dtype": "bf16", "causal": True}))
        with pytest.raises(BundleError, match="head_dim=100"):
            merge_databases(ours, theirs)
        assert _snapshot(ours) == before
