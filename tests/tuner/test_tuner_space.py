"""The generic search pieces: a SearchSpace's encoding and legality, the incremental trial
scan, and the guided search's decisions (failures as data, pending points, batches)."""

from __future__ import annotations

import math

import numpy as np
import optuna
import pytest

from flashtune.codegen.params import Param, ParamSpace, Point
from flashtune.tuner.search.guided import GuidedSearch
from flashtune.tuner.search.space import Candidates, PointDomain, SearchSpace
from flashtune.tuner.search.study import TrialScan

PARAMS = ParamSpace((Param("tile", (16, 32, 64, 128)), Param("mode", ("a", "b", "c")),
                     Param("fast", (False, True)), Param("fixed", (7,))))


def _legality(point: Point) -> str | None:
    return "tile 128 has no mode c" if point["tile"] == 128 and point["mode"] == "c" else None


SPACE = SearchSpace(PARAMS, _legality)


def test_a_search_space_encodes_indices_and_decodes_reasons() -> None:
    assert SPACE.choices == ("tile", "mode", "fast")  # the constant is not asked for
    assert set(SPACE.distributions()) == {"tile", "mode", "fast"}
    assert SPACE.distributions()["mode"] == optuna.distributions.IntDistribution(0, 2)
    point: Point = {"tile": 64, "mode": "b", "fast": True, "fixed": 7}
    assert SPACE.encode(point) == {"tile": 2, "mode": 1, "fast": 1}
    assert SPACE.decode(SPACE.encode(point)) == point
    assert SPACE.decode({"tile": 3, "mode": 2, "fast": 0}) == "tile 128 has no mode c"
    assert "outside" in str(SPACE.decode({"tile": 4, "mode": 0, "fast": 0}))
    assert "do not name a point" in str(SPACE.decode({"tile": 0}))
    assert len(SPACE.legal) == 4 * 3 * 2 - 2  # two illegal combinations
    assert SPACE.key(point) == "tile=64,mode=b,fast=True,fixed=7"
    candidates = Candidates(PointDomain(SPACE))
    assert len(candidates.configs) == len(SPACE.legal)
    first = candidates.configs[0]
    assert candidates.decode(candidates.encode(first)) == first
    assert candidates.key(first) == "tile=16,mode=a,fast=False,fixed=7"


def test_the_trial_scan_reads_each_finished_trial_once() -> None:
    study = optuna.create_study()
    running = study.ask()
    done = study.ask()
    study.tell(done, 1.0)
    scan = TrialScan()
    finished, unfinished = scan.update(study)
    assert [t.number for t in finished] == [1] and [t.number for t in unfinished] == [0]
    study.tell(running, 2.0)
    third = study.ask()
    finished, unfinished = scan.update(study)
    assert [t.number for t in finished] == [0] and [t.number for t in unfinished] == [2]
    study.tell(third, state=optuna.trial.TrialState.FAIL)
    assert [t.number for t in scan.update(study)[0]] == [2]
    assert scan.update(study) == ([], [])


def _rows() -> np.ndarray:
    return np.array(SPACE.legal, dtype=np.int64)


def test_guided_search_never_returns_observed_or_pending_points() -> None:
    rows = _rows()
    search = GuidedSearch(SPACE.cardinalities, rows, seed=1)
    observed: dict[int, float] = {}
    pending = {0, 1}
    seen = []
    for _step in range(len(rows) - len(pending)):
        row = search.suggest(observed, pending, {r: 1.0 + r % 3 for r in observed})
        assert row is not None and row not in observed and row not in pending
        seen.append(row)
        tile, mode, fast, _ = rows[row]
        # failures (NaN) are data: mode c always fails here
        observed[row] = math.nan if mode == 2 else float(abs(tile - 2) + fast)
    assert search.suggest(observed, pending) is None  # everything is taken
    assert len(set(seen)) == len(seen)


def test_guided_search_finds_a_smooth_optimum_early_and_batches_later() -> None:
    params = ParamSpace((Param("x", tuple(range(12))), Param("y", tuple(range(12)))))
    space = SearchSpace(params, lambda p: None)
    rows = np.array(space.legal, dtype=np.int64)
    loss = {i: float((x - 8) ** 2 + 0.5 * (y - 3) ** 2) for i, (x, y) in enumerate(rows)}
    found = []
    for seed in range(3):
        search = GuidedSearch(space.cardinalities, rows, seed=seed)
        observed: dict[int, float] = {}
        for _ in range(25):
            row = search.suggest(observed, set())
            assert row is not None
            observed[row] = loss[row]
        found.append(min(observed.values()))
    assert found == [0.0, 0.0, 0.0]  # 25 of 144 points: the optimum every time
    search = GuidedSearch(space.cardinalities, rows, seed=0)
    assert search.batch_size(10) == 1 and search.batch_size(search.sequential + 60) == 3


def test_guided_search_rejects_a_prior_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="score each"):
        GuidedSearch(SPACE.cardinalities, _rows(), seed=0, prior=np.zeros(3))
