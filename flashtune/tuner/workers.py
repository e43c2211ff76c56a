"""Several tuning workers on one study: one process per GPU, or one per machine.

A worker is ``python -m flashtune.tuner.workers SPEC`` where SPEC is the JSON of a
``WorkerSpec``: the problem, the options and how to build the measurer (``module:function``
plus JSON keyword arguments); the database URL, which may hold a PostgreSQL password, comes
in the worker's environment (``WORKER_DB_ENV``), never on its command line, which every
user of the machine can read (``ps``, /proc/PID/cmdline; a process's environment is its
owner's only). Workers share the study through the database and never
measure the same config twice (search.py); ``run_workers`` starts N of them (GPU i gets
``CUDA_VISIBLE_DEVICES=i``) with the search phase only, waits, and then runs the final
re-measurement once, in one more worker. On other machines, run ``flashtune tune --resume``
with the same PostgreSQL ``--db`` URL.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import optuna

from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.spec import Problem
from flashtune.errors import TuningError
from flashtune.toolchain.processes import sigint_held, tie_worker_to_parent
from flashtune.tuner.interrupt import checkpoint
from flashtune.tuner.measure.base import Measurer, TimingPlan
from flashtune.tuner.measure.factory import make_measurer
from flashtune.tuner.measure.workload import BatchHeads
from flashtune.tuner.options import BucketSummary, TuneOptions
from flashtune.tuner.search.study import Heartbeat

if TYPE_CHECKING:
    from flashtune.tuner.driver import Observer

#: The worker flag that ties a worker's life to its parent's (``start_worker`` passes it).
_TIED = "--die-with-parent"
#: The environment variable through which ``start_worker`` hands a worker its database URL
#: (the spec on the command line has an empty ``db``); the worker removes it from its own
#: environment, so the processes it starts (compilers, emulators) do not inherit it.
WORKER_DB_ENV = "FLASHTUNE_WORKER_DB"


def options_to_json(options: TuneOptions) -> dict[str, Any]:
    return dataclasses.asdict(options)


def options_from_json(data: Mapping[str, Any]) -> TuneOptions:
    values = dict(data)
    for name in ("plan", "final_plan"):
        values[name] = TimingPlan(**values[name])
    values["heartbeat"] = Heartbeat(**values["heartbeat"])
    values["fixed"] = tuple((str(name), value) for name, value in values.get("fixed", ()))
    return TuneOptions(**values)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs (JSON round trip: ``to_json``/``from_json``)."""

    head_dim: int
    dtype: str
    causal: bool
    op: str
    seqlens: tuple[int, ...]
    db: str
    measurer: str
    measurer_options: dict[str, Any] = field(default_factory=dict)
    batch_heads: tuple[tuple[int, int], ...] = ()
    options: TuneOptions = TuneOptions()
    verify_cap: int | None = None
    features: tuple[str, ...] = ()
    shape_classes: tuple[str, ...] = ()
    #: K/V's and O's types where they differ from ``dtype`` (Q's): the FP8 forward.
    kv_dtype: str | None = None
    o_dtype: str | None = None

    @property
    def problem(self) -> Problem:
        """The problem the worker tunes (its buckets are this problem's)."""
        return Problem.from_dict({"head_dim": self.head_dim, "dtype": self.dtype,
                                  "kv_dtype": self.kv_dtype, "o_dtype": self.o_dtype,
                                  "causal": self.causal, "op": self.op,
                                  **dict.fromkeys(self.features, True)})

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["options"] = options_to_json(self.options)
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        data = json.loads(text)
        data["options"] = options_from_json(data["options"])
        data["seqlens"] = tuple(data["seqlens"])
        data["batch_heads"] = tuple(tuple(bh) for bh in data["batch_heads"])
        data["features"] = tuple(data.get("features", ()))
        data["shape_classes"] = tuple(data.get("shape_classes", ()))
        return cls(**data)

    def with_options(self, **changes: Any) -> WorkerSpec:
        return dataclasses.replace(self, options=dataclasses.replace(self.options, **changes))

    def make_measurer(self) -> Measurer:
        """The worker's measurer (``measure.factory.make_measurer``: a name such as
        ``cuda``, or ``module:function`` with ``measurer_options``)."""
        return make_measurer(self.measurer, options=self.measurer_options)


def run_spec(spec: WorkerSpec, observer: Observer | None = None) -> list[BucketSummary]:
    """Run one worker in this process."""
    from flashtune.tuner.driver import tune

    return tune(spec.head_dim, spec.problem.dtypes, spec.causal, spec.seqlens, op=spec.op,
                measurer=spec.make_measurer(), db=spec.db, options=spec.options,
                batch_heads=[BatchHeads(b, h) for b, h in spec.batch_heads],
                observer=observer, verify_cap=spec.verify_cap, features=spec.features,
                shape_classes=spec.shape_classes)


def start_worker(spec: WorkerSpec, env: Mapping[str, str] | None = None
                 ) -> subprocess.Popen[bytes]:
    """Start ``python -m flashtune.tuner.workers --die-with-parent SPEC`` (stdout/stderr
    inherited): the worker is killed when this process dies. The database URL goes in the
    worker's environment (``WORKER_DB_ENV``), not in SPEC on its command line."""
    hidden = dataclasses.replace(spec, db="")
    with sigint_held():  # a Ctrl-C while it imports is the parent's (tie_worker_to_parent)
        return subprocess.Popen([sys.executable, "-m", "flashtune.tuner.workers", _TIED,
                                 hidden.to_json()],
                                env={**os.environ, **(env or {}), WORKER_DB_ENV: spec.db})


def run_workers(spec: WorkerSpec, count: int, *, gpus: Sequence[int] | None = None,
                env: Mapping[str, str] | None = None, poll: Callable[[], None] | None = None,
                poll_interval_s: float = 1.0) -> None:
    """Search with ``count`` workers at once, then finalize once (see the module docstring).

    ``gpus`` (default: none set) assigns ``CUDA_VISIBLE_DEVICES`` round robin; ``poll`` is
    called while waiting (e.g. to refresh a progress display from the database).
    """
    if count < 1:
        raise TuningError(f"workers={count} must be >= 1")
    from flashtune.db.store import TuningStore
    from flashtune.tuner.search.study import open_storage

    # create the database and Optuna's tables once, before the workers race to
    with TuningStore(spec.db):
        open_storage(spec.db).engine.dispose()
    search = spec.with_options(resume=True, finalize=False)
    procs = []
    for i in range(count):
        worker_env = dict(env or {})
        if gpus:
            worker_env["CUDA_VISIBLE_DEVICES"] = str(gpus[i % len(gpus)])
        # distinct seeds: identical samplers would keep proposing the same configs
        seed = None if spec.options.seed is None else spec.options.seed + i
        procs.append(start_worker(search.with_options(seed=seed), worker_env))
    _wait(procs, poll, poll_interval_s)
    if spec.options.finalize:
        final_env = dict(env or {})
        if gpus:
            final_env["CUDA_VISIBLE_DEVICES"] = str(gpus[0])
        _wait([start_worker(spec.with_options(resume=True, search=False), final_env)], poll,
              poll_interval_s)


def _wait(procs: list[subprocess.Popen[bytes]], poll: Callable[[], None] | None,
          interval: float) -> None:
    try:
        while any(p.poll() is None for p in procs):
            checkpoint()
            if poll is not None:
                poll()
            time.sleep(interval)
    except BaseException:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait()
        raise
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise TuningError(f"tuning worker(s) failed (index, exit code): {failed}; results so "
                          "far are kept, rerun with --resume to continue")


def tune_parallel(spec: WorkerSpec, count: int, *, device: str, arch: ArchSpec,
                  gpus: Sequence[int] | None = None, env: Mapping[str, str] | None = None,
                  observer: Observer | None = None, poll_interval_s: float = 1.0
                  ) -> list[BucketSummary]:
    """``run_workers`` for a problem on ``device``: creates (or, with resume, checks) the
    studies first, follows progress in the database for ``observer``, and returns each
    bucket's summary with the winner stored as its best."""
    from flashtune.codegen.spec import KernelConfig
    from flashtune.db.store import TuningStore
    from flashtune.tuner.driver import buckets_of, prepare_study
    from flashtune.tuner.results import summarize_records
    from flashtune.tuner.search.encoding import SearchEncoding
    from flashtune.tuner.search.study import open_storage, study_name, templates_digest

    problem = spec.problem
    with TuningStore(spec.db or None) as store:
        url = store.url.render_as_string(hide_password=False)
        buckets = buckets_of(problem, spec.seqlens, spec.shape_classes)
        options = spec.options
        names = [study_name(device, b, templates_digest(), options.study_prefix,
                            options.fixed) for b in buckets]
        for name in names:  # create or check the studies once, before the workers start
            prepare_study(store, name, options)
        encoding = SearchEncoding(problem, arch, options.fixed)
        candidates, static = len(encoding.candidates()), encoding.static_rejections()
        summaries = [BucketSummary(b, n, candidates) for b, n in zip(buckets, names,
                                                                     strict=True)]
        for s in summaries:
            if observer is not None:
                observer.bucket_started(s)

        def poll() -> None:
            for s in summaries:
                summarize_records(s, store.trials(device=device, problem=problem.key(),
                                                  seqlen=s.bucket.seqlen,
                                                  shape_class=s.bucket.shape_class), static)
                if observer is not None:
                    observer.bucket_finished(s)

        shared = dataclasses.replace(spec, db=url, options=dataclasses.replace(
            options, resume=True))
        run_workers(shared, count, gpus=gpus, env=env, poll=poll,
                    poll_interval_s=poll_interval_s)
        poll()
        storage = open_storage(url, options.heartbeat)
        for s, name in zip(summaries, names, strict=True):
            best = store.best(device, problem.key(), s.bucket.seqlen, s.bucket.shape_class)
            if best is not None:
                s.winner = KernelConfig.from_key(best.config.key)
                s.winner_tflops = best.trial.tflops
            attrs = optuna.load_study(study_name=name, storage=storage).user_attrs
            if "default" in attrs and "default_tflops" in attrs:
                s.default = KernelConfig.from_key(str(attrs["default"]))
                s.default_tflops = float(attrs["default_tflops"])
        storage.engine.dispose()
    return summaries


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    tied = args[:1] == [_TIED]
    if tied:
        args = args[1:]
    if len(args) != 1:
        print(f"usage: python -m flashtune.tuner.workers [{_TIED}] SPEC_JSON", file=sys.stderr)
        return 2
    if tied:
        # A killed `flashtune tune --workers N` leaves no workers measuring on (the trial in
        # flight is reaped and measured again by --resume); on Ctrl-C run_workers terminates
        # them and prints the one --resume hint, with no traceback from a worker.
        tie_worker_to_parent()
    spec = WorkerSpec.from_json(args[0])
    db = os.environ.pop(WORKER_DB_ENV, None)
    run_spec(spec if db is None else dataclasses.replace(spec, db=db))
    return 0


if __name__ == "__main__":
    sys.exit(main())
