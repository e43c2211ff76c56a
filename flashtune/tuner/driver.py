"""``tune()``: search every bucket of a problem on one device and store the winners.

Per bucket: static pruning (space.static_check, recorded as ``invalid``), then the
pipeline (compile ahead -> resource check -> verify -> time) driven by an Optuna study, or
by a fixed enumeration for untimed (dry-run) measurers; at the end the top candidates are
re-measured and the winner crowned as the bucket's best in the database.

The cost model (prediction.py) PREDICTS every legal candidate's time on the bucket when it
knows the device's GPU: the default config is measured first, then the
``predicted_seeds`` best-predicted ones, then whatever the search proposes; with
``prune_predicted`` configs predicted that many times slower than the best prediction are
skipped (never recorded as failures: see search.py). Every recorded trial (except the
statically impossible configs, which never run) carries its prediction in
``predicted_ms``; Optuna trials also keep the model version (``predicted_model``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import optuna
from optuna.trial import TrialState

from flashtune import families
from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.dtypes import Dtypes
from flashtune.codegen.spec import DType, KernelConfig, Problem, ProblemBucket
from flashtune.db.records import TrialStatus, check_study
from flashtune.db.store import TuningStore
from flashtune.errors import InvalidConfig, TuningError
from flashtune.tuner.measure.base import Measurer
from flashtune.tuner.measure.evaluate import TrialResult
from flashtune.tuner.measure.factory import make_measurer
from flashtune.tuner.measure.kernels import CompilePool, KernelMeasurement
from flashtune.tuner.measure.workload import BatchHeads, Workload, make_workload
from flashtune.tuner.options import STATIC_REJECTIONS, BucketSummary, TuneOptions
from flashtune.tuner.pipeline import Limits, run_pipeline
from flashtune.tuner.results import ResultLog, warm_start_scores
from flashtune.tuner.search.encoding import SearchEncoding
from flashtune.tuner.search.lock import ProposalLock
from flashtune.tuner.search.prediction import BucketPrediction, Predictor, resolve_gpu
from flashtune.tuner.search.proposers import (
    CONFIG_ATTR,
    DUPLICATE_ATTR,
    OptunaSearch,
    Proposal,
    Proposer,
)
from flashtune.tuner.search.sampler import Prior, make_sampler, prior_of
from flashtune.tuner.search.selection import Scored, choose, remeasure
from flashtune.tuner.search.study import open_storage, study_name, templates_digest

log = logging.getLogger("flashtune.tuner")

#: Verification shape of dry runs: the emulator is slow, so a short sequence that still
#: spans two query tiles and ends in a partial one.
DRY_RUN_VERIFY_CAP = 72

optuna.logging.set_verbosity(optuna.logging.WARNING)


class Observer(Protocol):
    """Receives progress (the rich display implements it; None is silent)."""

    def bucket_started(self, summary: BucketSummary) -> None: ...

    def trial_done(self, summary: BucketSummary, result: TrialResult) -> None: ...

    def bucket_finished(self, summary: BucketSummary) -> None: ...


class _Silent:
    def bucket_started(self, summary: BucketSummary) -> None:
        pass

    def trial_done(self, summary: BucketSummary, result: TrialResult) -> None:
        pass

    def bucket_finished(self, summary: BucketSummary) -> None:
        pass


def _default(problem: Problem, arch: ArchSpec) -> KernelConfig | None:
    """The default config, measured first and the reference of the speed-up."""
    try:
        return families.of(problem).default_config(problem, arch)
    except InvalidConfig as exc:
        log.warning("no default config for %s on %s (%s): the speed-up is not reported",
                    problem.key(), arch.name, exc)
        return None


def buckets_of(problem: Problem, seqlens: Sequence[int],
               shape_classes: Sequence[str] = ()) -> list[ProblemBucket]:
    """The distinct buckets of ``seqlens`` (each of ``shape_classes``, checked by the
    problem's family; none: the bucket without a class), by length, then class."""
    family = families.of(problem)
    for shape_class in shape_classes:
        family.check_shape_class(problem, shape_class)
    found = {dataclasses.replace(problem.bucket(n, n), shape_class=c)
             for n in seqlens for c in (shape_classes or ("",))}
    return sorted(found, key=lambda b: (b.seqlen, b.shape_class))


def prepare_study(store: TuningStore, name: str, options: TuneOptions,
                  sampler: optuna.samplers.BaseSampler | None = None) -> optuna.Study:
    """Create (or, with resume, load) a study; refuse to silently reuse one with trials."""
    storage = open_storage(store.url, options.heartbeat)
    try:
        existing = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        existing = None
    if existing is not None and not options.resume:
        count = len(existing.get_trials(deepcopy=False))
        if count:
            raise TuningError(
                f"study {name} already has {count} trials in {store.where}; pass --resume to "
                "continue it, or --study NAME to start a fresh one (known failures are "
                "skipped either way)")
    return optuna.create_study(study_name=name, storage=storage, direction="maximize",
                               sampler=sampler, load_if_exists=True)


class Tuner:
    """Tunes buckets on one measurer against one database (see the module docstring)."""

    def __init__(self, measurer: Measurer, store: TuningStore,
                 options: TuneOptions | None = None, observer: Observer | None = None,
                 batch_heads: Sequence[BatchHeads] = (), verify_cap: int | None = None
                 ) -> None:
        options = options if options is not None else TuneOptions()
        self.measurer = measurer
        self.store = store
        self.options = options
        self.observer: Observer = observer or _Silent()
        self.batch_heads = tuple(batch_heads)
        self.verify_cap = verify_cap
        self.digest = templates_digest()
        self._deadline = (time.monotonic() + options.budget_s
                          if options.budget_s is not None else None)
        self._untimed_memo: dict[tuple[Problem, KernelConfig], TrialResult] = {}
        store.record_device(measurer.device)
        gpu = resolve_gpu(measurer.device, options.cost_model_gpu)
        self.predictor = Predictor(gpu) if gpu is not None else None
        if gpu is None:
            log.warning("the cost model does not know the GPU of %s: no predictions are "
                        "recorded, candidates are not ordered or pruned by prediction (pass "
                        "a cost-model GPU to predict for one of its table)",
                        measurer.device.name)

    def workload(self, bucket: ProblemBucket) -> Workload:
        if self.verify_cap is None:
            return make_workload(bucket, self.batch_heads)
        return make_workload(bucket, self.batch_heads, verify_cap=self.verify_cap)

    def study_name(self, bucket: ProblemBucket) -> str:
        return study_name(self.measurer.device.name, bucket, self.digest,
                          self.options.study_prefix, self.options.fixed)

    def prepare_study(self, bucket: ProblemBucket,
                      sampler: optuna.samplers.BaseSampler | None = None) -> optuna.Study:
        return prepare_study(self.store, self.study_name(bucket), self.options, sampler)

    def run(self, buckets: Sequence[ProblemBucket]) -> list[BucketSummary]:
        with CompilePool(self.measurer.compiler, self.options.compile_workers) as pool:
            return [self.tune_bucket(bucket, pool) for bucket in buckets]

    # ------------------------------------------------------------------ one bucket

    def tune_bucket(self, bucket: ProblemBucket, pool: CompilePool) -> BucketSummary:
        problem, arch = bucket.problem, self.measurer.arch
        workload = self.workload(bucket)
        encoding = SearchEncoding(problem, arch, self.options.fixed)
        candidates = encoding.candidates()
        timed = self.measurer.timed
        name = self.study_name(bucket) if timed else None
        results = ResultLog(self.store, self.measurer.device, bucket, name)
        summary = BucketSummary(bucket, name, len(candidates), timed=timed)
        summary.default = _default(problem, arch)
        past = results.past_outcomes()
        # Static rejections are counted, never recorded: the rules are a pure function of
        # (problem, config, arch), and a forward space of 10^5 points would put as many
        # rows per bucket into the database.
        summary.statuses[STATIC_REJECTIONS] = encoding.static_rejections()
        if not candidates:
            raise TuningError(f"no config of the search space fits {bucket.key()} on "
                              f"{arch.name}: every one fails the static check")
        first = [summary.default] if summary.default is not None else []
        pruned: dict[str, str] = {}
        if self.predictor is not None:
            summary.cost_model = self.predictor.label(bucket.problem)
            first, pruned = self._plan_by_prediction(workload, candidates, first)
            summary.pruned_by_model = len(pruned)
        self.observer.bucket_started(summary)

        def on_result(proposal: Proposal[KernelConfig], result: TrialResult) -> None:
            prediction = self._prediction(workload, result.config)
            results.record(result, prediction.time_ms if prediction else None)
            if prediction is not None and proposal.trial is not None:
                proposal.trial.set_user_attr("predicted_ms", prediction.time_ms)
                proposal.trial.set_user_attr("predicted_model", prediction.model_version)
            if prediction is not None and result.status in (TrialStatus.OK,
                                                            TrialStatus.VERIFIED_UNTIMED):
                summary.predicted.append(prediction)
            summary.measured += 1
            summary.statuses[result.status.value] += 1
            if result.tflops is not None and (summary.best_tflops is None
                                              or result.tflops > summary.best_tflops):
                summary.best_tflops, summary.best_config = result.tflops, result.config
            self.observer.trial_done(summary, result)

        if timed:
            opts = self.options
            prior = self._prior(encoding, workload, summary)
            study = self.prepare_study(
                bucket, make_sampler(opts.sampler, opts.seed, encoding.search_space, prior))
            if self.options.search:
                self._search(study, workload, encoding, results, first, pruned, pool,
                             on_result)
            if self.options.finalize:
                self._finalize(study, workload, results, summary)
        else:
            kept = [c for c in candidates if c.key() not in pruned]
            if self.predictor is not None:  # the rest in predicted order too
                ranked = [p.config for p in self.predictor.rank(workload, kept)]
                first = list(dict.fromkeys(first + ranked))
            self._dry_run(bucket, encoding, workload, past, first, pruned, pool, on_result)
        self.observer.bucket_finished(summary)
        return summary

    def _prior(self, encoding: SearchEncoding, workload: Workload, summary: BucketSummary
               ) -> Prior | None:
        """What guides the sampler before any measurement: another device's results of
        this bucket (--warm-start-from), else the cost model's predicted times."""
        source = self.options.warm_start_from
        if source is not None:
            scores, note = warm_start_scores(self.store, source, workload.bucket)
            summary.warm_start = note
            log.info("bucket %s: %s", workload.bucket.key(), note)
            return prior_of(encoding, scores) if scores else None
        if self.predictor is None:
            return None
        predicted = {p.config.key(): p.time_ms
                     for p in self.predictor.rank(workload, encoding.candidates())}
        return prior_of(encoding, predicted)

    def _prediction(self, workload: Workload, config: KernelConfig) -> BucketPrediction | None:
        return self.predictor.predict(workload, config) if self.predictor is not None else None

    def _plan_by_prediction(self, workload: Workload, candidates: list[KernelConfig],
                            first: list[KernelConfig]
                            ) -> tuple[list[KernelConfig], dict[str, str]]:
        """What to measure first (the default, then the best predicted) and what to skip
        (with --prune-predicted; never the default)."""
        assert self.predictor is not None
        opts = self.options
        default = first[0] if first else None
        pruned = ({} if opts.prune_predicted is None else
                  self.predictor.hopeless(workload, candidates, opts.prune_predicted, default))
        for reason in list(pruned.values())[:3]:
            log.info("bucket %s: %s", workload.bucket.key(), reason)
        ranked = [p.config for p in self.predictor.rank(workload, candidates)
                  if p.config not in first and p.config.key() not in pruned]
        return first + ranked[:opts.predicted_seeds], pruned

    def _search(self, study: optuna.Study, workload: Workload, encoding: SearchEncoding,
                results: ResultLog, first: Sequence[KernelConfig], pruned: dict[str, str],
                pool: CompilePool, on_result: _OnResult) -> None:
        opts = self.options
        lock = ProposalLock(self.store.url, study.study_name)
        proposer = OptunaSearch(study, encoding, lock, known_failed=results.known_failures(),
                                first=first, grid=opts.sampler == "grid", seed=opts.seed,
                                budget=opts.trials, model_pruned=pruned)
        try:
            self._drive(proposer, workload, pool, on_result)
        finally:
            proposer.close()
            lock.close()

    def _drive(self, proposer: Proposer[KernelConfig, TrialResult], workload: Workload,
               pool: CompilePool, on_result: _OnResult, budget: int | None = None) -> int:
        opts = self.options
        trials = opts.trials if budget is None else budget
        measurement = KernelMeasurement(self.measurer, workload, pool, opts.plan,
                                        opts.max_spill_bytes)
        return run_pipeline(measurement, proposer, Limits(trials, self._deadline),
                            depth=opts.pipeline_depth, on_result=on_result)

    def _dry_run(self, bucket: ProblemBucket, encoding: SearchEncoding, workload: Workload,
                 past: Mapping[str, TrialStatus], first: Sequence[KernelConfig],
                 pruned: dict[str, str], pool: CompilePool, on_result: _OnResult) -> int:
        """Verify untimed configs in ``first``-then-space order, skipping settled ones.

        A config's verdict does not depend on the bucket, so each is verified once (on the
        first bucket's verify shape), its verdict recorded for every bucket, and what is
        left of the budget goes to configs not yet verified. The walk is an exhaustive
        grid over a study of its own (``dry-run/<study name>``): like timed workers, dry
        runs sharing a database claim each config under the proposal lock, so two of them
        never verify the same config twice.
        """
        memo = self._untimed_memo
        settled = dict(past)
        # --trials N is the bucket's total, as in a timed study: a --resume continues an
        # earlier dry run (its configs settled in the database) up to N, not N more; a run
        # without --resume verifies N configs not verified yet.
        budget = max(0, self.options.trials - len(past)) if self.options.resume \
            else self.options.trials
        replayed = 0
        for config in [*first, *encoding.candidates()]:
            known = memo.get((workload.problem, config))
            if known is None or config.key() in settled or config.key() in pruned \
                    or replayed >= budget:
                continue
            settled[config.key()] = known.status
            on_result(Proposal(config), known)
            replayed += 1

        def remember(proposal: Proposal[KernelConfig], result: TrialResult) -> None:
            memo[(workload.problem, proposal.config)] = result
            on_result(proposal, result)

        name = check_study(f"dry-run/{self.study_name(bucket)}", "study name")
        study = optuna.create_study(study_name=name, direction="maximize",
                                    storage=open_storage(self.store.url, self.options.heartbeat),
                                    sampler=optuna.samplers.RandomSampler(seed=0),
                                    load_if_exists=True)
        lock = ProposalLock(self.store.url, name)
        proposer = OptunaSearch(study, encoding, lock, known_failed=settled, first=first,
                                grid=True, model_pruned=pruned)
        try:
            return replayed + self._drive(proposer, workload, pool, remember,
                                          budget=budget - replayed)
        finally:
            proposer.close()
            lock.close()

    # ------------------------------------------------------------------ the final pick

    def _finalize(self, study: optuna.Study, workload: Workload, results: ResultLog,
                  summary: BucketSummary) -> None:
        measured = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                    if DUPLICATE_ATTR not in t.user_attrs and CONFIG_ATTR in t.user_attrs]
        if not measured:
            log.warning("bucket %s: no candidate was timed successfully; nothing to choose",
                        workload.bucket.key())
            return
        ranked = sorted(measured, key=lambda t: (-(t.value or 0.0), t.number))
        configs = [KernelConfig.from_key(str(t.user_attrs[CONFIG_ATTR]))
                   for t in ranked[:self.options.final_top]]
        default = summary.default
        if default is not None and default not in configs and any(
                t.user_attrs[CONFIG_ATTR] == default.key() for t in measured):
            configs.append(default)
        opts = self.options
        again = remeasure(self.measurer, workload, configs, opts.final_plan, opts.final_rounds)
        scored = [Scored(r, r.config == default) for r in again if r.status is TrialStatus.OK]
        def predicted_ms(config: KernelConfig) -> float | None:
            prediction = self._prediction(workload, config)
            return prediction.time_ms if prediction is not None else None

        for r in again:
            if r.status is not TrialStatus.OK:
                results.record(r, predicted_ms(r.config))
        if not scored:
            log.warning("bucket %s: every finalist failed when re-measured",
                        workload.bucket.key())
            return
        winner = choose(workload, scored, opts.tie_tolerance)
        for s in scored:
            if s is not winner:
                results.record(s.result, predicted_ms(s.config))
        results.crown(winner.result, predicted_ms(winner.config))
        summary.winner, summary.winner_tflops = winner.config, winner.tflops
        summary.default_tflops = next((s.tflops for s in scored if s.is_default), None)
        study.set_user_attr("winner", winner.config.key())
        study.set_user_attr("winner_tflops", winner.tflops)
        if summary.default_tflops is not None and default is not None:
            study.set_user_attr("default", default.key())
            study.set_user_attr("default_tflops", summary.default_tflops)


class _OnResult(Protocol):
    def __call__(self, proposal: Proposal[KernelConfig], result: TrialResult) -> None: ...


def tune(head_dim: int, dtype: DType | Dtypes | str = "bf16", causal: bool = False,
         seqlens: Sequence[int] = (1024, 4096, 16384), *,
         measurer: Measurer | None = None, dry_run: bool = False,
         arch: str = "sm_90", db: str | None = None, options: TuneOptions | None = None,
         batch_heads: Sequence[BatchHeads] = (), observer: Observer | None = None,
         verify_cap: int | None = None, op: str = "fwd", features: Sequence[str] = (),
         shape_classes: Sequence[str] = ()) -> list[BucketSummary]:
    """Tune the ``op`` family's kernel (default: the forward) of (head_dim, dtype, causal)
    with the attention ``features`` compiled in (codegen.spec.FEATURES; their own tuning
    keys) for each bucket of ``seqlens`` (and each of ``shape_classes``, for a family that
    tunes classes of call shapes apart: decoding's ``g8q4p16``). ``dtype``: every operand's
    type, or a ``Dtypes`` of Q, K/V and O (the FP8 forward's e4m3 inputs with a bf16 O).

    Measures on the current GPU (TuningError without one), or with ``dry_run`` compiles for
    ``arch`` and verifies in the CPU emulator, untimed; ``measurer`` overrides both (see
    flashtune.tuner.measure.base). ``db`` is the database URL or path (default: the FLASHTUNE_DB
    knob). Returns one summary per bucket; timed winners become the buckets' best in the
    database, which the runtime dispatcher serves.
    """
    types = ({"dtype": dtype.q.value, "kv_dtype": dtype.kv.value, "o_dtype": dtype.o.value}
             if isinstance(dtype, Dtypes) else {"dtype": getattr(dtype, "value", dtype)})
    problem = Problem.from_dict({"head_dim": head_dim, **types, "causal": causal, "op": op,
                                 **dict.fromkeys(features, True)})
    # an unknown op or a feature the family lacks fails here, before any study is opened
    families.of(problem).check_problem(problem)
    if measurer is None:
        measurer = make_measurer("dry-run" if dry_run else "cuda", arch=arch)
    if verify_cap is None and not measurer.timed:  # the emulator: keep verification small
        verify_cap = DRY_RUN_VERIFY_CAP
    with TuningStore(db) as store:
        tuner = Tuner(measurer, store, options, observer, batch_heads, verify_cap)
        return tuner.run(buckets_of(problem, seqlens, shape_classes))
