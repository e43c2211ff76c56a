"""Fixtures of the hardening tier: hostile and careless inputs against the caches, the
database, the knobs and the API. Each test names the finding it guards against."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent.parent
for helper_dir in ("db", "runtime"):
    sys.path.insert(0, str(_TESTS / helper_dir))

from flashtune.toolchain import cache as cache_module  # noqa: E402
from flashtune.toolchain.cache import ArtifactCache  # noqa: E402


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[ArtifactCache]:
    """A private, empty artifact cache; directory checks are not memoised across tests."""
    cache_module.forget_trusted_directories()
    yield ArtifactCache(tmp_path / "cache")
    cache_module.forget_trusted_directories()
