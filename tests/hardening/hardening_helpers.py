"""Helpers of the hardening tier (a module of its own: several test folders have a
conftest, so ``from conftest import ...`` would find the wrong one)."""

from __future__ import annotations

import os

#: The run's seed (tests/conftest.py sets it and prints it in the report header).
RUN_SEED = int(os.environ.get("FLASHTUNE_TEST_SEED", "0"))


def is_root() -> bool:
    return os.geteuid() == 0
