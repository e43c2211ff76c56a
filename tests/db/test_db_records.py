"""Field rules of the records the tuner hands to the store."""

from __future__ import annotations

import dataclasses
import random

import pytest
from dbfactories import CONFIGS, H100, PROBLEMS, trial

from flashtune.db import Keyed, TrialStatus, truncate_error
from flashtune.db.records import MAX_ERROR_LEN, check_error_text


def test_truncate_error_makes_any_output_storable(rng: random.Random) -> None:
    head = "error: ptxas fatal\x1b[31m"
    noise = "".join(chr(rng.randrange(0, 0x250)) for _ in range(3 * MAX_ERROR_LEN))
    tail = "\nlast line: too many resources requested"
    clean = truncate_error(head + noise + tail)
    assert len(clean) <= MAX_ERROR_LEN
    assert check_error_text(clean) == clean
    assert clean.startswith("error: ptxas fatal?[31m") and clean.endswith(tail)
    assert "[... truncated ...]" in clean
    assert truncate_error("short\tand\nfine") == "short\tand\nfine"


def test_keyed_of_problem_and_config() -> None:
    problem, config = PROBLEMS[0], CONFIGS[2]
    assert Keyed.of(problem) == Keyed.from_mapping(problem.key(), problem.to_dict())
    assert Keyed.of(config).as_dict() == config.to_dict()
    assert Keyed.of(problem).as_dict()["dtype"] == "bf16"


@pytest.mark.parametrize("base, changes, message", [
    ("ok", {"median_ms": None}, "needs median_ms"),
    ("ok", {"count": 0}, "count >= 1"),
    ("ok", {"min_ms": 1.5}, "min_ms <= median_ms"),
    ("ok", {"status": TrialStatus.VERIFIED_UNTIMED}, "has no timings"),
    ("failed", {"tflops": 10.0}, "has no timings"),
    ("ok", {"seqlen": 0}, "out of range"),
    ("failed", {"error": "x\x07y"}, "control character"),
    ("ok", {"device": "H100; DROP"}, "characters outside"),
    ("ok", {"status": "fast"}, "is not one of"),
])
def test_trial_record_rejects_inconsistent_fields(base: str, changes: dict[str, object],
                                                  message: str) -> None:
    rng = random.Random(0)
    valid = {"ok": trial(H100, PROBLEMS[0], 1024, CONFIGS[0], median_ms=1.0, rng=rng),
             "failed": trial(H100, PROBLEMS[0], 1024, CONFIGS[0], rng=rng,
                             status=TrialStatus.WRONG_RESULT)}[base]
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(valid, **changes)  # type: ignore[arg-type]
