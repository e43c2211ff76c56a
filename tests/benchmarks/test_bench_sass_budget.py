"""benchmarks/sass_budget.py end to end on one arch and head dim (NVRTC, no GPU)."""

from __future__ import annotations

import json

import pytest
import sass_budget


def test_budget_json_rows_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    status = sass_budget.main(["--head-dim", "128", "--arch", "sm_90", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert [(r["problem"], r["arch"]) for r in rows] == [
        ("fwd_d128_bf16_full", "sm_90"), ("fwd_d128_bf16_causal", "sm_90")]
    for row in rows:
        assert row["fa2"] == 536 and row["ratio"] <= 1.0
        assert row["unmasked"]["static"] == sum(row["unmasked"]["classes"].values())
    assert rows[1]["masked"] is not None and rows[0]["masked"] is None
    assert status == 0


def test_budget_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert sass_budget.main(["--head-dim", "64", "--arch", "sm_80"]) == 0
    out = capsys.readouterr().out
    assert "fwd_d64_bf16_full" in out and "m128_n128_w4_s1" in out
