"""The cost model's predictions of a fixed set of configs (tests/perf/fixed_predictions.py)
equal the recorded ones (``fixed_predictions.py`` says when they were recorded):
restructuring the model moves no figure, label or note."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from fixed_predictions import record

RECORDED = Path(__file__).with_name("fixed_predictions.json")


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.fixture(scope="module")
def current() -> dict[str, object]:
    return record()


def test_every_recorded_case_is_still_predicted(current: dict[str, object]) -> None:
    recorded = json.loads(RECORDED.read_text())
    assert sorted(current) == sorted(recorded)
    paths = {v["path"] for v in recorded.values() if "path" in v}
    assert paths == {"mma.sync", "wgmma"}  # both strategies are exercised


def test_predictions_equal_the_record(current: dict[str, object]) -> None:
    recorded = json.loads(RECORDED.read_text())
    changed = [name for name, figures in recorded.items()
               if not _same(json.loads(json.dumps(current[name])), figures)]
    assert not changed, f"{len(changed)} predictions moved, e.g. {changed[:5]}"
