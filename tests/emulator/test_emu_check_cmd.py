"""``flashtune check`` end to end: NVRTC resources plus the emulator against float64."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.codegen.spec import DType
from flashtune.families import checks
from flashtune.families.base import Tolerance

pytestmark = pytest.mark.emulator

ARGS = ["check", "--head-dim", "64", "--dtype", "fp16", "--config", "m64_n32_w4_s2",
        "--arch", "sm_80", "--arch", "sm_90", "--seqlen-q", "100", "--seqlen-k", "70",
        "--heads", "2", "--heads-kv", "1", "--causal", "--seed", "7"]


def test_check_passes_and_prints_one_row_per_arch() -> None:
    result = CliRunner().invoke(app, ARGS)
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if "m64_n32_w4_s2" in line]
    assert len(rows) == 2
    assert "sm_80" in rows[0] and "sm_90" in rows[1]
    assert all("pass" in row for row in rows)
    assert "seed 7" in result.output


def test_check_fails_when_the_tolerance_is_missed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(checks.O_TOLERANCE, DType.FP16, Tolerance(1e-12, 0.0))
    result = CliRunner().invoke(app, [*ARGS, "--no-compile", "--schedule", "forward"])
    assert result.exit_code == 1
    assert "FAIL" in result.output
    text = " ".join(result.output.split())
    assert "outside |err| <= 1e-12" in text  # the (patched) tolerance is named


def test_check_rejects_bad_shapes() -> None:
    result = CliRunner().invoke(app, ["check", "--heads", "3", "--heads-kv", "2"])
    assert result.exit_code == 2
    text = " ".join(result.output.replace("│", " ").split())
    assert "not a multiple of heads_kv=2" in text
