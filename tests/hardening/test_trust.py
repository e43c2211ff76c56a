"""Shared tuning data that cannot lie, and a database that is opened as asked (issue:
hardening, "Shared tuning data (trust)" and "Database and processes")."""

from __future__ import annotations

import json
import random
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa
from dbfactories import A100, CONFIGS, DEVICES, H100, PROBLEMS, random_trials, trial
from hardening_helpers import damage_table_page, is_root
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.codegen.spec import KernelConfig, ProblemBucket
from flashtune.commands.db_verify import verify_store
from flashtune.db import (
    DeviceRecord,
    TrialStatus,
    TuningStore,
    dumps,
    export_bundle,
    import_bundle,
    parse_bundle,
    read_bundle,
    write_bundle,
)
from flashtune.errors import BundleError, DatabaseError
from flashtune.runtime.device import DeviceInfo
from flashtune.runtime.dispatch import Dispatcher, Tier
from flashtune.runtime.installed import installed_digest, serving_state
from flashtune.tuner.measure.base import VerifyOutcome

P, N = PROBLEMS[0], 4096
FAST, SLOW = CONFIGS[1], CONFIGS[2]
INVENTED = DeviceRecord("Invented GPU 9000", 9, 0, 132, 80 << 30, "1", "1", "1", "1")
FIXED = datetime(2026, 6, 1, tzinfo=timezone.utc)


def _run(*args: str, ok: bool = True) -> str:
    result = CliRunner(env={"COLUMNS": "250"}).invoke(app, list(args))
    assert (result.exit_code == 0) == ok, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return " ".join(result.output.split())


def _bundle_of(path: Path, device: DeviceRecord, trials: list[Any]) -> Path:
    with TuningStore(path.with_suffix(".db")) as store:
        store.record_device(device)
        store.record_trials(trials)
        write_bundle(export_bundle(store), path)
    return path


@pytest.fixture
def invented_bundle(tmp_path: Path) -> Path:
    """A bundle of an invented sm_90 device with a result for P (current kernel sources),
    and one for P as the sm_90a family that serves it there (what explain shows)."""
    return _bundle_of(tmp_path / "invented.json", INVENTED,
                      [trial(INVENTED, P, N, SLOW, median_ms=0.9, rng=random.Random(1)),
                       trial(INVENTED, replace(P, op="fwd90aws"), N, KernelConfig(128, 64, 8, 2),
                             median_ms=0.5, rng=random.Random(2))])


def _decide(url: str, device: Any) -> Tier:
    dispatcher = Dispatcher(lambda: TuningStore(url, create=False))
    return dispatcher.decide(ProblemBucket(P, N), device).tier


@dataclass(frozen=True)
class _Named:
    name: str
    arch: str = "sm_90"
    # The forward's own results are what these tests serve; the sm_90a family that serves
    # "fwd" on cc 9.0 GPUs is tested in tests/codegen/test_arch_specific.py.
    arch_specific_kernels: bool = False

    @property
    def family(self) -> str:
        return self.arch


# ------------------------------------------------------------------ trusted sources


def test_other_devices_results_serve_only_from_trusted_sources(
        invented_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a bundle of an invented device with compute capability 9.0 was served to
    every sm_90 device without results of its own."""
    url = str(tmp_path / "target.db")
    with TuningStore(url) as store:
        report = import_bundle(store, read_bundle(invented_bundle),
                               source=str(invented_bundle))
    other = DeviceInfo.virtual("sm_90")
    assert _decide(url, other) is Tier.DEFAULT
    assert _decide(url, _Named(INVENTED.name)) is Tier.EXACT  # its own results serve it
    digest = report.provenance.bundle_sha256 if report.provenance else ""
    for tokens in (digest[:12], "host:gpu-node-01", "all", f"local,{digest[:8]}"):
        monkeypatch.setenv("FLASHTUNE_TRUSTED_SOURCES", tokens)
        assert _decide(url, other) is Tier.SAME_ARCH, tokens
    monkeypatch.setenv("FLASHTUNE_TRUSTED_SOURCES", "local")
    assert _decide(url, other) is Tier.DEFAULT
    trusted_url = str(tmp_path / "trusted.db")
    _run("db", "--db", trusted_url, "import", str(invented_bundle), "--trust")
    assert _decide(trusted_url, other) is Tier.SAME_ARCH


def test_provenance_is_shown_by_show_and_explain(invented_bundle: Path, tmp_path: Path) -> None:
    url = str(tmp_path / "target.db")
    out = _run("db", "--db", url, "import", str(invented_bundle))
    assert "provenance: imported" in out and str(invented_bundle) in out
    shown = _run("db", "--db", url, "show", f"{P.key()}_n{N}")
    assert "(untrusted)" in shown and "claimed host gpu-node-01" in shown
    assert f"from {invented_bundle}" in shown and "exported by flashtune" in shown
    explained = _run("explain", "--head-dim", str(P.head_dim), "--dtype", P.dtype.value,
                     "--causal", "--seqlen", str(N), "--device", INVENTED.name, "--db", url)
    assert "tier: exact" in explained and "origin: imported" in explained
    assert "not marked trusted" in explained
    local = _run("explain", "--head-dim", str(P.head_dim), "--dtype", P.dtype.value,
                 "--causal", "--seqlen", str(N), "--arch", "sm_90", "--db", url)
    assert "tier: default" in local  # an untrusted source never answers for another GPU


# ------------------------------------------------------------------ physics


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("median_ms", 1e-300, "shorter than moving the bucket's smallest input"),
    ("tflops", 5000.0, "exceeds the peak of a sm_90 GPU with 132 SMs"),
])
def test_impossible_timings_are_refused(tmp_path: Path, field: str, value: float,
                                        reason: str) -> None:
    """Regression: a median of 1e-300 ms was accepted and served for every length."""
    rng = random.Random(2)
    good = trial(H100, P, N, FAST, median_ms=0.5, rng=rng)
    path = _bundle_of(tmp_path / "b.json", H100, [good])
    data = json.loads(path.read_text())
    item = data["trials"][0]
    item[field] = value
    if field == "median_ms":
        item["min_ms"] = value
    with TuningStore(tmp_path / "target.db") as store:
        before = dumps(export_bundle(store, created_at=FIXED))
        with pytest.raises(BundleError, match=reason):
            parse_bundle(json.dumps(data).encode())
        assert dumps(export_bundle(store, created_at=FIXED)) == before
        store.record_device(H100)
        values = {"median_ms": 0.5, "min_ms": 0.4, "max_ms": 0.6, "count": 3, "tflops": 100.0,
                  field: value}
        if field == "median_ms":
            values["min_ms"] = value
        bad = trial(H100, P, N, FAST, rng=rng, **cast(dict[str, Any], values))
        with pytest.raises(DatabaseError, match=reason):
            store.record_trial(bad)
        assert store.trials() == []


# ------------------------------------------------------------------ stale template digests


class _Backend:
    """A measurement backend that passes or fails every check (no emulator needed)."""

    timed = False

    def __init__(self, ok: bool) -> None:
        self.ok = ok
        self.device = H100

    def verify(self, problem: Any, config: KernelConfig, shape: Any) -> VerifyOutcome:
        if self.ok:
            return VerifyOutcome(TrialStatus.OK, max_abs_error=1e-3)
        return VerifyOutcome(TrialStatus.WRONG_RESULT, max_abs_error=1.0, error="wrong")


def test_results_of_other_kernel_sources_are_stale_until_verified(tmp_path: Path) -> None:
    """Regression: the template digest of imported results was never compared with the
    installed templates."""
    rng = random.Random(3)
    old = trial(H100, P, N, FAST, median_ms=0.2, rng=rng, template="v0")
    path = _bundle_of(tmp_path / "old.json", H100, [old])
    url = str(tmp_path / "target.db")
    with TuningStore(url, installed=installed_digest) as store:
        report = import_bundle(store, read_bundle(path))
        assert report.stale == 1
        (entry,) = store.all_best()
        assert serving_state(entry) == "stale"
    assert _decide(url, _Named(H100.name)) is Tier.DEFAULT  # kept, never served
    with TuningStore(url) as store:
        verify_store(store, store.all_best(), lambda arch: _Backend(ok=True))  # type: ignore[arg-type, return-value]
        (entry,) = store.all_best()
        assert serving_state(entry) == "reverified"
    assert _decide(url, _Named(H100.name)) is Tier.EXACT
    with TuningStore(url) as store:  # a later failing check stops it being served again
        verify_store(store, store.all_best(), lambda arch: _Backend(ok=False))  # type: ignore[arg-type, return-value]
        (entry,) = store.all_best()
        assert serving_state(entry) == "failed"
    assert _decide(url, _Named(H100.name)) is Tier.DEFAULT


def test_a_stale_best_never_blocks_a_fresh_measurement(tmp_path: Path) -> None:
    rng = random.Random(4)
    with TuningStore(tmp_path / "t.db", installed=installed_digest) as store:
        store.record_device(H100)
        store.record_trial(trial(H100, P, N, FAST, median_ms=0.1, rng=rng, template="v0"))
        fresh = trial(H100, P, N, SLOW, median_ms=0.9, rng=rng)
        assert store.record_trial(fresh)  # slower, but on the installed sources
        assert store.best(H100.name, P.key(), N).trial.uid == fresh.uid  # type: ignore[union-attr]
        assert not store.record_trial(trial(H100, P, N, FAST, median_ms=0.05, rng=rng,
                                            template="v0"))


# ------------------------------------------------------------------ hostile bundle text


@pytest.mark.parametrize("item", [b"{},", b"[],", b'"abcdefghijkl",', b"1.5e+300000000,",
                                  b'{"a":1,"b":2,"c":3,"d":4,"e":5,"f":6,"g":[]},',
                                  b'"abcdefghijklmnop",', b'{"' + b"k" * 60 + b'":1},',
                                  b'"a,b,c,{[{[,,,,,,,,\\"",'])
def test_refused_bundle_memory_is_a_small_multiple_of_its_size(item: bytes) -> None:
    """Regression: a 63 MB bundle of {} reached 1.76 GB before it was refused. Dense
    structure is refused before parsing; what passes that count costs a few bytes of
    memory per byte of file, however it is shaped."""
    body = (b'{"format": "flashtune-tuning-bundle", "trials": ['
            + item * (2_000_000 // len(item)) + item[:-1] + b"]}")
    tracemalloc.start()
    try:
        with pytest.raises(BundleError):
            parse_bundle(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 6 * len(body), (peak, len(body))


def test_lone_surrogate_and_bidi_text(tmp_path: Path) -> None:
    """Regression: a lone surrogate in an error text was a UnicodeEncodeError; bidi and line
    separators were printed raw (able to reorder what the terminal shows)."""
    rng = random.Random(5)
    failed = trial(H100, P, N, FAST, status=TrialStatus.COMPILE_FAILED, rng=rng,
                   error="line \u202eevil\u202c\u2028next")
    path = _bundle_of(tmp_path / "b.json", H100, [failed])
    url = str(tmp_path / "target.db")
    _run("db", "--db", url, "import", str(path))
    shown = _run("db", "--db", url, "show", f"{P.key()}_n{N}")
    assert "\\u202e" in shown and "\u202e" not in shown and "\u2028" not in shown
    data = json.loads(path.read_text())
    data["trials"][0]["error"] = "bad \ud800 text"
    raw = json.dumps(data).encode()  # ensure_ascii: the surrogate travels as \ud800
    with pytest.raises(BundleError, match="lone surrogate"):
        parse_bundle(raw)


# ------------------------------------------------------------------ opening databases


@pytest.fixture
def filled(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "filled.db"
    with TuningStore(path) as store:
        for device in DEVICES:
            store.record_device(device)
        store.record_trials(random_trials(random.Random(6), 30))
    yield path


def test_read_only_open_never_writes(filled: Path) -> None:
    """Regression: a database in a read-only directory could not be read (WAL was switched
    on at connect). Read-only opens now never write, whoever runs them."""
    with TuningStore(filled, create=False) as store:
        assert store.read_only and len(store.all_best()) > 0
        with store.engine.connect() as connection, pytest.raises(sa.exc.OperationalError,
                                                                 match="readonly|query_only"):
            connection.exec_driver_sql("CREATE TABLE intruder (x INTEGER)")
    if not is_root():  # a real read-only directory (root writes anywhere)
        filled.parent.chmod(0o555)
        try:
            with TuningStore(filled, create=False) as store:
                assert len(store.all_best()) > 0
        finally:
            filled.parent.chmod(0o755)


def test_mode_ro_is_honoured(filled: Path, tmp_path: Path) -> None:
    """Regression: ?mode=ro was ignored and a missing file created."""
    missing = tmp_path / "missing.db"
    with pytest.raises(DatabaseError, match="no database file"):
        TuningStore(f"sqlite:///{missing}?mode=ro")
    assert not missing.exists()
    with TuningStore(f"sqlite:///{filled}?mode=ro") as store:
        assert store.trials()
        with pytest.raises(DatabaseError):
            store.record_device(A100)


@pytest.mark.parametrize(("url", "message"), [
    ("", "is empty"),
    ("sqlite:", "without '//'"),
    ("sqlite:///", "names no database file"),
    ("sqlite:////x.db?timeout=abc", "timeout='abc'"),
    ("sqlite:////x.db?cache_size=1", "unknown SQLite parameter 'cache_size'"),
])
def test_malformed_database_urls(url: str, message: str, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: --db "" and --db sqlite: made odd files; timeout=abc was a traceback."""
    monkeypatch.chdir(tmp_path)
    out = _run("db", "--db", url, "list", ok=False)
    assert message in out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["db", "list"], ["db", "show", "fwd_d64_fp16_full_n128"],
                                     ["db", "export", "-o", "x.json"], ["report"]])
def test_read_commands_refuse_a_missing_file(command: list[str], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: read commands on a mistyped path silently created a new database."""
    monkeypatch.chdir(tmp_path)
    typo = tmp_path / "tunnig.db"
    args = ([*command[:1], "--db", str(typo), *command[1:]] if command[0] == "db"
            else [*command, "--db", str(typo)])
    assert "no database file" in _run(*args, ok=False)
    assert not typo.exists()


def test_info_checks_integrity(filled: Path) -> None:
    """Regression: db info reported row counts on a corrupted file."""
    damage_table_page(filled)
    out = _run("db", "--db", str(filled), "info", ok=False)
    assert "integrity check" in out and "trials" not in out.split("integrity check")[0]
