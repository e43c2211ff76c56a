"""Measuring kernels on a measurer: compiles in a process pool, then evaluate().

``CompilePool`` runs NVRTC ahead of the device; ``KernelMeasurement`` is the pipeline's
``Measurement`` of a bucket's candidates on a ``Measurer``.
"""

from __future__ import annotations

import concurrent.futures as cf
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.errors import TuningError
from flashtune.toolchain.processes import compile_process_pool
from flashtune.tuner.measure.base import CompileOutcome, Compiler, Measurer, TimingPlan
from flashtune.tuner.measure.evaluate import TrialResult, evaluate
from flashtune.tuner.measure.workload import Workload


class CompilePool:
    """Runs a Compiler in worker processes (``workers`` >= 1) or inline (0).

    Outcomes are memoised per (problem, config): buckets of one problem share binaries, so
    each config is compiled once per run. Worker processes come from
    ``toolchain.processes.compile_process_pool``: spawned (no inherited threads or CUDA context)
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


class KernelMeasurement:
    """Kernels on a Measurer: NVRTC in the pool ahead, then evaluate()."""

    def __init__(self, measurer: Measurer, workload: Workload, pool: CompilePool,
                 plan: TimingPlan, max_spill_bytes: int) -> None:
        self.backend = measurer
        self.workload = workload
        self.pool = pool
        self.plan = plan
        self.max_spill_bytes = max_spill_bytes

    def start(self, config: KernelConfig) -> cf.Future[CompileOutcome]:
        return self.pool.submit(self.workload.problem, config)

    def finish(self, config: KernelConfig, started: cf.Future[Any]) -> TrialResult:
        try:
            compiled = started.result()
        except BrokenProcessPool as exc:  # not this config's fault: no trial to record
            raise TuningError(
                "a compile worker process ended abruptly (killed, or out of memory?), so "
                "its pool cannot go on; every finished trial is saved: rerun with --resume "
                "and fewer --compile-workers (0 compiles in this process)") from exc
        return evaluate(self.backend, self.workload, config, compiled, self.plan,
                        self.max_spill_bytes)
