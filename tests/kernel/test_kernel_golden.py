"""Golden snapshots of the rendered forward kernel for a few fixed (problem, config) pairs.

Any change to what the template emits shows up here as a diff against tests/kernel/golden/.
When the change is intended, regenerate the snapshots and review them like code:

    FLASHTUNE_UPDATE_GOLDEN=1 .venv/bin/pytest tests/kernel/test_kernel_golden.py

The banner's version and digest lines are replaced by placeholders in the snapshots (the
digest covers every header byte, so it is checked against the KernelSource instead).
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

import pytest

from flashtune._version import __version__
from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.families import render

GOLDEN_DIR = Path(__file__).parent / "golden"
UPDATE = os.environ.get("FLASHTUNE_UPDATE_GOLDEN", "") == "1"

#: Fixed variants: both dtypes, causal and not, a padded head dim (72 -> 96), the widest
#: head dim, one to eight warps and one to three pipeline stages.
GOLDEN: tuple[tuple[Problem, KernelConfig], ...] = (
    (Problem(128, DType.FP16, causal=True), KernelConfig(128, 64, 4, 2)),
    (Problem(64, DType.BF16, causal=False), KernelConfig(64, 32, 4, 1)),
    (Problem(72, DType.FP16, causal=False), KernelConfig(128, 32, 8, 3)),
    (Problem(256, DType.BF16, causal=True), KernelConfig(64, 64, 4, 1)),
    (Problem(32, DType.FP16, causal=False), KernelConfig(16, 16, 1, 2)),
)

_VERSION_LINE = re.compile(r"^// flashtune \S+ generated kernel$", re.MULTILINE)
_DIGEST_LINE = re.compile(r"^// digest: [0-9a-f]{64}$", re.MULTILINE)


def _normalise(code: str) -> str:
    code = _VERSION_LINE.sub("// flashtune <version> generated kernel", code, count=1)
    return _DIGEST_LINE.sub("// digest: <digest>", code, count=1)


def _path(problem: Problem, config: KernelConfig) -> Path:
    return GOLDEN_DIR / f"{problem.key()}__{config.key()}.cu"


@pytest.mark.parametrize(("problem", "config"), GOLDEN,
                         ids=[f"{p.key()}-{c.key()}" for p, c in GOLDEN])
def test_rendered_source_matches_golden(problem: Problem, config: KernelConfig) -> None:
    source = render(problem, config)
    text = _normalise(source.code)
    path = _path(problem, config)
    if UPDATE:
        GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.is_file(), (f"golden snapshot {path.name} is missing; create it with "
                            "FLASHTUNE_UPDATE_GOLDEN=1")
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True),
                                            text.splitlines(keepends=True),
                                            fromfile=f"golden/{path.name}", tofile="rendered"))
        pytest.fail(f"rendered source differs from the golden snapshot (if intended, "
                    f"regenerate with FLASHTUNE_UPDATE_GOLDEN=1):\n{diff[:6000]}")


@pytest.mark.parametrize(("problem", "config"), GOLDEN[:2],
                         ids=[f"{p.key()}-{c.key()}" for p, c in GOLDEN[:2]])
def test_banner_names_version_and_digest(problem: Problem, config: KernelConfig) -> None:
    source = render(problem, config)
    lines = source.code.splitlines()
    assert lines[0] == f"// flashtune {__version__} generated kernel"
    assert f"// digest: {source.digest}" in lines[:6]
    assert f"problem: {problem.key()}" in source.code
    assert f"config: {config.key()}" in source.code


def test_no_stale_snapshots() -> None:
    expected = {_path(p, c).name for p, c in GOLDEN}
    present = {p.name for p in GOLDEN_DIR.glob("*.cu")}
    if UPDATE:
        for name in present - expected:
            (GOLDEN_DIR / name).unlink()
        return
    assert present == expected, (f"stale or missing snapshots: extra {sorted(present - expected)}"
                                 f", missing {sorted(expected - present)}")
