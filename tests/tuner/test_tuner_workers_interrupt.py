"""Ctrl-C during `tune --workers N`: the terminal's SIGINT reaches every process of the
group; the parent stops its workers and reports once, and no worker prints a traceback."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from interrupt_helpers import interrupt_when_ready, start_as_foreground_job
from tuner_synthetic import read_log
from tuner_testlib import FAST, subprocess_env

from flashtune.tuner.workers import WorkerSpec, start_worker

PARENT = """\
import sys
from flashtune.tuner.interrupt import deferred
from flashtune.tuner.workers import WorkerSpec, run_workers

try:
    # as `flashtune tune --workers 2`: the parent stops its workers at its next poll (1 s),
    # time enough for a worker that does not ignore SIGINT to print a traceback
    with deferred("stopping the workers"):
        run_workers(WorkerSpec.from_json(sys.argv[1]), 2)
except KeyboardInterrupt:
    print("parent interrupted", file=sys.stderr, flush=True)
    sys.exit(130)
"""


def test_sigint_to_the_group_stops_the_workers_without_tracebacks(
        db_url: str, call_log: str, tmp_path: Path) -> None:
    spec = WorkerSpec(head_dim=128, dtype="bf16", causal=False, op="fwd", seqlens=(1024,),
                      db=db_url, measurer="tuner_synthetic:synthetic_measurer",
                      measurer_options={"log_path": call_log, "time_delay_s": 30.0},
                      options=dataclasses.replace(FAST, trials=10, sampler="tpe"))
    parent = tmp_path / "parent.py"
    parent.write_text(PARENT)
    proc = start_as_foreground_job(
        [sys.executable, str(parent), spec.to_json()],
        env={**os.environ, **subprocess_env(), "PYTHONFAULTHANDLER": "1"},
        stderr=subprocess.PIPE)
    err = interrupt_when_ready(
        proc, lambda: len({pid for pid, phase, _ in read_log(call_log) if phase == "time"}) >= 2,
        "two workers measuring")
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.count("parent interrupted") == 1, err
    assert err.count("stopping the workers") == 1, err


def test_a_worker_leaves_ctrl_c_to_its_parent_from_its_start(
        db_url: str, call_log: str, capfd: pytest.CaptureFixture[str]) -> None:
    """SIGINT while the worker still imports, before its own code can ignore it: the worker
    goes on and finishes its trials, printing nothing about it."""
    spec = WorkerSpec(head_dim=128, dtype="bf16", causal=False, op="fwd", seqlens=(1024,),
                      db=db_url, measurer="tuner_synthetic:synthetic_measurer",
                      measurer_options={"log_path": call_log},
                      options=dataclasses.replace(FAST, trials=3, sampler="tpe"))
    proc = start_worker(spec, env=subprocess_env())
    hits = 0
    while proc.poll() is None and not read_log(call_log):
        proc.send_signal(signal.SIGINT)
        hits += 1
        time.sleep(0.02)
    code = proc.wait(timeout=300)
    err = capfd.readouterr().err
    assert code == 0 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert hits >= 5, f"the worker measured after {hits} signals: the test did not hit its start"
