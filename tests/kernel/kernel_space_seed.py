"""The seed of the sampled config sweep (chosen and printed by tests/conftest.py)."""

from __future__ import annotations

import os

SEED_VARIABLE = "FLASHTUNE_TEST_SEED"
SPACE_SEED = int(os.environ[SEED_VARIABLE])
