"""benchmarks/decode.py: the sweep plan, the byte count, the dry run, and the inputs and
float32 reference its GPU check relies on (checked here against flashtune in the emulator:
plumbing, never performance)."""

from __future__ import annotations

import csv
from pathlib import Path

import decode
import pytest
import torch
from _attention_impls import REL_ERR_TOLERANCE


def test_the_sweep_covers_batches_lengths_groups_and_pages() -> None:
    points = decode.plan(decode.BATCHES, decode.CACHE_LENS, decode.GROUPS, decode.PAGE_SIZES)
    assert len(points) == 5 * 5 * 3 * 3
    assert {p.batch for p in points} == {1, 4, 16, 64, 256}
    assert {p.cache_len for p in points} == {1024, 4096, 16384, 65536, 131072}
    assert {p.heads_kv for p in points} == {32, 8, 4}
    assert {p.page_size for p in points} == {None, 16, 256}


def test_bytes_per_step_are_the_cache_once_plus_the_rows_moved() -> None:
    point = decode.Point(batch=2, cache_len=1000, group=8, page_size=16)
    cache = 2 * 2 * 1000 * 4 * 128 * 2  # K and V, batch 2, 4 kv heads, dim 128, bf16
    rows = 2 * (2 * 32 + 4 * 4) * 128 * 2  # q read + O written, new K/V read + written
    assert point.cache_bytes == cache and point.min_bytes == cache + rows


def test_dry_run_writes_the_plan_without_a_gpu(tmp_path: Path) -> None:
    status = decode.main(["--dry", "--out", str(tmp_path), "--batches", "1,256",
                          "--cache-lens", "1024,131072", "--groups", "1", "--page-sizes",
                          "none,16"])
    assert status == 0
    with open(tmp_path / "decode.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 2 * 2  # points x implementations
    # 256 sequences of 128k rows with 32 kv heads are 550 GB of cache: skipped, not run.
    assert {r["status"] for r in rows if r["batch"] == "256" and r["cache_len"] == "131072"
            } == {"skipped"}
    with pytest.raises(SystemExit):
        decode.parse_args(["--groups", "3"])


@pytest.mark.emulator
def test_inputs_and_reference_agree_with_flashtune(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHTUNE_BACKEND", "emulator")
    point = decode.Point(batch=2, cache_len=40, group=8, page_size=16)
    x = decode.make_inputs(point, torch.Generator().manual_seed(0), device="cpu")
    assert x.block_table is not None and x.k_cache.shape == (2 * 3, 16, 4, 128)
    out = decode.prepare("flashtune", x, point)()
    ref = decode.reference_first(x, point)
    assert float((out[0].float() - ref).norm() / ref.norm()) < REL_ERR_TOLERANCE
