"""Ctrl-C in `flashtune tune`: one clear line with the --resume hint, on a line of its own
(in a log too, where stdout and stderr share a file), and no traceback from the command or
its worker processes. The terminal's SIGINT goes to the whole process group, so the test
sends it to the group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import flashtune

SOURCE = str(Path(flashtune.__file__).resolve().parents[1])


def test_ctrl_c_during_a_dry_run_prints_one_hint_line_and_no_traceback(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (SOURCE, os.environ.get("PYTHONPATH"))
                                         if p)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashtune.cli", "tune", "--head-dim", "64", "--seqlens",
         "128,1024,4096", "--dry-run", "--trials", "3", "--compile-workers", "2", "--db",
         str(db)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not db.exists():  # the run has started: the database is opened inside it
            assert proc.poll() is None, proc.communicate()[0].decode()
            assert time.monotonic() < deadline, "the tune did not start in 120 s"
            time.sleep(0.1)
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)
        out = proc.communicate(timeout=120)[0].decode()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    hints = [line for line in out.splitlines() if "--resume" in line]
    assert len(hints) == 1 and hints[0].startswith("interrupted: "), out
