"""benchmarks/decode.py: the sweep plan, the byte count, the dry run, and the inputs and
float32 reference its GPU check relies on (checked here against flashtune in the emulator:
plumbing, never performance)."""

from __future__ import annotations

import csv
from pathlib import Path

import decode
import pytest
import torch
from _attention_impls import REL_ERR_TOLERANCE, Unavailable


def test_the_sweep_covers_batches_lengths_groups_and_pages() -> None:
    points = decode.plan(decode.BATCHES, decode.CACHE_LENS, decode.GROUPS, decode.PAGE_SIZES,
                         decode.QUERY_ROWS)
    assert len(points) == 5 * 5 * 4 * 5 * 2
    assert {p.batch for p in points} == {1, 4, 16, 64, 128}
    assert {p.cache_len for p in points} == {1024, 4096, 16384, 65536, 131072}
    assert {p.heads_kv for p in points} == {32, 8, 4, 2}
    assert {p.page_size for p in points} == {None, 1, 16, 64, 256}
    assert {p.query_rows for p in points} == {1, 4}


def test_bytes_per_step_are_the_cache_once_plus_the_rows_moved() -> None:
    point = decode.Point(batch=2, cache_len=1000, group=8, page_size=16)
    cache = 2 * 2 * 1000 * 4 * 128 * 2  # K and V, batch 2, 4 kv heads, dim 128, bf16
    rows = 2 * (2 * 32 + 4 * 4) * 128 * 2  # q read + O written, new K/V read + written
    assert point.cache_bytes == cache and point.min_bytes == cache + rows


def test_dry_run_writes_the_plan_without_a_gpu(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    status = decode.main(["--dry", "--out", str(tmp_path), "--batches", "1,256",
                          "--cache-lens", "1024,131072", "--groups", "1", "--page-sizes",
                          "none,16", "--query-rows", "1"])
    assert status == 0
    with open(tmp_path / "decode.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 2 * 3  # points x implementations
    printed = capsys.readouterr().out
    assert "page size:   none, 16" in printed and "copy of 1024 MiB" in printed
    assert "torch-sdpa   3 points (unpaged only)" in printed
    # 256 sequences of 128k rows with 32 kv heads are 550 GB of cache: skipped, not run.
    assert {r["status"] for r in rows if r["batch"] == "256" and r["cache_len"] == "131072"
            } == {"skipped"}
    with pytest.raises(SystemExit):
        decode.parse_args(["--groups", "3"])


def test_the_default_dry_plan_prints_every_axis(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert decode.main(["--dry", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for line in ("batch:       1, 4, 16, 64, 128", "cache len:   1024, 4096, 16384, 65536, "
                 "131072", "GQA group:   1, 4, 8, 16", "query rows:  1, 4",
                 "page size:   none, 1, 16, 64, 256"):
        assert line in printed


def test_sdpa_and_the_reference_agree_on_an_unpaged_cache() -> None:
    """The SDPA baseline (CPU torch here) against the float32 reference, 4 query rows."""
    point = decode.Point(batch=2, cache_len=40, group=4, page_size=None, query_rows=4)
    x = decode.make_inputs(point, torch.Generator().manual_seed(0), device="cpu")
    out = decode.prepare("torch-sdpa", x, point)()
    ref = decode.reference_first(x, point)
    assert float((out[0].float() - ref).norm() / ref.norm()) < REL_ERR_TOLERANCE
    paged = decode.make_inputs(decode.Point(2, 40, 4, 16), torch.Generator(), device="cpu")
    with pytest.raises(Unavailable):
        decode.prepare("torch-sdpa", paged, decode.Point(2, 40, 4, 16))


@pytest.mark.emulator
@pytest.mark.parametrize("query_rows", [1, 4])
def test_inputs_and_reference_agree_with_flashtune(monkeypatch: pytest.MonkeyPatch,
                                                   query_rows: int) -> None:
    monkeypatch.setenv("FLASHTUNE_BACKEND", "emulator")
    point = decode.Point(batch=2, cache_len=40, group=8, page_size=16, query_rows=query_rows)
    x = decode.make_inputs(point, torch.Generator().manual_seed(0), device="cpu")
    assert x.block_table is not None and x.k_cache.shape == (2 * 3, 16, 4, 128)
    out = decode.prepare("flashtune", x, point)()
    ref = decode.reference_first(x, point)
    assert float((out[0].float() - ref).norm() / ref.norm()) < REL_ERR_TOLERANCE
