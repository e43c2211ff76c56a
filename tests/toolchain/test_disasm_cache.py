"""toolchain.disasm keeps each listing in the artifact cache: the same cubin and tool run the
tool once; another cubin, another tool or a changed tool run it again; a failure keeps
nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flashtune.errors import ToolError
from flashtune.toolchain.cache import ArtifactCache
from flashtune.toolchain.disasm import disassemble

# A stand-in for nvdisasm: counts its runs and lists the cubin's bytes (a cubin starting
# with "bad" is rejected as nvdisasm would, on stderr with a failing status).
TOOL = """#!/bin/sh
echo run >> "{log}"
if head -c 3 "$2" | grep -q bad; then echo "not a cubin" >&2; exit 1; fi
echo "{name} $1"; od -An -c "$2"
"""


def fake_tool(tmp_path: Path, name: str) -> tuple[Path, Path]:
    log = tmp_path / f"{name}.log"
    tool = tmp_path / name
    tool.write_text(TOOL.format(log=log, name=name))
    tool.chmod(0o700)
    return tool, log


def runs(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_listing_is_made_once_per_cubin_and_tool(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    tool, log = fake_tool(tmp_path, "nvdisasm")
    cubin = os.urandom(64)
    first = disassemble(cubin, tool, cache)
    assert first.startswith("nvdisasm --print-code") and runs(log) == 1
    assert disassemble(cubin, tool, cache) == first and runs(log) == 1  # from the cache
    other = disassemble(cubin[::-1], tool, cache)  # another cubin
    assert other != first and runs(log) == 2
    stat = tool.stat()  # the tool reinstalled: same path, another modification time
    os.utime(tool, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert disassemble(cubin, tool, cache) == first and runs(log) == 3
    second, second_log = fake_tool(tmp_path, "other")  # another tool
    assert disassemble(cubin, second, cache).startswith("other ") and runs(second_log) == 1
    assert disassemble(cubin, tool, ArtifactCache(tmp_path / "elsewhere")) == first
    assert runs(log) == 4  # another cache holds nothing yet


def test_a_rejected_cubin_keeps_nothing(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    tool, log = fake_tool(tmp_path, "nvdisasm")
    for expected_runs in (1, 2):
        with pytest.raises(ToolError, match="not a cubin"):
            disassemble(b"bad cubin", tool, cache)
        assert runs(log) == expected_runs
