"""Helpers of the hardening tier (a module of its own: several test folders have a
conftest, so ``from conftest import ...`` would find the wrong one)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

#: The run's seed (tests/conftest.py sets it and prints it in the report header).
RUN_SEED = int(os.environ.get("FLASHTUNE_TEST_SEED", "0"))


def is_root() -> bool:
    return os.geteuid() == 0


def damage_table_page(path: Path, table: str = "ft_problems") -> None:
    """Overwrite the cells of ``table``'s root page in the SQLite file at ``path``: the file
    still opens, SQLite's integrity (and quick) check fails."""
    connection = sqlite3.connect(path)
    connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page = connection.execute("PRAGMA page_size").fetchone()[0]
    root = connection.execute("SELECT rootpage FROM sqlite_master WHERE name = ?",
                              (table,)).fetchone()[0]
    connection.close()
    data = bytearray(path.read_bytes())
    start = (root - 1) * page
    data[start + page - 200:start + page - 20] = b"\xab" * 180  # the cells of a table page
    path.write_bytes(bytes(data))
