"""``db list`` and ``db show`` never cut a bucket key, a config key, a device name or an
error text, at 80 columns as at 160: a table too wide for the terminal becomes one block of
lines per row, and error texts are printed whole below the table."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from dbfactories import A100, CONFIGS, H100, trial
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.codegen.spec import DType, Problem
from flashtune.db import TrialStatus, TuningStore

#: A problem whose keys are long: every feature switched on.
LONG = Problem(128, DType.BF16, window=True, softcap=True, alibi=True)
ERROR = ("ptxas error: entry function uses too much shared memory (0x1c000 bytes, 0xc000 "
         "max) for the requested block size; lower --stages or --block-n and compile again")


@pytest.fixture
def db(tmp_path: Path) -> Path:
    rng = random.Random(7)
    path = tmp_path / "fit.db"
    with TuningStore(path) as store:
        for device in (H100, A100):
            store.record_device(device)
        store.record_trials([
            trial(H100, LONG, 16384, CONFIGS[4], median_ms=0.5, rng=rng),
            trial(A100, LONG, 16384, CONFIGS[2], median_ms=0.9, rng=rng),
            trial(H100, LONG, 16384, CONFIGS[5], status=TrialStatus.COMPILE_FAILED,
                  rng=rng, error=ERROR),
        ])
    return path


def _run(columns: int, *args: str) -> str:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns),
                                                      "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("columns", [80, 160])
def test_db_list_and_show_print_every_key_and_error_whole(db: Path, columns: int) -> None:
    bucket = f"{LONG.key()}_n16384"
    listing = _run(columns, "db", "--db", str(db), "list")
    shown = _run(columns, "db", "--db", str(db), "show", bucket)
    for text in (bucket, CONFIGS[4].key(), CONFIGS[2].key(), H100.name, A100.name):
        assert text in listing, (text, listing)
    for text in (bucket, CONFIGS[4].key(), CONFIGS[5].key(), H100.name, ERROR):
        assert text in shown, (text, shown)
    assert "…" not in listing + shown


@pytest.mark.parametrize("columns", [80, 160])
def test_db_verify_prints_every_detail_whole(db: Path, columns: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from flashtune.commands import db_verify
    from flashtune.db.records import BestEntry

    def failing(measurer: object, entry: BestEntry, **kwargs: object
                ) -> db_verify.Checked:
        return db_verify.Checked(entry, None, False, f"wrong_result: {ERROR}")

    monkeypatch.setattr(db_verify, "check_entry", failing)
    emulator = SimpleNamespace(timed=False, device=SimpleNamespace(name="virtual-sm_90"))
    monkeypatch.setattr(db_verify, "measurer_for", lambda kind: ((lambda arch: emulator), 72))
    result = CliRunner().invoke(app, ["db", "--db", str(db), "verify"],
                                env={"COLUMNS": str(columns), "NO_COLOR": "1"})
    assert result.exit_code == 1, result.output
    assert f"wrong_result: {ERROR}" in result.output
    for text in (f"{LONG.key()}_n16384", CONFIGS[4].key(), CONFIGS[2].key(), H100.name):
        assert text in result.output, (text, result.output)
    assert "0 passed, 2 failed" in result.output
