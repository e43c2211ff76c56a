"""Proposers: which config to measure next.

``OptunaSearch`` asks an Optuna study (the guided sampler by default, or TPE, GP, random,
or an exhaustive grid over the legal candidates) and filters each proposal before anything
is compiled. It is generic over the configs a space's points name (a kernel family's
``KernelConfig``, a landscape's rows) through a ``Candidates`` view of the space:

- an impossible combination (static check) is told PRUNED: free, and TPE learns from it;
- a config that failed before with the same kernel source (database) is told PRUNED;
- a config already measured in the study is told COMPLETE with that measurement, so the
  sampler sees consistent values and nothing is measured twice;
- a config another worker (or this one, in its compile-ahead queue) is measuring is told
  FAIL (no information) and skipped;
- a config the cost model predicts hopeless (``--prune-predicted``) is told PRUNED and marked
  ``model_pruned``. It is never written to the tuning database: a prediction is not a
  failure of the config, and a failure there would be skipped for good; ``_settled``
  ignores these trials, so a later run without pruning (or ``--resume``) can measure them.

The budget (``--trials``) is the study's: configs measured by all workers and earlier runs
count, so ``--resume`` after an interruption completes the original budget.

These checks run under the study's ``ProposalLock``, so two workers can never both accept a
config. When the sampler keeps proposing configs that are settled, the search enqueues an
untried legal candidate instead (and stops once none is left).

The study's trials are read incrementally (``TrialScan``): a proposal costs O(new trials),
not O(all trials), so a long replayed study stays cheap.

Dry runs use the same search as an exhaustive grid in a fixed order (default first) over a
study of their own, so concurrent dry runs share claims too.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import optuna
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.trial import FrozenTrial, TrialState

from flashtune.db.records import TrialStatus, this_host
from flashtune.tuner.search.space import Candidates
from flashtune.tuner.search.study import (
    CONFIG_ATTR,
    DUPLICATE_ATTR,
    MODEL_PRUNED_ATTR,
    OWNER_ATTR,
    STATUS_ATTR,
    TrialScan,
    quiet_optuna,
)

log = logging.getLogger("flashtune.tuner")

__all__ = ["CONFIG_ATTR", "DUPLICATE_ATTR", "MODEL_PRUNED_ATTR", "OWNER_ATTR", "STATUS_ATTR",
           "OptunaSearch", "Outcome", "Proposal", "Proposer", "owner_id"]

C = TypeVar("C")
R_contra = TypeVar("R_contra", contravariant=True)


@dataclass(frozen=True)
class Proposal(Generic[C]):
    """A config accepted for measurement, with its Optuna trial (None for enumerations)."""

    config: C
    trial: optuna.Trial | None = None


class Outcome(Protocol):
    """What a search is told about a measured config."""

    @property
    def status(self) -> TrialStatus: ...

    @property
    def objective(self) -> float | None:
        """The value told to the study (None unless the status is ok)."""
        ...

    def attrs(self) -> Mapping[str, float | int | str]:
        """Further facts recorded on the trial (errors, resources, timings)."""
        ...


class Proposer(Protocol[C, R_contra]):
    def propose(self) -> Proposal[C] | None:
        """The next config to measure, or None when the space is exhausted."""
        ...

    def tell(self, proposal: Proposal[C], result: R_contra) -> None: ...

    def abandon(self, proposal: Proposal[C]) -> None:
        """The proposal will not be measured (interrupted); free it for others."""
        ...


def owner_id() -> str:
    return f"{this_host()}:{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HeartbeatThread:
    """Records a heartbeat for every trial this worker holds, every ``interval`` seconds."""

    def __init__(self, storage: BaseHeartbeat, interval: float) -> None:
        self._storage = storage
        self._interval = interval
        self._trials: set[int] = set()
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flashtune-heartbeat",
                                        daemon=True)
        self._thread.start()

    def add(self, trial_id: int) -> None:
        with self._guard:
            self._trials.add(trial_id)
        self._storage.record_heartbeat(trial_id)

    def discard(self, trial_id: int) -> None:
        with self._guard:
            self._trials.discard(trial_id)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._guard:
                held = sorted(self._trials)
            for trial_id in held:
                try:
                    self._storage.record_heartbeat(trial_id)
                except Exception as exc:  # a missed beat only risks a stale mark later
                    log.warning("heartbeat of trial %d failed: %s", trial_id, exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class _Settled:
    """Config key -> its first trial in the study (measured, failed or running), or the
    status it failed with in the database; kept up to date incrementally."""

    def __init__(self, keys: Sequence[str], known_failed: Mapping[str, TrialStatus]) -> None:
        self.known_failed = dict(known_failed)
        self.finished: dict[str, FrozenTrial] = {}
        self.running: dict[str, FrozenTrial] = {}
        self._untried = dict.fromkeys(k for k in keys if k not in self.known_failed)
        self._scan = TrialScan()

    def refresh(self, study: optuna.Study) -> None:
        finished, unfinished = self._scan.update(study)
        for t in finished:
            key = self._counted_key(t)
            if key is not None and t.state in (TrialState.COMPLETE, TrialState.PRUNED):
                first = self.finished.get(key)
                if first is None or t.number < first.number:
                    self.finished[key] = t
                self._untried.pop(key, None)
        self.running = {}
        for t in unfinished:
            key = self._counted_key(t)
            if key is not None and t.state is TrialState.RUNNING:
                self.running.setdefault(key, t)

    @staticmethod
    def _counted_key(t: FrozenTrial) -> str | None:
        key = t.user_attrs.get(CONFIG_ATTR)
        if key is None or DUPLICATE_ATTR in t.user_attrs or MODEL_PRUNED_ATTR in t.user_attrs:
            return None
        return str(key)

    def get(self, key: str) -> FrozenTrial | TrialStatus | None:
        failed = self.known_failed.get(key)
        if failed is not None:
            return failed
        return self.finished.get(key) or self.running.get(key)

    def fail(self, key: str, status: TrialStatus) -> None:
        self.known_failed[key] = status
        self._untried.pop(key, None)

    def any_untried(self) -> bool:
        return len(self._untried) > sum(k in self._untried for k in self.running)

    def untried(self) -> list[str]:
        return [k for k in self._untried if k not in self.running]

    def measured(self) -> int:
        """Configs measured or being measured in the study (failures included)."""
        return len(self.finished) + sum(k not in self.finished for k in self.running)


class OptunaSearch(Generic[C]):
    """Proposals from an Optuna study, filtered as the module docstring says."""

    def __init__(self, study: optuna.Study, candidates: Candidates[C],
                 lock: AbstractContextManager[object], *,
                 known_failed: Mapping[str, TrialStatus], first: Sequence[C] = (),
                 grid: bool = False, seed: int | None = None, futile_limit: int = 4,
                 budget: int | None = None, model_pruned: Mapping[str, str] | None = None,
                 record_values: bool = True) -> None:
        self.study = study
        self.budget = budget
        self.encoding = candidates
        self.lock = lock
        self.grid = grid
        self.futile_limit = futile_limit
        self.model_pruned = dict(model_pruned or {})
        self.record_values = record_values
        self.by_key: dict[str, C] = {candidates.key(c): c for c in candidates.configs
                                     if candidates.key(c) not in self.model_pruned}
        self.candidates = list(self.by_key.values())
        self._settled = _Settled(list(self.by_key), known_failed)
        self._rng = random.Random(seed)
        self._owner = owner_id()
        self._first = [candidates.key(c) for c in first if candidates.key(c) in self.by_key]
        self._dists = candidates.distributions()
        # Study wraps its RDBStorage in a cache that passes heartbeats through.
        storage = study._storage
        self._storage = storage if isinstance(storage, BaseHeartbeat) else None
        interval = self._storage.get_heartbeat_interval() if self._storage else None
        self._next_reap = 0.0
        self._heartbeat = (HeartbeatThread(self._storage, interval)
                           if self._storage is not None and interval else None)

    @property
    def known_failed(self) -> dict[str, TrialStatus]:
        return self._settled.known_failed

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.close()

    # ------------------------------------------------------------ proposing

    def propose(self) -> Proposal[C] | None:
        futile = 0
        while True:
            with self.lock:
                self._reap_dead_trials()
                self._settled.refresh(self.study)
                if not self._settled.any_untried() or self._budget_spent():
                    return None
                forced = self._pop_first()
                if forced is None and (self.grid or futile >= self.futile_limit):
                    untried = self._settled.untried()
                    forced = untried[0] if self.grid else self._rng.choice(untried)
                if forced is not None:
                    self.study.enqueue_trial(self.encoding.encode(self.by_key[forced]))
                    futile = 0
                with quiet_optuna():
                    trial = self.study.ask(self._dists)
                proposal = self._screen(trial)
            if proposal is not None:
                return proposal
            futile += 1

    def _budget_spent(self) -> bool:
        """The budget counts every config measured (or being measured) in the study, by
        any worker and any earlier run of it."""
        return self.budget is not None and self._settled.measured() >= self.budget

    def _pop_first(self) -> str | None:
        while self._first:
            head = self._first.pop(0)
            if self._settled.get(head) is None:
                return head
        return None

    def _screen(self, trial: optuna.Trial) -> Proposal[C] | None:
        """Accept the trial's config, or tell Optuna why it is not measured (see module)."""
        if self._storage is not None:  # who holds it, for reaping a dead worker's trials
            trial.storage.set_trial_system_attr(trial._trial_id, OWNER_ATTR, self._owner)
        decoded = self.encoding.decode(trial.params)
        if isinstance(decoded, str):
            trial.set_user_attr(STATUS_ATTR, TrialStatus.INVALID.value)
            trial.set_user_attr("reason", decoded[:500])
            self.study.tell(trial, state=TrialState.PRUNED)
            return None
        key = self.encoding.key(decoded)
        trial.set_user_attr(CONFIG_ATTR, key)
        if key in self.model_pruned:
            trial.set_user_attr(MODEL_PRUNED_ATTR, self.model_pruned[key][:500])
            self.study.tell(trial, state=TrialState.PRUNED)
            return None
        first = self._settled.get(key)
        if isinstance(first, TrialStatus):
            trial.set_user_attr(DUPLICATE_ATTR, "database")
            trial.set_user_attr(STATUS_ATTR, first.value)
            self.study.tell(trial, state=TrialState.PRUNED)
            return None
        if first is not None:
            trial.set_user_attr(DUPLICATE_ATTR, first.number)
            if first.state is TrialState.COMPLETE:
                self.study.tell(trial, first.values)
            elif first.state is TrialState.PRUNED:
                self.study.tell(trial, state=TrialState.PRUNED)
            else:  # running elsewhere: no information yet
                self.study.tell(trial, state=TrialState.FAIL)
            return None
        if self.record_values:  # readable values beside Optuna's indices (report, dashboard)
            for name, value in self.encoding.domain.point(decoded).items():
                trial.set_user_attr(name, value)
        if self._heartbeat is not None:
            self._heartbeat.add(trial._trial_id)
        return Proposal(decoded, trial)

    def _reap_dead_trials(self) -> None:
        """Fail running trials whose worker is gone: stale heartbeat, or a dead local pid.

        Checked at most once per heartbeat interval (it reads every running trial)."""
        if self._storage is None or time.monotonic() < self._next_reap:
            return
        self._next_reap = time.monotonic() + (self._storage.get_heartbeat_interval() or 0)
        with quiet_optuna():
            optuna.storages.fail_stale_trials(self.study)
        host = this_host()
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            owner = str(t.system_attrs.get(OWNER_ATTR, ""))
            owner_host, _, pid = owner.rpartition(":")
            if owner_host == host and pid.isdigit() and owner != self._owner \
                    and not _pid_alive(int(pid)):
                try:
                    self.study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
                    log.info("trial %d of a dead worker (%s) marked failed", t.number, owner)
                except optuna.exceptions.UpdateFinishedTrialError:
                    pass

    # ------------------------------------------------------------ results

    def tell(self, proposal: Proposal[C], result: Outcome) -> None:
        trial = proposal.trial
        assert trial is not None
        trial.set_user_attr(STATUS_ATTR, result.status.value)
        for name, value in result.attrs().items():
            trial.set_user_attr(name, value)
        if result.status is TrialStatus.OK:
            assert result.objective is not None
            self.study.tell(trial, result.objective)
        else:
            self.study.tell(trial, state=TrialState.PRUNED)
        if result.status.failed:
            self._settled.fail(self.encoding.key(proposal.config), result.status)
        self._release(trial)

    def abandon(self, proposal: Proposal[C]) -> None:
        trial = proposal.trial
        assert trial is not None
        trial.set_user_attr(STATUS_ATTR, "interrupted")
        self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        self._release(trial)

    def _release(self, trial: optuna.Trial) -> None:
        if self._heartbeat is not None:
            self._heartbeat.discard(trial._trial_id)
