"""Measuring from recorded measurements on a simulated clock.

``RecordedMeasurer`` is the measurement the tuner's pipeline drives when every
configuration was measured before (a recorded landscape, ``flashtune.tuner.landscape``):
each evaluation advances a simulated clock by the recorded compile, framework and run
times and returns the recorded objective, or the recorded failure as data; a
configuration measured before is returned again for free (nothing is compiled twice).
The clock is what a time budget of a replayed run counts.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flashtune.codegen.params import Value
from flashtune.db.records import TrialStatus
from flashtune.errors import TuningError
from flashtune.tuner.measure.base import COST_ATTR

Config = tuple[Value, ...]


@dataclass(frozen=True)
class Recorded:
    """One brute-forced configuration: its outcome and what measuring it cost."""

    status: TrialStatus
    objective: float | None  # the recorded objective (None unless ok)
    seconds: float           # compile + framework + kernel runs


@dataclass(frozen=True)
class RecordedResult:
    """One evaluation answered from the record (an ``Outcome`` for the search)."""

    config: Config
    status: TrialStatus
    objective: float | None
    charged_s: float  # simulated seconds this evaluation cost (0 for a re-proposal)
    clock_s: float    # the simulated clock after it

    def attrs(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = {COST_ATTR: self.charged_s,
                                             "clock_s": self.clock_s}
        if self.status.failed:
            out["error"] = f"recorded {self.status.value}"
        return out


def _done() -> cf.Future[None]:
    future: cf.Future[None] = cf.Future()
    future.set_result(None)
    return future


class RecordedMeasurer:
    """The pipeline's Measurement of recorded configurations on a simulated clock (module
    docstring); ``source`` names the record in errors (e.g. the landscape's file name)."""

    def __init__(self, records: Mapping[Config, Recorded], source: str) -> None:
        self.records = records
        self.source = source
        self.clock_s = 0.0
        self.evaluations = 0
        self._seen: set[Config] = set()

    def now(self) -> float:
        """The simulated clock in seconds (a Limits clock)."""
        return self.clock_s

    def start(self, config: Config) -> cf.Future[None]:
        return _done()  # nothing runs ahead: the clock charges the compile in finish()

    def finish(self, config: Config, started: cf.Future[Any]) -> RecordedResult:
        record = self.records.get(config)
        if record is None:
            raise TuningError(f"{config} is not a recorded configuration of "
                              f"{self.source}; the search proposed an illegal point")
        charged = 0.0 if config in self._seen else record.seconds
        self._seen.add(config)
        self.clock_s += charged
        self.evaluations += 1
        return RecordedResult(config, record.status, record.objective, charged, self.clock_s)
