"""What the dispatcher reads on a process's first call (issue: what a hostile or careless
user still breaks, "memory and start-up"). Regression: it loaded every best entry of the
database, so after one valid bundle of 8,000 invented devices every first
`flashtune.attention` took 129 s and printed 32,000 warning lines (one per unusable row)."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
from dbfactories import CONFIGS, H100, H200, PROBLEMS, trial

from flashtune.codegen.spec import ProblemBucket
from flashtune.db import DeviceRecord, TuningStore, export_bundle, import_bundle
from flashtune.db.records import BestEntry
from flashtune.runtime import dispatch
from flashtune.runtime.dispatch import Dispatcher, NamedDevice, Tier

P = PROBLEMS[1]
INVENTED = 300
THIS = NamedDevice(H100.name, "sm_90", arch_specific_kernels=False)


def _invented(i: int) -> DeviceRecord:
    return DeviceRecord(f"Invented GPU {i:04d}", 9, 0, 132, 80 << 30, "1", "1", "1", "1")


@pytest.fixture
def crowded(tmp_path: Path) -> Path:
    """This machine's database: the H100's own results (one current at n4096, two measured
    on other kernel sources), an H200's (local, so trusted for the same arch), and an
    imported, untrusted bundle of INVENTED sm_90 devices with stale results in 2 buckets."""
    rng = random.Random(7)
    with TuningStore(tmp_path / "invented.db") as other:
        devices = [_invented(i) for i in range(INVENTED)]
        for device in devices:
            other.record_device(device)
        other.record_trials([trial(d, P, n, CONFIGS[3], template="v0", rng=rng)
                             for d in devices for n in (1024, 4096)])
        bundle = export_bundle(other)
    path = tmp_path / "local.db"
    with TuningStore(path) as store:
        store.record_device(H100)
        store.record_device(H200)
        store.record_trials([trial(H100, P, 4096, CONFIGS[1], rng=rng),
                             trial(H100, P, 1024, CONFIGS[2], template="v0", rng=rng),
                             trial(H100, P, 16384, CONFIGS[2], template="v0", rng=rng),
                             trial(H200, P, 256, CONFIGS[4], rng=rng)])
        import_bundle(store, bundle)
        assert len(store.all_best()) == 4 + 2 * INVENTED
    return path


@pytest.fixture
def loaded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The device of every best entry the dispatcher reads and checks (usable_config
    renders its kernel: the start-up cost per row)."""
    seen: list[str] = []
    real = dispatch.usable_config

    def counting(entry: BestEntry) -> object:
        seen.append(entry.device)
        return real(entry)

    monkeypatch.setattr(dispatch, "usable_config", counting)
    return seen


def test_first_call_reads_only_what_can_serve_this_device(
        crowded: Path, loaded: list[str], caplog: pytest.LogCaptureFixture) -> None:
    opened: list[int] = []

    def source() -> TuningStore:
        opened.append(1)
        return TuningStore(crowded, create=False)

    dispatcher = Dispatcher(source)
    assert opened == []  # lazily: nothing before the first call
    with caplog.at_level(logging.WARNING, logger="flashtune"):
        decision = dispatcher.decide(ProblemBucket(P, 4096), THIS)
        dispatcher.decide(ProblemBucket(P, 256), THIS)
    assert decision.tier is Tier.EXACT and decision.config == CONFIGS[1]
    assert sorted(loaded) == [H100.name] * 3 + [H200.name]  # nothing invented is read
    assert opened == [1]
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    # the H100's two stale rows share one reason: one line
    assert len(warned) == 1, warned
    assert "and 1 more with the same reason" in warned[0] and "re-tune" in warned[0]


def test_a_source_without_serving_best_is_filtered_before_any_check(
        crowded: Path, loaded: list[str]) -> None:
    """Applications may bring their own source (``all_best`` only): what cannot serve the
    device is dropped before any kernel is rendered."""
    with TuningStore(crowded, create=False) as store:
        everything = store.all_best()

    class Everything:
        def all_best(self) -> list[BestEntry]:
            return everything

    Dispatcher(lambda: Everything()).decide(ProblemBucket(P, 4096), THIS)
    assert sorted(loaded) == [H100.name] * 3 + [H200.name]


def test_many_distinct_reasons_are_warned_in_a_bounded_number_of_lines(
        caplog: pytest.LogCaptureFixture) -> None:
    from runtime_helpers import ListSource, best_entry

    entries = [best_entry(H100.name, "sm_90", P.key(), 1 << (6 + i % 9), f"m{900 + i}_n64_w4_s2")
               for i in range(200)]
    with caplog.at_level(logging.WARNING, logger="flashtune.dispatch"):
        decision = Dispatcher(lambda: ListSource(entries)).decide(ProblemBucket(P, 4096), THIS)
    assert decision.tier is Tier.DEFAULT
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == dispatch.MAX_SKIP_WARNINGS + 1
    assert f"skipping {200 - dispatch.MAX_SKIP_WARNINGS} more tuned results" in warned[-1]
