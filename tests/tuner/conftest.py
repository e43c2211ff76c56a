"""Fixtures of the tuner tests: a fresh database, a call log, and the forward family's tile
space in every tuner test (tuner_testlib.TILE_SPACE)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tuner_testlib import tile_space  # noqa: E402  (importable once the path is set)


@pytest.fixture(autouse=True)
def _forward_tile_space() -> Iterator[None]:
    with tile_space():
        yield


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'tuning.db'}"


@pytest.fixture
def call_log(tmp_path: Path) -> str:
    return str(tmp_path / "calls.log")
