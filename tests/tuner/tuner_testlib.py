"""Shared values of the tuner tests: fast options, the worker subprocess environment and the
forward family's tile space (the tuner tests search it: the whole forward space, 10^5
configs a problem with the structure knobs, is too large for exhaustive test runs)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import flashtune
from flashtune.codegen.params import Param, ParamSpace
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.families.base import KernelFamily
from flashtune.families.fwd import FORWARD
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


#: The forward tile fields over the values the tuner tests were written for (27 configs of
#: d128 pass the static rules), knobs at their defaults.
TILE_SPACE = ParamSpace((Param("block_m", (64, 128)), Param("block_n", (32, 64, 128)),
                         Param("num_warps", (4, 8)), Param("num_stages", (1, 2, 3))))


def _tile_search_space(problem: Problem) -> list[KernelConfig]:
    return KernelFamily.search_space(FORWARD, problem)


def _tile_point(config: KernelConfig) -> dict[str, int | str | bool]:
    """A config's point in TILE_SPACE (the tuner tests' configs carry no knob)."""
    assert not config.extras, config
    return dict(config.to_dict())


@contextlib.contextmanager
def tile_space() -> Iterator[None]:
    """The forward family declares TILE_SPACE inside the block."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FORWARD, "space", lambda problem: TILE_SPACE)
        patch.setattr(FORWARD, "search_space", _tile_search_space)
        patch.setattr(FORWARD, "point", _tile_point)
        yield


def use_tile_space() -> None:
    """The forward family declares TILE_SPACE for the rest of this process (a worker
    subprocess of a test)."""
    setattr(FORWARD, "space", lambda problem: TILE_SPACE)  # noqa: B010
    setattr(FORWARD, "search_space", _tile_search_space)  # noqa: B010
    setattr(FORWARD, "point", _tile_point)  # noqa: B010
