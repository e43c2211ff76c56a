"""Seeded parts of a parametrized test's cases: the default run takes a part that changes
from run to run (``FLASHTUNE_TEST_SEED`` replays it), ``-m sweep`` takes every case."""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from typing import Any

import pytest


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
