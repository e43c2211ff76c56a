"""Seeded parts of a parametrized test's cases: the default run takes a part that changes
from run to run (``FLASHTUNE_TEST_SEED`` replays it), ``-m sweep`` takes every case; and
sweep-only grids, built only in a run that selects sweep tests."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

#: Set by tests/conftest.py before collection: "1" where the run selects sweep tests, else "0".
SWEEP_VARIABLE = "FLASHTUNE_TEST_SWEEP"


def seeded_part(cases: Sequence[Any], k: int, salt: str, *, pool: int | None = None,
                several: bool = False) -> list[Any]:
    """``cases`` as ``parametrize`` values: a seeded ``k`` of the first ``pool`` (default:
    all) in the default run, the rest of those marked sweep; cases past ``pool`` always run.
    ``several``: each case is a tuple of several arguments' values."""
    n = len(cases) if pool is None else pool
    seed = os.environ["FLASHTUNE_TEST_SEED"]
    picked = set(random.Random(f"{seed}-{salt}").sample(range(n), k))

    def swept(case: Any) -> Any:
        return pytest.param(*(case if several else (case,)), marks=pytest.mark.sweep)
    return [c if i >= n or i in picked else swept(c) for i, c in enumerate(cases)]


def when_swept(build: Callable[[], Sequence[T]]) -> Sequence[T]:
    """``build()`` where this run selects sweep tests (``-m`` names sweep), else no cases:
    a sweep-marked test makes no items otherwise (tests/conftest.py), so its grid, which
    can take seconds to enumerate, is not built."""
    return build() if os.environ.get(SWEEP_VARIABLE) == "1" else []
