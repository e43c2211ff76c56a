"""Ctrl-C in `flashtune tune`: a line saying it stops, then one clear line with the --resume
hint, on a line of its own (in a log too, where stdout and stderr share a file), and no
traceback from the command or its worker processes, wherever in the run the Ctrl-C lands
(the run's seed draws when; `-m sweep` takes each). The terminal's SIGINT goes to the whole
process group, so the test sends it to the group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from interrupt_helpers import interrupt_when_ready, start_as_foreground_job
from sampling import seeded_part

import flashtune

SOURCE = str(Path(flashtune.__file__).resolve().parents[1])


# Seconds after the database appears: the start (studies, first compiles), the first
# verifications, further into the first bucket.
SETTLE_S = [0.0, 1.0, 4.0]


@pytest.mark.parametrize("settle_s", seeded_part(SETTLE_S, 1, "ctrl-c"))
def test_ctrl_c_during_a_dry_run_prints_one_hint_line_and_no_traceback(
        tmp_path: Path, settle_s: float) -> None:
    db = tmp_path / "t.db"
    # 60 trials a bucket: far more than the settle seconds can finish with warm caches.
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1", "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (SOURCE, os.environ.get("PYTHONPATH"))
                                         if p)}
    proc = start_as_foreground_job(
        [sys.executable, "-m", "flashtune.cli", "tune", "--head-dim", "64", "--seqlens",
         "128,1024,4096", "--dry-run", "--trials", "60", "--compile-workers", "2", "--db",
         str(db)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    out = interrupt_when_ready(proc, db.exists, "the start of the tune (its database)",
                               settle_s=settle_s)
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    hints = [line for line in out.splitlines() if "--resume" in line]
    assert len(hints) == 1 and hints[0].startswith("interrupted: "), out
    assert out.count("stopping once the trial in progress is saved") == 1, out
