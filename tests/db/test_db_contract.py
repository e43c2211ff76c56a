"""The store's contract, run unchanged against SQLite and PostgreSQL."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from dbfactories import (
    A100,
    CONFIGS,
    DEVICES,
    FAILURES,
    H100,
    H200,
    L40,
    PROBLEMS,
    SEQLENS,
    digest,
    expected_best,
    random_trials,
    trial,
)

from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.db import BestIndex, DeviceRecord, TrialStatus, TuningStore, session_scope
from flashtune.db.models import TrialRow
from flashtune.errors import DatabaseError

P128, P64 = PROBLEMS


def _store(url: str) -> TuningStore:
    store = TuningStore(url)
    for device in DEVICES:
        store.record_device(device)
    return store


def test_best_is_the_fastest_ok_trial(db_url: str, rng: random.Random) -> None:
    trials = random_trials(rng, 120)
    with _store(db_url) as store:
        became = [store.record_trial(t) for t in trials[:60]]
        became_batch = store.record_trials(trials[60:])
        reference = expected_best(trials)
        got = {(e.device, e.problem, e.seqlen): e.trial.uid for e in store.all_best()}
        assert got == reference
        assert sum(became) + became_batch >= len(reference)
        for (device, problem, seqlen), uid in reference.items():
            entry = store.best(device, problem, seqlen)
            assert entry is not None and entry.trial.uid == uid
            assert entry.trial == next(t for t in trials if t.uid == uid)
        assert store.counts()["trials"] == len(trials)
        assert store.counts()["best"] == len(reference)


def test_failures_and_untimed_never_become_best(db_url: str, rng: random.Random) -> None:
    with _store(db_url) as store:
        slow = trial(H100, P128, 4096, CONFIGS[0], median_ms=5.0, rng=rng)
        assert store.record_trial(slow)
        for i, status in enumerate((*FAILURES, TrialStatus.VERIFIED_UNTIMED)):
            assert not store.record_trial(trial(H100, P128, 4096, CONFIGS[i + 1], status=status,
                                                rng=rng))
        entry = store.best(H100.name, P128.key(), 4096)
        assert entry is not None and entry.trial.uid == slow.uid
        faster = trial(H100, P128, 4096, CONFIGS[2], median_ms=4.0, rng=rng)
        equal = trial(H100, P128, 4096, CONFIGS[3], median_ms=4.0, rng=rng)
        assert store.record_trial(faster)
        assert not store.record_trial(equal)  # ties keep the first result
        entry = store.best(H100.name, P128.key(), 4096)
        assert entry is not None and entry.trial.uid == faster.uid
        assert entry.median_ms == 4.0


def test_trial_fields_round_trip_exactly(db_url: str, rng: random.Random) -> None:
    with _store(db_url) as store:
        originals = random_trials(rng, 30)
        originals.append(trial(A100, P64, 1024, CONFIGS[1], rng=rng, predicted_ms=0.123456789,
                               study=None))
        store.record_trials(originals)
        stored = store.trials()
        assert sorted(stored, key=lambda t: t.uid) == sorted(originals, key=lambda t: t.uid)
        only = store.trials(device=A100.name, problem=P64.key(), seqlen=1024,
                            status=TrialStatus.OK)
        assert originals[-1] in only
        assert all(t.device == A100.name and t.seqlen == 1024 and t.status is TrialStatus.OK
                   for t in only)


def test_lookup_exact_nearest_same_arch(db_url: str, rng: random.Random) -> None:
    placed = [(H100, 1024), (H100, 8192), (H200, 4096), (A100, 2048)]
    with _store(db_url) as store:
        for device, seqlen in placed:
            store.record_trial(trial(device, P128, seqlen, rng.choice(CONFIGS), rng=rng))
        key = P128.key()

        def found(device: DeviceRecord, arch: str, seqlen: int) -> tuple[str, str, int] | None:
            match = store.lookup(device=device.name, arch=arch, problem=key, seqlen=seqlen)
            return None if match is None else (match.how, match.entry.device, match.entry.seqlen)

        assert found(H100, "sm_90", 8192) == ("exact", H100.name, 8192)
        assert found(H100, "sm_90", 2048) == ("nearest", H100.name, 1024)   # 1 vs 2 octaves
        assert found(H100, "sm_90", 2896) == ("nearest", H100.name, 1024)   # 1.4998 vs 1.5002
        assert found(H100, "sm_90", 65536) == ("nearest", H100.name, 8192)
        # H200 owns 4096 only: its own bucket wins over an H100 exact match.
        assert found(H200, "sm_90", 1024) == ("nearest", H200.name, 4096)
        # A device with no results of its own borrows from its arch, nearest bucket.
        newcomer = DeviceRecord("NVIDIA H100 PCIe", 9, 0, 114, 80 << 30, "1", "1", "1", "1")
        assert found(newcomer, "sm_90", 4096) == ("same_arch", H200.name, 4096)
        assert found(newcomer, "sm_90", 2048) == ("same_arch", H200.name, 4096)  # tie -> larger
        assert found(newcomer, "sm_90", 512) == ("same_arch", H100.name, 1024)
        assert found(L40, "sm_89", 2048) is None                             # no sm_89 result
        assert found(newcomer, "sm_80", 64) == ("same_arch", A100.name, 2048)
        assert store.nearest_best(H100.name, key, 3000) is not None
        fam = store.family_best("sm_90", key, 4096, exclude_device=H200.name)
        assert fam is not None and fam.device == H100.name

        # The in-memory index that the dispatcher uses agrees with the store everywhere.
        index = BestIndex(store.all_best())
        assert len(index) == len(placed)
        for device in (*DEVICES, newcomer):
            for seqlen in (64, 1000, 2048, 4096, 10000, 1 << 20):
                for problem in (key, P64.key()):
                    a = store.lookup(device=device.name, arch=device.arch, problem=problem,
                                     seqlen=seqlen)
                    b = index.lookup(device=device.name, arch=device.arch, problem=problem,
                                     seqlen=seqlen)
                    assert a == b


def test_lookup_tie_prefers_the_larger_bucket(db_url: str, rng: random.Random) -> None:
    with _store(db_url) as store:
        for seqlen in (1024, 4096):
            store.record_trial(trial(H100, P128, seqlen, CONFIGS[0], rng=rng))
        match = store.lookup(device=H100.name, arch="sm_90", problem=P128.key(), seqlen=2048)
        assert match is not None and (match.how, match.entry.seqlen) == ("nearest", 4096)


def test_tried_and_failed_configs(db_url: str, rng: random.Random) -> None:
    with _store(db_url) as store:
        c_ok, c_bad, c_wrong, c_old = CONFIGS[:4]
        store.record_trials([
            trial(H100, P128, 4096, c_ok, rng=rng),
            trial(H100, P128, 4096, c_bad, status=TrialStatus.COMPILE_FAILED, rng=rng),
            trial(H100, P128, 4096, c_wrong, status=TrialStatus.WRONG_RESULT, rng=rng),
            trial(H100, P128, 4096, c_old, status=TrialStatus.RUNTIME_FAILED, rng=rng,
                  template="v0"),
            trial(H100, P128, 1024, CONFIGS[4], status=TrialStatus.INVALID, rng=rng),
            trial(H200, P128, 4096, CONFIGS[5], status=TrialStatus.INVALID, rng=rng),
        ])
        key = P128.key()
        tried = store.tried_configs(H100.name, key, 4096)
        assert tried == {c.key() for c in (c_ok, c_bad, c_wrong, c_old)}
        failed = store.failed_configs(H100.name, key, 4096)
        assert failed == {c_bad.key(), c_wrong.key(), c_old.key()}
        # Per kernel source: the v0 failure says nothing about the v1 source of c_old.
        assert store.failed_configs(H100.name, key, 4096,
                                    template_digest=digest(P128, c_old, "v1")) == set()
        assert store.failed_configs(H100.name, key, 4096,
                                    template_digest=digest(P128, c_old, "v0")) == {c_old.key()}
        assert store.tried_configs(H100.name, key, 4096,
                                   template_digest=digest(P128, c_ok)) == {c_ok.key()}
        outcomes = store.outcomes(H100.name, key, 4096)
        assert outcomes[c_wrong.key()] == {digest(P128, c_wrong): {TrialStatus.WRONG_RESULT}}
        assert store.tried_configs(A100.name, key, 4096) == set()


def test_devices_identity(db_url: str) -> None:
    with _store(db_url) as store:
        assert store.devices() == sorted(DEVICES, key=lambda d: d.name)
        newer = DeviceRecord(H100.name, 9, 0, 132, H100.memory_bytes, "590.1", "13.1",
                             "13.1.1", "14.0.0")
        store.record_device(newer)
        assert store.device(H100.name) == newer
        clash = DeviceRecord(H100.name, 9, 0, 114, H100.memory_bytes, "1", "1", "1", "1")
        with pytest.raises(DatabaseError, match="114 SMs"):
            store.record_device(clash)
        assert store.device(H100.name) == newer


def test_unknown_device_is_refused_without_partial_write(db_url: str,
                                                        rng: random.Random) -> None:
    with TuningStore(db_url) as store:
        store.record_device(H100)
        batch = [trial(H100, P128, 1024, CONFIGS[0], rng=rng),
                 trial(A100, P128, 1024, CONFIGS[0], rng=rng)]
        with pytest.raises(DatabaseError, match="record the device"):
            store.record_trials(batch)
        assert store.counts() == {"devices": 1, "problems": 0, "configs": 0, "trials": 0,
                                  "best": 0, "imports": 0, "verifications": 0}


def test_session_scope_rolls_back_and_translates_errors(db_url: str,
                                                        rng: random.Random) -> None:
    with _store(db_url) as store:
        first = trial(H100, P128, 1024, CONFIGS[0], rng=rng)
        store.record_trial(first)
        before = store.counts()
        duplicate = trial(H100, P128, 2048, CONFIGS[1], rng=rng, uid=first.uid)
        fresh = trial(H100, P128, 4096, CONFIGS[2], rng=rng)
        with pytest.raises(DatabaseError, match="violated a constraint"):
            store.record_trials([fresh, duplicate])
        assert store.counts() == before          # the whole batch was rolled back

        class Boom(Exception):
            pass

        with pytest.raises(Boom), session_scope(store.engine, write=True,
                                                action="test") as session:
            session.execute(sa.update(TrialRow).values(host="changed"))
            raise Boom
        assert {t.host for t in store.trials()} == {first.host}


def test_problem_and_config_keys_are_stable(db_url: str, rng: random.Random) -> None:
    problem = Problem(96, DType.FP16, causal=True)
    config = KernelConfig(64, 64, 2, 3)
    with _store(db_url) as store:
        store.record_trial(trial(L40, problem, 512, config, rng=rng))
        entry = store.best(L40.name, "fwd_d96_fp16_causal", 512)
        assert entry is not None
        assert KernelConfig.from_dict(entry.config.as_dict()) == config
        assert Problem.from_dict(entry.trial.problem.as_dict()) == problem


def test_problems_with_element_types_per_operand_are_stored(db_url: str,
                                                            rng: random.Random) -> None:
    """A problem whose operands differ is stored under its own key and fields beside the
    uniform one, whose key and fields are the ones stored before per-operand types."""
    uniform = Problem(128, DType.BF16, causal=True)
    mixed = Problem(128, DType.BF16, causal=True, kv_dtype=DType.FP16)
    config = CONFIGS[1]
    with _store(db_url) as store:
        for problem in (uniform, mixed):  # no family renders the mixed one: a stand-in digest
            store.record_trial(trial(H100, problem, 2048, config, rng=rng, template="v0"))
        entry = store.best(H100.name, "fwd_d128_bf16-fp16-bf16_causal", 2048)
        assert entry is not None
        assert entry.trial.problem.as_dict() == {"op": "fwd", "head_dim": 128, "dtype": "bf16",
                                                 "causal": True, "kv_dtype": "fp16"}
        assert Problem.from_dict(entry.trial.problem.as_dict()) == mixed
        plain = store.best(H100.name, "fwd_d128_bf16_causal", 2048)
        assert plain is not None
        assert plain.trial.problem.as_dict() == {"op": "fwd", "head_dim": 128, "dtype": "bf16",
                                                 "causal": True}


def test_many_buckets_read_at_once(db_url: str, rng: random.Random) -> None:
    trials = [trial(d, p, s, rng.choice(CONFIGS), rng=rng)
              for d in DEVICES for p in PROBLEMS for s in SEQLENS]
    with _store(db_url) as store:
        store.record_trials(trials)
        entries = store.all_best()
        assert len(entries) == len(DEVICES) * len(PROBLEMS) * len(SEQLENS)
        assert {e.arch for e in entries} == {"sm_90", "sm_80", "sm_89"}
        assert store.best_entries(arch="sm_90", problem=P64.key()) == [
            e for e in entries if e.arch == "sm_90" and e.problem == P64.key()]


def test_two_stores_on_one_database_see_each_other(new_db: Callable[[], str],
                                                   rng: random.Random) -> None:
    url = new_db()
    with _store(url) as a, TuningStore(url) as b:
        t = trial(H100, P128, 1024, CONFIGS[0], rng=rng)
        a.record_trial(t)
        entry = b.best(H100.name, P128.key(), 1024)
        assert entry is not None and entry.trial == t


def test_set_best_replaces_the_best_outright(db_url: str, rng: random.Random) -> None:
    with _store(db_url) as store:
        fast = trial(H100, P128, 4096, CONFIGS[0], median_ms=rng.uniform(0.5, 1.0), rng=rng)
        chosen = trial(H100, P128, 4096, CONFIGS[1], median_ms=rng.uniform(1.5, 3.0), rng=rng)
        assert store.record_trial(fast)
        assert not store.record_trial(chosen)       # slower: the faster one stays best
        entry = store.set_best(chosen.uid)
        assert entry.trial == chosen and entry.arch == "sm_90"
        assert entry.median_ms == chosen.median_ms
        assert store.best(H100.name, P128.key(), 4096) == entry
        assert store.counts()["best"] == 1
        # Later trials compare against the new best as usual.
        assert chosen.median_ms is not None
        between = trial(H100, P128, 4096, CONFIGS[2], median_ms=chosen.median_ms * 0.9,
                        rng=rng)
        assert store.record_trial(between)
        current = store.best(H100.name, P128.key(), 4096)
        assert current is not None and current.trial.uid == between.uid


def test_set_best_in_an_empty_bucket(db_url: str, rng: random.Random) -> None:
    with _store(db_url) as store:
        store.record_trial(trial(A100, P64, 1024, CONFIGS[3], rng=rng))
        # Reaching into another bucket's trial leaves this one's best alone.
        other = trial(A100, P64, 2048, CONFIGS[4], rng=rng)
        store.record_trial(other)
        before = store.best(A100.name, P64.key(), 1024)
        entry = store.set_best(other.uid)
        assert (entry.device, entry.problem, entry.seqlen) == (A100.name, P64.key(), 2048)
        assert store.best(A100.name, P64.key(), 1024) == before
        assert store.counts()["best"] == 2


def test_set_best_refuses_failed_untimed_and_unknown_trials(db_url: str,
                                                           rng: random.Random) -> None:
    with _store(db_url) as store:
        best = trial(H100, P128, 1024, CONFIGS[0], rng=rng)
        store.record_trial(best)
        for i, status in enumerate((*FAILURES, TrialStatus.VERIFIED_UNTIMED)):
            bad = trial(H100, P128, 1024, CONFIGS[i + 1], status=status, rng=rng)
            store.record_trial(bad)
            with pytest.raises(DatabaseError, match=f"status '{status.value}'.*only an 'ok'"):
                store.set_best(bad.uid)
        with pytest.raises(DatabaseError, match="no trial with uid 'missing'"):
            store.set_best("missing")
        entry = store.best(H100.name, P128.key(), 1024)
        assert entry is not None and entry.trial == best
        assert store.counts()["best"] == 1


def test_a_read_only_store_never_writes(new_db: Callable[[], str], rng: random.Random) -> None:
    """Read commands and the runtime open stores read-only: the database refuses writes,
    on every backend."""
    url = new_db()
    with _store(url) as store:
        store.record_trials(random_trials(rng, 4))
    with TuningStore(url, create=False) as store:
        assert store.read_only and len(store.trials()) == 4
        with pytest.raises(DatabaseError):
            store.record_device(DEVICES[0])
        with store.engine.connect() as connection, pytest.raises(sa.exc.DBAPIError):
            connection.exec_driver_sql("CREATE TABLE intruder (x INTEGER)")
    with TuningStore(url) as store:
        assert len(store.trials()) == 4
