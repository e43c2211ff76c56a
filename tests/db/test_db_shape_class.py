"""Shape classes in the database (``ProblemBucket.shape_class``): their own best per
bucket, the lookup's fallback to the bucket without a class, bundles, and the migration of
a database made before they existed (revision 0002), on both backends."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from alembic import command
from alembic.config import Config
from dbfactories import H100, H200, trial

from flashtune.codegen.spec import DType, KernelConfig, Problem, ProblemBucket
from flashtune.db import TuningStore, resolve_url
from flashtune.db.bundle import parse_bundle, read_bundle, write_bundle
from flashtune.db.engine import make_engine
from flashtune.db.lookup import resolve
from flashtune.db.schema import MIGRATIONS_DIR
from flashtune.db.sharing import export_bundle
from flashtune.errors import BundleError, InvalidProblem, SchemaVersionError

DECODE = Problem(128, DType.BF16, op="decode")
FAST, SLOW = KernelConfig.from_key("m64_n64_w4_s2"), KernelConfig.from_key("m64_n32_w4_s1")
CLASS = "g8q4p16"


def _store_with(url: str, *trials: object) -> TuningStore:
    store = TuningStore(url)
    for device in (H100, H200):
        store.record_device(device)
    for t in trials:
        store.record_trial(t)  # type: ignore[arg-type]
    return store


def test_a_class_keeps_its_own_best_beside_the_bucket_without_one(db_url: str) -> None:
    generic = trial(H100, DECODE, 4096, FAST, median_ms=1.0)
    classed = trial(H100, DECODE, 4096, SLOW, median_ms=3.0, shape_class=CLASS)
    with _store_with(db_url, generic, classed) as store:
        # slower, yet the best of its own class: classes never compete
        assert store.best(H100.name, DECODE.key(), 4096).trial == generic  # type: ignore[union-attr]
        assert store.best(H100.name, DECODE.key(), 4096, CLASS).trial == classed  # type: ignore[union-attr]
        assert {e.shape_class for e in store.best_entries()} == {"", CLASS}
        assert store.tried_configs(H100.name, DECODE.key(), 4096, shape_class=CLASS) == {
            SLOW.key()}
        assert classed.problem_bucket() == ProblemBucket(DECODE, 4096, CLASS)
        assert classed.bucket == f"{DECODE.key()}_n4096_{CLASS}"


def test_the_lookup_prefers_the_class_then_the_device_then_no_class(db_url: str) -> None:
    own_generic = trial(H100, DECODE, 4096, FAST, median_ms=1.0)
    own_classed_far = trial(H100, DECODE, 256, SLOW, median_ms=1.0, shape_class=CLASS)
    peer_classed = trial(H200, DECODE, 4096, SLOW, median_ms=1.0, shape_class=CLASS)
    with _store_with(db_url, own_generic, own_classed_far, peer_classed) as store:
        entries = store.best_entries()
    ask = {"device": H100.name, "arch": "sm_90", "problem": DECODE.key(),
           "trusted_sources": frozenset({"all"})}
    # the device's own entry of the class, even at another length
    found = resolve(entries, seqlen=4096, shape_class=CLASS, **ask)  # type: ignore[arg-type]
    assert found is not None and (found.entry.trial, found.how) == (own_classed_far, "nearest")
    # another class falls back to the device's entry without a class
    found = resolve(entries, seqlen=4096, shape_class="g1q1p0", **ask)  # type: ignore[arg-type]
    assert found is not None and (found.entry.trial, found.how) == (own_generic, "nearest")
    found = resolve(entries, seqlen=256, shape_class=CLASS, **ask)  # type: ignore[arg-type]
    assert found is not None and (found.entry.trial, found.how) == (own_classed_far, "exact")
    # no entry of this device: the same arch's entry of the class
    others = [e for e in entries if e.device != H100.name]
    found = resolve(others, seqlen=4096, shape_class=CLASS, **ask)  # type: ignore[arg-type]
    assert found is not None and (found.entry.trial, found.how) == (peer_classed, "same_arch")
    # a bucket without a class never takes a classed entry
    assert resolve(others, seqlen=4096, **ask) is None  # type: ignore[arg-type]


def test_bundles_carry_the_class_and_leave_it_out_when_there_is_none(
        db_url: str, tmp_path: Path) -> None:
    generic = trial(H100, DECODE, 4096, FAST, median_ms=1.0)
    classed = trial(H100, DECODE, 4096, SLOW, median_ms=3.0, shape_class=CLASS)
    with _store_with(db_url, generic, classed) as store:
        write_bundle(export_bundle(store), tmp_path / "b.json")
    bundle = read_bundle(tmp_path / "b.json")
    assert {t.shape_class for t in bundle.trials} == {"", CLASS}
    assert len(bundle.best) == 2
    data = json.loads((tmp_path / "b.json").read_text())
    assert sorted("shape_class" in t for t in data["trials"]) == [False, True]
    data["trials"][0]["shape_class"] = "G8"
    with pytest.raises(BundleError, match="shape_class"):
        parse_bundle(json.dumps(data).encode())


def test_a_malformed_class_is_refused() -> None:
    with pytest.raises(ValueError, match="shape_class='g8 q4'"):
        trial(H100, DECODE, 4096, FAST, shape_class="g8 q4")
    with pytest.raises(InvalidProblem, match="malformed"):
        ProblemBucket(DECODE, 4096, "8x")


def _downgrade(url: str, revision: str) -> None:
    """Take the database at ``url`` back to ``revision`` with the shipped migrations."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    engine = make_engine(resolve_url(url), create=False)
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, revision)
    engine.dispose()


def test_a_database_of_revision_0002_upgrades_keeping_its_rows(db_url: str) -> None:
    rng = random.Random(7)
    kept = [trial(H100, DECODE, n, c, rng=rng) for n in (256, 4096) for c in (FAST, SLOW)]
    with _store_with(db_url, *kept) as store:
        best_before = {(e.seqlen, e.trial.uid) for e in store.best_entries()}
        store.record_trial(trial(H100, DECODE, 4096, SLOW, shape_class=CLASS, rng=rng))
    _downgrade(db_url, "0002")  # drops the classed rows, which 0002 has no place for
    with pytest.raises(SchemaVersionError, match="flashtune db upgrade"):
        TuningStore(db_url)
    with TuningStore(db_url, upgrade=True) as store:
        assert store.schema.current == "0003"
        assert sorted(t.uid for t in store.trials()) == sorted(t.uid for t in kept)
        assert {(e.seqlen, e.trial.uid) for e in store.best_entries()} == best_before
        assert {t.shape_class for t in store.trials()} == {""}
        classed = trial(H100, DECODE, 4096, SLOW, median_ms=9.0, shape_class=CLASS)
        store.record_trial(classed)
        found = store.best(H100.name, DECODE.key(), 4096, CLASS)
        assert found is not None and found.trial == classed
