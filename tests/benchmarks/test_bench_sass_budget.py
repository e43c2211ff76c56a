"""benchmarks/sass_budget.py end to end on one arch and head dim (NVRTC, no GPU). Both tests
take the same arch and head dim, on one xdist worker: the table's kernels are the JSON
run's, from the kernel cache. Their compiles and listings take about 17 s of a core, so
they are ``slow``."""

from __future__ import annotations

import json

import pytest
import sass_budget


@pytest.mark.slow
@pytest.mark.xdist_group("sass_budget_d128_sm90")
def test_budget_json_rows_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    status = sass_budget.main(["--head-dim", "128", "--arch", "sm_90", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert [(r["problem"], r["arch"]) for r in rows if r["role"] == "default"] == [
        ("fwd_d128_bf16_full", "sm_90"), ("fwd_d128_bf16_causal", "sm_90")]
    # FA2's 128 x 32 tile, the issue's reference, has a row whatever the defaults are
    reference = {r["problem"]: r for r in rows if r["config"] == "m128_n32_w4_s2"}
    assert set(reference) == {"fwd_d128_bf16_full", "fwd_d128_bf16_causal"}
    assert reference["fwd_d128_bf16_causal"]["masked"] is not None
    assert reference["fwd_d128_bf16_full"]["masked"] is None
    for row in rows:
        if row["fa2"] is not None:
            assert row["ratio"] <= 1.0, row
        assert row["unmasked"]["static"] == sum(row["unmasked"]["classes"].values())
    assert {r["fa2"] for r in reference.values()} == {536}
    assert status == 0


@pytest.mark.slow
@pytest.mark.xdist_group("sass_budget_d128_sm90")
def test_budget_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert sass_budget.main(["--head-dim", "128", "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert "fwd_d128_bf16_full" in out and "fwd_d128_bf16_causal" in out
    assert "m128_n32_w4_s2" in out and "reference" in out  # FA2's tile has its row
