"""Block scheduling (makespan) and rank statistics against independent implementations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flashtune.errors import InvalidInput
from flashtune.perf.model import grid
from flashtune.perf.model.calibrate import spearman


def _reference_makespan(durations: list[float], repeats: int, slots: int) -> float:
    """Greedy list scheduling by scanning every slot (no heap)."""
    free = [0.0] * slots
    end = 0.0
    for _ in range(repeats):
        for dur in durations:
            i = min(range(slots), key=lambda s: (free[s], s))
            free[i] += dur
            end = max(end, free[i])
    return end


def test_equal_blocks_are_wave_quantised() -> None:
    rng = np.random.default_rng()
    for _ in range(20):
        slots = int(rng.integers(1, 300))
        blocks = int(rng.integers(1, 3000))
        dur = float(rng.uniform(1e-6, 1e-3))
        got = grid.makespan([dur], blocks, slots)
        assert got.makespan == pytest.approx(math.ceil(blocks / slots) * dur)
        assert got.busy == pytest.approx(blocks * dur)
        assert got.utilisation == pytest.approx(blocks / (slots * math.ceil(blocks / slots)))


def test_unequal_blocks_match_a_plain_greedy_scheduler() -> None:
    rng = np.random.default_rng()
    for _ in range(30):
        n = int(rng.integers(1, 40))
        durations = list(rng.uniform(0.0, 1.0, size=n))
        repeats = int(rng.integers(1, 20))
        slots = int(rng.integers(1, 64))
        got = grid.makespan(durations, repeats, slots).makespan
        assert got == pytest.approx(_reference_makespan(durations, repeats, slots))


def test_large_grids_are_extrapolated_close_to_exact() -> None:
    durations = [float(k + 1) for k in range(64)]  # a causal-like ramp
    repeats = 1500                                  # 96k blocks: beyond the exact limit
    slots = 264
    assert len(durations) * repeats > grid.EXACT_LIMIT
    approx = grid.makespan(durations, repeats, slots).makespan
    exact = grid._simulate(durations, repeats, slots)
    assert approx == pytest.approx(exact, rel=0.01)
    assert approx >= sum(durations) * repeats / slots


def test_makespan_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        grid.makespan([], 1, 1)
    with pytest.raises(ValueError):
        grid.makespan([1.0], 1, 0)
    with pytest.raises(ValueError):
        grid.makespan([-1.0], 1, 1)


def _ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(1, len(values) + 1)
    return ranks


def test_spearman_matches_the_rank_formula_without_ties() -> None:
    rng = np.random.default_rng()
    for _ in range(20):
        n = int(rng.integers(3, 60))
        x = rng.permutation(n).astype(float) + rng.uniform(0, 0.1, n)
        y = x + rng.normal(0, float(rng.uniform(0.1, 30)), n)
        rx, ry = _ranks(x), _ranks(y)
        expected = 1 - 6 * float(np.sum((rx - ry) ** 2)) / (n * (n * n - 1))
        assert spearman(list(x), list(y)) == pytest.approx(expected, abs=1e-12)


def test_spearman_edges() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Ties take their mean rank: ranks (1.5, 1.5, 3) vs (1, 2, 3).
    expected = float(np.corrcoef([1.5, 1.5, 3], [1, 2, 3])[0, 1])
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(expected)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(InvalidInput, match="2 predictions but 3"):
        spearman([1, 2], [1, 2, 3])
    with pytest.raises(InvalidInput, match="finite"):
        spearman([1, float("nan")], [1, 2])
