"""``db import --dry-run`` and ``db merge --dry-run`` write nothing: not even the target
database file when it does not exist yet."""

from __future__ import annotations

import random
from pathlib import Path

from dbfactories import CONFIGS, H100, PROBLEMS, trial
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.db import TuningStore

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


def test_a_dry_run_import_or_merge_creates_no_database(tmp_path: Path) -> None:
    source = tmp_path / "ours.db"
    with TuningStore(source) as store:
        store.record_device(H100)
        store.record_trials([trial(H100, PROBLEMS[0], 4096, CONFIGS[0], median_ms=0.5,
                                   rng=random.Random(3))])
    bundle = tmp_path / "h100.json"
    runner = CliRunner()
    result = runner.invoke(app, ["db", "--db", str(source), "export", "-o", str(bundle)],
                           env=ENV)
    assert result.exit_code == 0, result.output
    target = tmp_path / "new" / "theirs.db"
    for args in (["import", str(bundle)], ["merge", str(source)]):
        result = runner.invoke(app, ["db", "--db", str(target), *args, "--dry-run"], env=ENV)
        assert result.exit_code == 0, result.output
        assert "dry run, nothing written" in result.output
        assert not target.exists() and not target.parent.exists(), args
        # what would be added is still reported: the trial and the best entry
        assert any(line.replace("│", " ").split()[:2] == ["trials", "1"]
                   for line in result.output.splitlines()), result.output
