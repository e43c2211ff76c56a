"""Proposers: which config to measure next.

``OptunaSearch`` asks an Optuna study (TPE, GP, random, or an exhaustive grid over the legal
candidates) and filters each proposal before anything is compiled:

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

``EnumerationSearch`` (dry runs) walks the legal candidates in a fixed order, default first.
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
from typing import Protocol

import optuna
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.trial import FrozenTrial, TrialState

from flashtune.codegen.spec import KernelConfig
from flashtune.db.records import TrialStatus, this_host
from flashtune.tuner.measure.evaluate import TrialResult
from flashtune.tuner.search.encoding import SearchEncoding
from flashtune.tuner.search.study import quiet_optuna

log = logging.getLogger("flashtune.tuner")

OWNER_ATTR = "flashtune_owner"
CONFIG_ATTR = "config"
STATUS_ATTR = "status"
DUPLICATE_ATTR = "duplicate_of"
MODEL_PRUNED_ATTR = "model_pruned"


@dataclass(frozen=True)
class Proposal:
    """A config accepted for measurement, with its Optuna trial (None for enumerations)."""

    config: KernelConfig
    trial: optuna.Trial | None = None


class Proposer(Protocol):
    def propose(self) -> Proposal | None:
        """The next config to measure, or None when the space is exhausted."""
        ...

    def tell(self, proposal: Proposal, result: TrialResult) -> None: ...

    def abandon(self, proposal: Proposal) -> None:
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


class OptunaSearch:
    """Proposals from an Optuna study, filtered as the module docstring says."""

    def __init__(self, study: optuna.Study, encoding: SearchEncoding,
                 lock: AbstractContextManager[object], *,
                 known_failed: Mapping[str, TrialStatus], first: Sequence[KernelConfig] = (),
                 grid: bool = False, seed: int | None = None, futile_limit: int = 4,
                 budget: int | None = None, model_pruned: Mapping[str, str] | None = None
                 ) -> None:
        self.study = study
        self.budget = budget
        self.encoding = encoding
        self.lock = lock
        self.known_failed = dict(known_failed)
        self.grid = grid
        self.futile_limit = futile_limit
        self.model_pruned = dict(model_pruned or {})
        self.candidates = [c for c in encoding.candidates()
                           if c.key() not in self.model_pruned]
        self._rng = random.Random(seed)
        self._owner = owner_id()
        self._first = [c for c in first if c in self.candidates]
        self._dists = encoding.distributions()
        # Study wraps its RDBStorage in a cache that passes heartbeats through.
        storage = study._storage
        self._storage = storage if isinstance(storage, BaseHeartbeat) else None
        interval = self._storage.get_heartbeat_interval() if self._storage else None
        self._next_reap = 0.0
        self._heartbeat = (HeartbeatThread(self._storage, interval)
                           if self._storage is not None and interval else None)

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.close()

    # ------------------------------------------------------------ proposing

    def propose(self) -> Proposal | None:
        futile = 0
        while True:
            with self.lock:
                self._reap_dead_trials()
                settled = self._settled()
                untried = [c for c in self.candidates if c.key() not in settled]
                if not untried or self._budget_spent(settled):
                    return None
                forced = self._pop_first(untried)
                if forced is None and (self.grid or futile >= self.futile_limit):
                    forced = untried[0] if self.grid else self._rng.choice(untried)
                if forced is not None:
                    self.study.enqueue_trial(self.encoding.encode(forced))
                    futile = 0
                with quiet_optuna():
                    trial = self.study.ask(self._dists)
                proposal = self._screen(trial, settled)
            if proposal is not None:
                return proposal
            futile += 1

    def _budget_spent(self, settled: Mapping[str, FrozenTrial | TrialStatus]) -> bool:
        """The budget counts every config measured (or being measured) in the study, by
        any worker and any earlier run of it."""
        if self.budget is None:
            return False
        return sum(isinstance(v, FrozenTrial) for v in settled.values()) >= self.budget

    def _pop_first(self, untried: list[KernelConfig]) -> KernelConfig | None:
        while self._first:
            head = self._first.pop(0)
            if head in untried:
                return head
        return None

    def _settled(self) -> dict[str, FrozenTrial | TrialStatus]:
        """Config key -> its first trial in the study (measured, failed or running), or the
        status it failed with in the database."""
        out: dict[str, FrozenTrial | TrialStatus] = dict(self.known_failed)
        states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
        for t in self.study.get_trials(deepcopy=False, states=states):
            key = t.user_attrs.get(CONFIG_ATTR)
            if key is not None and DUPLICATE_ATTR not in t.user_attrs \
                    and MODEL_PRUNED_ATTR not in t.user_attrs:
                out.setdefault(key, t)
        return out

    def _screen(self, trial: optuna.Trial, settled: Mapping[str, FrozenTrial | TrialStatus]
                ) -> Proposal | None:
        """Accept the trial's config, or tell Optuna why it is not measured (see module)."""
        trial.storage.set_trial_system_attr(trial._trial_id, OWNER_ATTR, self._owner)
        decoded = self.encoding.decode(trial.params)
        if isinstance(decoded, str):
            trial.set_user_attr(STATUS_ATTR, TrialStatus.INVALID.value)
            trial.set_user_attr("reason", decoded[:500])
            self.study.tell(trial, state=TrialState.PRUNED)
            return None
        key = decoded.key()
        trial.set_user_attr(CONFIG_ATTR, key)
        if key in self.model_pruned:
            trial.set_user_attr(MODEL_PRUNED_ATTR, self.model_pruned[key][:500])
            self.study.tell(trial, state=TrialState.PRUNED)
            return None
        first = settled.get(key)
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
        for name, value in decoded.to_dict().items():
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

    def tell(self, proposal: Proposal, result: TrialResult) -> None:
        trial = proposal.trial
        assert trial is not None
        trial.set_user_attr(STATUS_ATTR, result.status.value)
        if result.error:
            trial.set_user_attr("error", result.error[:2000])
        if result.registers is not None:
            trial.set_user_attr("registers", result.registers)
        if result.spill_bytes is not None:
            trial.set_user_attr("spill_bytes", result.spill_bytes)
        if result.status is TrialStatus.OK:
            assert result.tflops is not None and result.median_ms is not None
            trial.set_user_attr("median_ms", result.median_ms)
            self.study.tell(trial, result.tflops)
        else:
            self.study.tell(trial, state=TrialState.PRUNED)
        if result.status.failed:
            self.known_failed[proposal.config.key()] = result.status
        self._release(trial)

    def abandon(self, proposal: Proposal) -> None:
        trial = proposal.trial
        assert trial is not None
        trial.set_user_attr(STATUS_ATTR, "interrupted")
        self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        self._release(trial)

    def _release(self, trial: optuna.Trial) -> None:
        if self._heartbeat is not None:
            self._heartbeat.discard(trial._trial_id)


class EnumerationSearch:
    """Legal candidates in a fixed order (``first`` ones first), skipping settled ones."""

    def __init__(self, candidates: Sequence[KernelConfig], *, skip: Mapping[str, TrialStatus],
                 first: Sequence[KernelConfig] = ()) -> None:
        ordered = [c for c in first if c in candidates]
        ordered += [c for c in candidates if c not in ordered]
        self._queue = [c for c in ordered if c.key() not in skip]

    def pending(self) -> list[KernelConfig]:
        """The configs still to propose, in order."""
        return list(self._queue)

    def discard(self, config: KernelConfig) -> None:
        self._queue.remove(config)

    def propose(self) -> Proposal | None:
        return Proposal(self._queue.pop(0)) if self._queue else None

    def tell(self, proposal: Proposal, result: TrialResult) -> None:
        pass

    def abandon(self, proposal: Proposal) -> None:
        pass
