"""``flashtune db ...`` end to end through the real command line app (SQLite files)."""

from __future__ import annotations

import json
import random
from datetime import datetime
from pathlib import Path

import pytest
from dbfactories import A100, CONFIGS, DEVICES, H100, PROBLEMS, random_trials, trial
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.db import TrialStatus, TuningStore, dumps, export_bundle
from flashtune.db.schema import head_revision
from flashtune.runtime.installed import serving_state

P128, P64 = PROBLEMS
ENV = {"COLUMNS": "300", "NO_COLOR": "1"}


def _run(*args: str, ok: bool = True) -> str:
    result = CliRunner().invoke(app, list(args), env=ENV)
    output = result.output + (result.stderr if result.stderr_bytes else "")
    assert (result.exit_code == 0) == ok, f"exit {result.exit_code}: {output}"
    return output


@pytest.fixture
def filled(tmp_path: Path, rng: random.Random) -> Path:
    path = tmp_path / "ours.db"
    with TuningStore(path) as store:
        for device in DEVICES:
            store.record_device(device)
        store.record_trials(random_trials(rng, 40))
        store.record_trials([
            trial(H100, P128, 4096, CONFIGS[0], median_ms=0.0123, rng=rng, tflops=456.7),
            trial(H100, P128, 4096, CONFIGS[1], status=TrialStatus.COMPILE_FAILED, rng=rng,
                  error="[bold red]ptxas[/] error: too many resources requested"),
        ])
    return path


def test_list_show_info(filled: Path) -> None:
    listing = _run("db", "list", "--db", str(filled))   # --db after the command works too
    for device in DEVICES:
        assert device.name in listing
    assert f"{P128.key()}_n4096" in listing and CONFIGS[0].key() in listing
    assert "0.0123" in listing and "456.7" in listing

    shown = _run("db", "--db", str(filled), "show", f"{P128.key()}_n4096", "--device", H100.name)
    assert "compile_failed" in shown
    assert "[bold red]ptxas[/] error" in shown        # printed literally, never as markup
    best_line = next(line for line in shown.splitlines() if CONFIGS[0].key() in line)
    assert "0.0123" in best_line

    info = _run("db", "--db", str(filled), "info")
    assert f"schema revision: {head_revision()}" in info and "integrity: ok" in info
    with TuningStore(filled) as store:
        counts = store.counts()
    line = next(line for line in info.splitlines() if " trials " in line)
    assert line.split()[-2] == str(counts["trials"]) == "42"

    bad = _run("db", "--db", str(filled), "show", "fwd_d128_bf16_causal_n3000", ok=False)
    assert "power of two" in bad


def test_export_import_round_trip(filled: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "share" / "h100.json"
    out = _run("db", "--db", str(filled), "export", "-o", str(bundle), "--device", H100.name)
    assert "wrote" in out
    data = json.loads(bundle.read_text())
    assert {d["name"] for d in data["devices"]} == {H100.name}

    target = tmp_path / "theirs.db"
    report = _run("db", "--db", str(target), "import", str(bundle))
    assert "import of" in report
    with TuningStore(filled) as a, TuningStore(target) as b:
        assert dumps(export_bundle(b, created_at=data_time(data))) == dumps(
            export_bundle(a, devices=[H100.name], created_at=data_time(data)))
    again = _run("db", "--db", str(target), "import", str(bundle))
    assert "added" in again


def test_export_to_a_directory_says_so_and_what_to_pass(filled: Path, tmp_path: Path) -> None:
    out = _run("db", "--db", str(filled), "export", "-o", str(tmp_path), ok=False)
    assert "is a directory; expected the path of the bundle file" in out
    assert "tuning-bundle.json" in out and ".tmp" not in out and f"/.{tmp_path.name}." not in out
    assert list(tmp_path.glob(".*")) == []  # no temporary file left behind


def data_time(data: dict[str, object]) -> datetime:
    return datetime.fromisoformat(str(data["created_at"]))


def test_hostile_import_fails_cleanly(filled: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "b.json"
    _run("db", "--db", str(filled), "export", "-o", str(bundle))
    data = json.loads(bundle.read_text())
    data["devices"][0]["name"] = "x'); DROP TABLE ft_trials; --"
    bundle.write_text(json.dumps(data))
    target = tmp_path / "t.db"
    with TuningStore(target) as store:
        store.record_device(A100)
        before = dumps(export_bundle(store))
    out = _run("db", "--db", str(target), "import", str(bundle), ok=False)
    assert "error:" in out and "characters outside" in out
    with TuningStore(target) as store:
        assert dumps(export_bundle(store, created_at=data_time(json.loads(before)))) == before


def test_merge_and_digest_refusal(filled: Path, tmp_path: Path, rng: random.Random) -> None:
    other = tmp_path / "other.db"
    with TuningStore(other) as store:
        store.record_device(H100)
        store.record_trial(trial(H100, P128, 4096, CONFIGS[0], median_ms=0.005, rng=rng,
                                 template="v2"))
    refused = _run("db", "--db", str(filled), "merge", str(other), ok=False)
    assert "different kernel sources" in refused and "--allow-mixed-digests" in refused
    dry = _run("db", "--db", str(filled), "merge", str(other), "--allow-mixed-digests",
               "--dry-run")
    assert "dry run, nothing written" in dry
    with TuningStore(filled) as store:
        entry = store.best(H100.name, P128.key(), 4096)
        assert entry is not None and entry.median_ms == 0.0123
    merged = _run("db", "--db", str(filled), "merge", str(other), "--allow-mixed-digests",
                  "--prefer", "faster")
    assert "template digest differences" in merged and "stale" in merged
    with TuningStore(filled) as store:
        # Faster, but measured on other kernel sources: kept, never the served best.
        entry = store.best(H100.name, P128.key(), 4096)
        assert entry is not None and entry.median_ms == 0.0123
        assert serving_state(entry) == "current"
        assert 0.005 in {t.median_ms for t in store.trials(device=H100.name)}
    missing = _run("db", "--db", str(filled), "merge", str(tmp_path / "nope.db"), ok=False)
    assert "no database file" in missing
    assert not (tmp_path / "nope.db").exists()
    _run("db", "--db", str(filled), "merge", str(other), "--prefer", "slowest", ok=False)


def test_knob_default_and_upgrade(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "data" / "tuning.db"
    monkeypatch.setenv("FLASHTUNE_DB", str(path))
    out = _run("db", "upgrade")
    assert f"none -> {head_revision()}" in out and path.is_file()
    assert "already up to date" in _run("db", "upgrade")
    assert str(path) in _run("db", "info")
    assert "best configs (0)" in _run("db", "list")
    missing = _run("db", "--db", str(tmp_path / "absent.db"), "info", ok=False)
    assert "no database file" in missing
