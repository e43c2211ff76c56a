"""The measurement pipeline: compile ahead in a pool while the device measures.

Generic over what is measured (``Measurement``): kernels on a measurer
(``measure.kernels.KernelMeasurement``), or a recorded landscape replayed on a simulated
clock (``measure.recorded.RecordedMeasurer``).

Proposals are taken ``depth`` ahead and their compilations submitted to a pool at once;
the device then verifies and times them one at a time in proposal order, so it never waits
for NVRTC once the pipeline is full. Each result is recorded (database first, then Optuna)
as soon as it exists, so an interruption loses only the candidates still in the pipeline;
those are abandoned (told FAIL) on a clean stop and reaped as stale after a SIGKILL. A
Ctrl-C under ``interrupt.deferred`` stops the loop once the trial being measured is
recorded.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from flashtune.tuner.interrupt import checkpoint
from flashtune.tuner.search.proposers import Proposal, Proposer

C = TypeVar("C")
C_contra = TypeVar("C_contra", contravariant=True)
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


@dataclass(frozen=True)
class Limits:
    """When a bucket's search stops: measured candidates, and a deadline on ``clock``
    (wall-clock seconds by default; a replay passes its simulated clock)."""

    trials: int
    deadline: float | None = None  # a value of clock()
    clock: Callable[[], float] = time.monotonic

    def expired(self) -> bool:
        return self.deadline is not None and self.clock() >= self.deadline


class Measurement(Protocol[C_contra, R_co]):
    """How the pipeline measures one config: ``start`` the part that runs ahead in
    parallel (the compile), then ``finish`` it in proposal order (verify and time)."""

    def start(self, config: C_contra) -> cf.Future[Any]: ...

    def finish(self, config: C_contra, started: cf.Future[Any]) -> R_co: ...


def run_pipeline(measurement: Measurement[C, R], proposer: Proposer[C, R], limits: Limits,
                 *, depth: int, on_result: Callable[[Proposal[C], R], None]) -> int:
    """Measure up to ``limits.trials`` proposals; returns how many were measured.

    ``on_result`` records a result (it runs before the proposer is told, so a result is
    in the database before Optuna considers the trial finished).
    """
    inflight: deque[tuple[Proposal[C], cf.Future[Any]]] = deque()
    measured = 0
    exhausted = False
    current: Proposal[C] | None = None  # taken from the pipeline, not yet told
    try:
        while True:
            checkpoint()
            while (not exhausted and len(inflight) < max(1, depth)
                   and measured + len(inflight) < limits.trials and not limits.expired()):
                proposal = proposer.propose()
                if proposal is None:
                    exhausted = True
                    break
                inflight.append((proposal, measurement.start(proposal.config)))
            if not inflight:
                return measured
            proposal, future = inflight.popleft()
            current = proposal
            result = measurement.finish(proposal.config, future)
            on_result(proposal, result)
            proposer.tell(proposal, result)
            current = None
            measured += 1
            if limits.expired():
                return measured
    finally:
        if current is not None:
            proposer.abandon(current)
        for proposal, future in inflight:
            future.cancel()
            proposer.abandon(proposal)
