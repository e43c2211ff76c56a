"""benchmarks/block_mask.py: the tile counts it reports are the mask's (checked against a
brute-force count on the dense mask, for the forward's query tiles and the backward's key
tiles), and it prints its figures labelled as CPU figures."""

from __future__ import annotations

import json
from pathlib import Path

import block_mask
import pytest
import torch


def test_the_counts_are_the_masks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bm.json"
    assert block_mask.main(["--tokens", "640", "--documents", "5", "--repeats", "1",
                            "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "CPU figures" in capsys.readouterr().out
    ids = block_mask.documents(640, 5, 0)
    q, k = torch.arange(640)[:, None], torch.arange(640)[None, :]
    visible = (ids[q] == ids[k]) & (q >= k)
    for row in result["tiles"]:
        bm, bn = row["block_m"], row["block_n"]
        walked = 0
        for m0 in range(0, 640, bm):
            cols = visible[m0:m0 + bm].any(0).nonzero().flatten()
            walked += 0 if cols.numel() == 0 else int(cols.max()) // bn - int(cols.min()) // bn + 1
        assert row["tiles_walked"] == walked
        assert row["tiles_dense"] == -(-640 // bm) * -(-640 // bn)
        assert 0 < row["skipped_fraction"] < 1
    for row in result["backward_tiles"]:  # per key tile, the query tiles it walks
        bm, bn = row["block_m"], row["block_n"]
        walked = 0
        for n0 in range(0, 640, bn):
            rows = visible[:, n0:n0 + bn].any(1).nonzero().flatten()
            walked += 0 if rows.numel() == 0 else int(rows.max()) // bm - int(rows.min()) // bm + 1
        assert row["tiles_walked"] == walked
        assert row["tiles_dense"] == -(-640 // bm) * -(-640 // bn)
        assert 0 < row["skipped_fraction"] < 1
    assert result["build_ms_median"] > 0
