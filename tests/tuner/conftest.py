"""Fixtures of the tuner tests: a fresh database and a call log."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'tuning.db'}"


@pytest.fixture
def call_log(tmp_path: Path) -> str:
    return str(tmp_path / "calls.log")
