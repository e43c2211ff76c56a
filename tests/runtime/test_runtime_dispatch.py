"""The dispatcher's tiers (exact, nearest, same_arch, default), its memo, its lazy one-time read
of the database and its behaviour when the database cannot be read."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
from runtime_helpers import ListSource, best_entry

from flashtune.codegen.spec import DType, KernelConfig, Problem, ProblemBucket
from flashtune.db.records import BestEntry, DeviceRecord, Keyed, TrialRecord, TrialStatus
from flashtune.db.store import TuningStore
from flashtune.families import render
from flashtune.runtime.device import DeviceInfo
from flashtune.runtime.dispatch import Dispatcher, Tier, default_config

PROBLEM = Problem(head_dim=64, dtype=DType.FP16)
PKEY = PROBLEM.key()  # fwd_d64_fp16_full
A, B, C = "GPU-A", "GPU-B", "GPU-C"


@dataclass(frozen=True)
class Dev:
    name: str
    arch: str
    # The tiers of the mma.sync forward's own results; the sm_90a family that serves "fwd"
    # on cc 9.0 GPUs is tested in tests/codegen/test_arch_specific.py.
    arch_specific_kernels: bool = False


DEV_A = Dev(A, "sm_90")


def _decide(entries: list[BestEntry], seqlen: int, device: Dev = DEV_A,
            problem: Problem = PROBLEM) -> tuple[Tier, str, int | None]:
    source = ListSource(entries)
    d = Dispatcher(lambda: source).decide(ProblemBucket(problem, seqlen), device)
    return d.tier, d.config.key(), d.entry.seqlen if d.entry else None


def test_exact_bucket_on_this_device() -> None:
    entries = [best_entry(A, "sm_90", PKEY, 1024, "m128_n64_w4_s2"),
               best_entry(A, "sm_90", PKEY, 2048, "m64_n64_w4_s2"),
               best_entry(B, "sm_90", PKEY, 1024, "m128_n128_w8_s1")]
    assert _decide(entries, 1024) == (Tier.EXACT, "m128_n64_w4_s2", 1024)


def test_nearest_bucket_on_this_device() -> None:
    entries = [best_entry(A, "sm_90", PKEY, 256, "m64_n32_w4_s1"),
               best_entry(A, "sm_90", PKEY, 4096, "m128_n64_w4_s3"),
               best_entry(B, "sm_90", PKEY, 1024, "m128_n128_w8_s1")]
    assert _decide(entries, 512) == (Tier.NEAREST, "m64_n32_w4_s1", 256)
    # 1024 is two octaves from both: the larger bucket wins the tie
    assert _decide(entries, 1024) == (Tier.NEAREST, "m128_n64_w4_s3", 4096)
    assert _decide(entries, 1 << 20) == (Tier.NEAREST, "m128_n64_w4_s3", 4096)


def test_same_arch_from_another_gpu() -> None:
    entries = [best_entry(B, "sm_90", PKEY, 2048, "m128_n128_w8_s1"),
               best_entry(C, "sm_80", PKEY, 1024, "m64_n64_w4_s1"),
               best_entry(A, "sm_90", "fwd_d128_fp16_full", 1024, "m64_n64_w4_s1")]
    assert _decide(entries, 1024) == (Tier.SAME_ARCH, "m128_n128_w8_s1", 2048)
    # an sm_80 device sees only the sm_80 result
    assert _decide(entries, 1024, Dev("GPU-D", "sm_80")) == (Tier.SAME_ARCH, "m64_n64_w4_s1",
                                                             1024)


def test_cc90_serves_the_sm90a_family_unless_only_the_mma_sync_one_is_tuned_here() -> None:
    """On a cc 9.0 GPU the sm_90a family serves "fwd" with its own tuned results; when it has
    none, this device's own tuned mma.sync config (measured and verified here) is served
    rather than the sm_90a family's untuned default, but another GPU's is not."""
    h100 = Dev(A, "sm_90", arch_specific_kernels=True)
    hopper = "fwd90aws_d64_fp16_full"
    mine = [best_entry(A, "sm_90", PKEY, 1024, "m128_n64_w4_s2")]
    assert _decide(mine, 1024, h100) == (Tier.EXACT, "m128_n64_w4_s2", 1024)
    assert _decide(mine, 4096, h100) == (Tier.NEAREST, "m128_n64_w4_s2", 1024)
    source = ListSource(mine)
    decision = Dispatcher(lambda: source).decide(ProblemBucket(PROBLEM, 1024), h100)
    assert decision.problem == PROBLEM  # the mma.sync forward, as tuned
    served = [*mine, best_entry(B, "sm_90", hopper, 1024, "m128_n64_w8_s2")]
    assert _decide(served, 1024, h100) == (Tier.SAME_ARCH, "m128_n64_w8_s2", 1024)
    theirs = [best_entry(B, "sm_90", PKEY, 1024, "m128_n64_w4_s2")]
    tier, config, _ = _decide(theirs, 1024, h100)
    assert tier is Tier.DEFAULT and config == default_config(
        Problem(64, DType.FP16, op="fwd90aws"), "sm_90").key()


def test_default_table_when_nothing_applies() -> None:
    entries = [best_entry(C, "sm_80", PKEY, 1024, "m64_n64_w4_s1"),
               best_entry(A, "sm_90", "fwd_d64_fp16_causal", 1024, "m64_n64_w4_s1")]
    tier, config, entry = _decide(entries, 1024)
    assert (tier, entry) == (Tier.DEFAULT, None)
    assert config == default_config(PROBLEM, "sm_90").key()


def test_unusable_entries_are_skipped(caplog: pytest.LogCaptureFixture) -> None:
    big = Problem(head_dim=256, dtype=DType.BF16)
    # 3 stages of 128-row K and V tiles at head dim 256 need ~400 KB of shared memory
    entries = [best_entry(A, "sm_90", big.key(), 1024, "m128_n128_w8_s3"),
               best_entry(A, "sm_90", big.key(), 2048, "m999_n64_w4_s2"),
               best_entry(A, "sm_90", big.key(), 4096, "bogus")]
    with caplog.at_level(logging.WARNING, logger="flashtune.dispatch"):
        tier, config, _ = _decide(entries, 1024, problem=big)
    assert tier is Tier.DEFAULT
    assert config == default_config(big, "sm_90").key()
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 3
    assert any("shared memory" in s for s in skipped)
    assert any("block_m=999" in s for s in skipped)


def test_database_read_once_lazily_and_decisions_memoised() -> None:
    source = ListSource([best_entry(A, "sm_90", PKEY, 1024, "m128_n64_w4_s2")])
    d = Dispatcher(lambda: source)
    assert source.reads == 0  # nothing is read before the first decision
    first = d.decide(ProblemBucket(PROBLEM, 1024), DEV_A)
    again = d.decide(ProblemBucket(PROBLEM, 1024), DEV_A)
    other = d.decide(ProblemBucket(PROBLEM, 64), DEV_A)
    assert again is first
    assert other.tier is Tier.NEAREST
    assert source.reads == 1


def test_unreadable_database_warns_once_and_uses_defaults(
        caplog: pytest.LogCaptureFixture) -> None:
    opened = []

    def broken() -> ListSource:
        opened.append(1)
        raise RuntimeError("disk on fire")

    d = Dispatcher(broken)
    with caplog.at_level(logging.WARNING, logger="flashtune.dispatch"):
        for seqlen in (64, 128, 4096):
            decision = d.decide(ProblemBucket(PROBLEM, seqlen), DEV_A)
            assert decision.tier is Tier.DEFAULT
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "disk on fire" in warnings[0].getMessage()
    assert len(opened) == 1


def test_describe_names_tier_config_and_source() -> None:
    source = ListSource([best_entry(B, "sm_90", PKEY, 2048, "m128_n128_w8_s1", 0.25)])
    text = str(Dispatcher(lambda: source).decide(ProblemBucket(PROBLEM, 1024), DEV_A))
    for fragment in ("fwd_d64_fp16_full_n1024", "GPU-A (sm_90)", "same_arch",
                     "m128_n128_w8_s1", "GPU-B (sm_90), bucket n2048", "0.25 ms"):
        assert fragment in text, (fragment, text)


# ------------------------------------------------------------------ the real database


def _record(store: TuningStore, device: str, cc: tuple[int, int], seqlen: int,
            config: KernelConfig, ms: float) -> None:
    store.record_device(DeviceRecord(device, cc[0], cc[1], 132, 80 << 30, "13.0", "13.0",
                                     "13.0", "14.0"))
    store.record_trial(TrialRecord(
        device=device, problem=Keyed.of(PROBLEM), seqlen=seqlen, config=Keyed.of(config),
        status=TrialStatus.OK, template_digest=render(PROBLEM, config).digest, median_ms=ms,
        min_ms=ms, max_ms=ms, count=3))


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_reads_the_tuning_database_without_writing(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "tuning.db"
    config = KernelConfig(block_m=128, block_n=32, num_warps=8, num_stages=3)
    with TuningStore(f"sqlite:///{db}") as store:
        _record(store, "NVIDIA H200", (9, 0), 4096, config, 0.5)
    monkeypatch.setenv("FLASHTUNE_DB", f"sqlite:///{db}")
    before = _digest(db)
    device = DeviceInfo.virtual("sm_90")
    decision = Dispatcher().decide(ProblemBucket(PROBLEM, 4096), device)
    assert (decision.tier, decision.config) == (Tier.SAME_ARCH, config)
    named = Dev("NVIDIA H200", "sm_90")
    assert Dispatcher().decide(ProblemBucket(PROBLEM, 4096), named).tier is Tier.EXACT
    assert _digest(db) == before


def test_missing_database_is_not_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "nowhere" / "tuning.db"
    monkeypatch.setenv("FLASHTUNE_DB", f"sqlite:///{db}")
    with caplog.at_level(logging.WARNING, logger="flashtune.dispatch"):
        decision = Dispatcher().decide(ProblemBucket(PROBLEM, 128), DEV_A)
    assert decision.tier is Tier.DEFAULT
    assert not db.exists() and not db.parent.exists()
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_foreign_schema_falls_back_to_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    import sqlite3

    db = tmp_path / "other.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE something_else (x INTEGER)")
    monkeypatch.setenv("FLASHTUNE_DB", str(db))
    with caplog.at_level(logging.WARNING, logger="flashtune.dispatch"):
        decision = Dispatcher().decide(ProblemBucket(PROBLEM, 128), DEV_A)
    assert decision.tier is Tier.DEFAULT
    assert len(caplog.records) == 1 and "could not be read" in caplog.records[0].getMessage()


def test_missing_default_database_is_only_noted(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """No FLASHTUNE_DB and nothing tuned yet: the normal state, so no warning."""
    monkeypatch.delenv("FLASHTUNE_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="flashtune.dispatch"):
        decision = Dispatcher().decide(ProblemBucket(PROBLEM, 128), DEV_A)
    assert decision.tier is Tier.DEFAULT
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "nothing tuned" in caplog.records[0].getMessage()
    assert not any(tmp_path.iterdir())


def test_each_decision_is_logged_with_its_tier(caplog: pytest.LogCaptureFixture) -> None:
    source = ListSource([best_entry(A, "sm_90", PKEY, 1024, "m128_n64_w4_s2")])
    d = Dispatcher(lambda: source)
    with caplog.at_level(logging.DEBUG, logger="flashtune.dispatch"):
        d.decide(ProblemBucket(PROBLEM, 1024), DEV_A)
        d.decide(ProblemBucket(PROBLEM, 1024), DEV_A)  # memoised: not logged again
        d.decide(ProblemBucket(PROBLEM, 256), DEV_A)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert lines == [
        "dispatch fwd_d64_fp16_full_n1024 on GPU-A (sm_90): exact -> m128_n64_w4_s2",
        "dispatch fwd_d64_fp16_full_n256 on GPU-A (sm_90): nearest -> m128_n64_w4_s2",
    ]


def test_log_level_knob_shows_decisions() -> None:
    import os
    import subprocess
    import sys

    code = ("import flashtune; from flashtune.codegen.spec import *; "
            "from flashtune.runtime.dispatch import Dispatcher; "
            "from flashtune.runtime.device import DeviceInfo; "
            "Dispatcher().decide(ProblemBucket(Problem(64, DType.FP16), 128), "
            "DeviceInfo.virtual('sm_80'))")
    env = {**os.environ, "FLASHTUNE_LOG_LEVEL": "debug"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    assert "flashtune.dispatch DEBUG: dispatch fwd_d64_fp16_full_n128 on virtual-sm_80 " \
           "(sm_80): default ->" in done.stderr


def test_tuned_config_too_big_for_this_device_falls_back(
        caplog: pytest.LogCaptureFixture) -> None:
    """A result stored under this device's name but with a larger arch's limits."""
    big = Problem(head_dim=256, dtype=DType.FP16)
    entries = [best_entry("GPU-X", "sm_90", big.key(), 1024, "m128_n64_w8_s2")]
    with caplog.at_level(logging.WARNING, logger="flashtune.dispatch"):
        tier, config, _ = _decide(entries, 1024, Dev("GPU-X", "sm_86"), problem=big)
    assert tier is Tier.DEFAULT and config == default_config(big, "sm_86").key()
    assert "cannot run on GPU-X (sm_86)" in caplog.text
