"""Fixtures of the tuner tests: a fresh database, a call log and fast options."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from flashtune.tuner.measure import TimingPlan
from flashtune.tuner.options import TuneOptions
from flashtune.tuner.study import Heartbeat

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

#: Options that keep synthetic runs fast: inline compiles, few repeats, quick heartbeats.
FAST = TuneOptions(trials=12, compile_workers=0, depth=2, plan=TimingPlan(0, 5),
                   final_plan=TimingPlan(0, 9), final_top=3, final_rounds=3,
                   heartbeat=Heartbeat(1, 3))


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'tuning.db'}"


@pytest.fixture
def call_log(tmp_path: Path) -> str:
    return str(tmp_path / "calls.log")


def subprocess_env() -> dict[str, str]:
    """Environment for worker subprocesses: the synthetic fixture importable."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}
