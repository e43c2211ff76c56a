"""Shared values of the tuner tests: fast options and the worker subprocess environment."""

from __future__ import annotations

import os
from pathlib import Path

import flashtune
from flashtune.tuner.measure.base import TimingPlan
from flashtune.tuner.options import TuneOptions
from flashtune.tuner.search.study import Heartbeat

HERE = Path(__file__).parent

#: Options that keep synthetic runs fast: inline compiles, few repeats, quick heartbeats.
FAST = TuneOptions(trials=12, compile_workers=0, depth=2, plan=TimingPlan(0, 5),
                   final_plan=TimingPlan(0, 9), final_top=3, final_rounds=3,
                   heartbeat=Heartbeat(1, 3))


def subprocess_env() -> dict[str, str]:
    """Environment for worker subprocesses: the synthetic fixture and the flashtune under
    test importable (not another checkout's installed in the same environment)."""
    source = str(Path(flashtune.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (str(HERE), source, os.environ.get("PYTHONPATH", ""))
                           if p)
    return {"PYTHONPATH": path}
