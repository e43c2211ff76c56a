"""The measurement pipeline: compile ahead in a pool while the device measures.

Proposals are taken ``depth`` ahead and their compilations submitted to a pool at once;
the device then verifies and times them one at a time in proposal order, so it never waits
for NVRTC once the pipeline is full. Each result is recorded (database first, then Optuna)
as soon as it exists, so an interruption loses only the candidates still in the pipeline;
those are abandoned (told FAIL) on a clean stop and reaped as stale after a SIGKILL.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.runtime.compiler import compile_process_pool
from flashtune.tuner.measure.base import CompileOutcome, Compiler, MeasurementBackend, TimingPlan
from flashtune.tuner.measure.evaluate import TrialResult, evaluate
from flashtune.tuner.measure.workload import Workload
from flashtune.tuner.search.proposers import Proposal, Proposer


class CompilePool:
    """Runs a Compiler in worker processes (``workers`` >= 1) or inline (0).

    Outcomes are memoised per (problem, config): buckets of one problem share binaries, so
    each config is compiled once per run. Worker processes come from
    ``runtime.compiler.compile_process_pool``: spawned (no inherited threads or CUDA context)
    and killed with their parent.
    """

    def __init__(self, compiler: Compiler, workers: int) -> None:
        self.compiler = compiler
        self.workers = workers
        self._memo: dict[tuple[Problem, KernelConfig], cf.Future[CompileOutcome]] = {}
        self._executor: cf.Executor | None = None
        if workers > 0:
            self._executor = compile_process_pool(workers)

    def submit(self, problem: Problem, config: KernelConfig) -> cf.Future[CompileOutcome]:
        key = (problem, config)
        found = self._memo.get(key)
        if found is not None and not found.cancelled():
            return found
        if self._executor is None:
            future: cf.Future[CompileOutcome] = cf.Future()
            try:
                future.set_result(self.compiler(problem, config))
            except BaseException as exc:
                future.set_exception(exc)
        else:
            future = self._executor.submit(self.compiler, problem, config)
        self._memo[key] = future
        return future

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Limits:
    """When a bucket's search stops: measured candidates, and a wall-clock deadline."""

    trials: int
    deadline: float | None = None  # time.monotonic() value

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


def run_pipeline(backend: MeasurementBackend, workload: Workload, proposer: Proposer,
                 pool: CompilePool, plan: TimingPlan, limits: Limits, *, depth: int,
                 max_spill_bytes: int,
                 on_result: Callable[[Proposal, TrialResult], None]) -> int:
    """Measure up to ``limits.trials`` proposals; returns how many were measured.

    ``on_result`` records a result (it runs before the proposer is told, so a result is
    in the database before Optuna considers the trial finished).
    """
    inflight: deque[tuple[Proposal, cf.Future[CompileOutcome]]] = deque()
    measured = 0
    exhausted = False
    current: Proposal | None = None  # taken from the pipeline, not yet told
    try:
        while True:
            while (not exhausted and len(inflight) < max(1, depth)
                   and measured + len(inflight) < limits.trials and not limits.expired()):
                proposal = proposer.propose()
                if proposal is None:
                    exhausted = True
                    break
                inflight.append((proposal, pool.submit(workload.problem, proposal.config)))
            if not inflight:
                return measured
            proposal, future = inflight.popleft()
            current = proposal
            result = evaluate(backend, workload, proposal.config, future.result(), plan,
                              max_spill_bytes)
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
