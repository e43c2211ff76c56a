"""benchmarks/_common.py: FLOP counts, statistics, budgets and output files."""

from __future__ import annotations

import csv
import json
import random
import statistics
import time
from pathlib import Path

import pytest
import torch
from _common import Deadline, Stats, attention_flops, environment_info, write_csv, write_json
from torch.utils.flop_counter import FlopCounterMode


def _naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, H, N, D) attention as two batched matmuls around a softmax."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize(("b", "n", "h", "d"), [(2, 48, 3, 16), (1, 80, 2, 64)])
def test_flops_match_torch_flop_counter(b: int, n: int, h: int, d: int) -> None:
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        _naive_attention(q, k, v)
    assert attention_flops(b, n, n, h, d, causal=False) == counter.get_total_flops()


def test_causal_flops_are_half_and_sizes_validated() -> None:
    full = attention_flops(4, 4096, 4096, 16, 128, causal=False)
    assert full == 4 * 4 * 4096 * 4096 * 16 * 128
    assert attention_flops(4, 4096, 4096, 16, 128, causal=True) == full / 2
    with pytest.raises(ValueError, match="seqlen_k must be >= 1"):
        attention_flops(1, 8, 0, 1, 64, causal=False)


def test_stats_of_random_samples() -> None:
    rng = random.Random()
    samples = [rng.uniform(0.1, 9.0) for _ in range(rng.randint(5, 40))]
    s = Stats.of(samples)
    assert s.median == statistics.median(samples)
    assert (s.minimum, s.maximum, s.count) == (min(samples), max(samples), len(samples))
    with pytest.raises(ValueError, match="NaN"):
        Stats.of([1.0, float("nan")])
    with pytest.raises(ValueError, match="at least one"):
        Stats.of([])


def test_deadline() -> None:
    assert not Deadline(None).expired()
    d = Deadline(0.05)
    assert 0 < d.remaining() <= 0.05
    time.sleep(0.06)
    assert d.expired()
    with pytest.raises(ValueError, match="> 0"):
        Deadline(0)


def test_csv_and_json_round_trip(tmp_path: Path) -> None:
    rows: list[dict[str, object]] = [{"a": 1.23456789, "b": None, "c": "x"},
                                     {"a": 2, "b": True, "c": ""}]
    path = tmp_path / "sub" / "out.csv"
    write_csv(path, ["a", "b", "c"], rows)
    with path.open() as f:
        back = list(csv.DictReader(f))
    assert back == [{"a": "1.23457", "b": "", "c": "x"}, {"a": "2", "b": "True", "c": ""}]
    with pytest.raises(ValueError):
        write_csv(path, ["a"], [{"a": 1, "zzz": 2}])
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.csv"]  # no temp file left
    write_json(tmp_path / "x.json", {"k": [1, 2]})
    assert json.loads((tmp_path / "x.json").read_text()) == {"k": [1, 2]}


def test_environment_info_names_date_and_versions() -> None:
    info = environment_info()
    assert info["torch"] == torch.__version__
    assert info["date_utc"].endswith("+00:00")
    assert info["gpu"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
