"""Optuna's GPSampler and CMA-ES told about illegal and failed points the way they accept.

Both read only COMPLETE trials: the search loop's answer to an illegal point (a PRUNED
trial) is invisible to them, so on a space with illegal combinations they ask for the same
impossible points again and again and the loop falls back to random proposals. Here each
runs in a private study of its own (its *shadow*), where every proposal is settled in a
form it reads before the search loop sees anything:

- GPSampler (``constraints``): an illegal or failed point is a COMPLETE trial with the
  worst objective seen so far and the constraint ``legal`` at 1 (0 for a measured point),
  which its constrained acquisition (a feasibility model) learns from; Optuna 5's
  ``Trial.set_constraint``.
- CMA-ES (``penalty``): an illegal or failed point is a COMPLETE trial with the worst
  objective seen so far (CMA-ES has no constraint model; ``consider_pruned_trials`` needs
  intermediate values, which the loop has none of).

An illegal proposal is settled in the shadow at once and the sampler asked again (up to
``MAX_ASKS`` times, then the decision is left to the loop's random fallback), so the loop
only ever receives legal points; a measured result is copied into the shadow when the loop
reports it. Until the first success there is no worst objective: illegal points are then
told as failed (FAIL, which neither sampler reads).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import optuna
from optuna.distributions import BaseDistribution
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from flashtune.tuner.search.sampler import SpaceSampler
from flashtune.tuner.search.space import SearchSpace
from flashtune.tuner.search.study import TrialScan

#: Proposals of one decision that may be illegal before the loop's fallback takes over.
MAX_ASKS = 200

Mode = Literal["constraints", "penalty"]


class LegalOnly(SpaceSampler):
    """``inner`` (a sampler that reads only COMPLETE trials) proposing only legal points of
    ``space``; illegal and failed points are told to it as ``mode`` says (module
    docstring)."""

    def __init__(self, inner: optuna.samplers.BaseSampler, space: SearchSpace, mode: Mode
                 ) -> None:
        super().__init__(space, seed=0)
        self.mode = mode
        self._inner = inner
        self._shadow: optuna.Study | None = None
        self._scan = TrialScan()
        self._open: dict[int, optuna.Trial] = {}  # real trial number -> its shadow trial
        self._direction = StudyDirection.MINIMIZE
        self._values: list[float] = []
        self.illegal_asks = 0

    def _study(self, study: optuna.Study) -> optuna.Study:
        if self._shadow is None:
            self._direction = study.direction
            self._shadow = optuna.create_study(direction=study.direction, sampler=self._inner)
        return self._shadow

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if not search_space:
            return {}
        shadow = self._study(study)
        self._sync(study)
        for _ in range(MAX_ASKS):
            proposal = shadow.ask(search_space)
            decoded = self.space.decode(proposal.params)
            if isinstance(decoded, str):  # illegal: settled in the shadow, asked again
                self.illegal_asks += 1
                self._settle_bad(shadow, proposal)
                continue
            self._open[trial.number] = proposal
            return dict(proposal.params)
        return {}

    # ------------------------------------------------------------------ results

    def _worst(self) -> float | None:
        if not self._values:
            return None
        return max(self._values) if self._direction is StudyDirection.MINIMIZE \
            else min(self._values)

    def _settle_bad(self, shadow: optuna.Study, proposal: optuna.Trial) -> None:
        worst = self._worst()
        if worst is None:
            shadow.tell(proposal, state=TrialState.FAIL)
            return
        if self.mode == "constraints":
            proposal.set_constraint("legal", 1.0)
        shadow.tell(proposal, worst)

    def _sync(self, study: optuna.Study) -> None:
        """Copy the results the loop has reported since the last decision."""
        assert self._shadow is not None
        finished, _ = self._scan.update(study)
        for t in finished:
            proposal = self._open.pop(t.number, None)
            if t.state is TrialState.COMPLETE and t.value is not None \
                    and math.isfinite(t.value):
                self._values.append(float(t.value))
                if proposal is None:  # the loop's own proposal (its fallback): added
                    self._shadow.add_trial(_completed(t, self.mode))
                    continue
                if self.mode == "constraints":
                    proposal.set_constraint("legal", 0.0)
                proposal.set_user_attr("measured", True)
                self._shadow.tell(proposal, float(t.value))
            elif proposal is not None:
                if t.state is TrialState.PRUNED:  # failed to compile or run: as illegal
                    self._settle_bad(self._shadow, proposal)
                else:
                    self._shadow.tell(proposal, state=TrialState.FAIL)


def _completed(trial: FrozenTrial, mode: Mode) -> FrozenTrial:
    system = {"constraints:legal": 0.0} if mode == "constraints" else {}
    return optuna.trial.create_trial(params=trial.params, distributions=trial.distributions,
                                     value=trial.value, system_attrs=system,
                                     user_attrs={"measured": True})


def gp_sampler(space: SearchSpace, seed: int | None) -> optuna.samplers.BaseSampler:
    """Optuna's GPSampler (default settings) told illegal points as infeasible."""
    return LegalOnly(optuna.samplers.GPSampler(seed=seed), space, "constraints")


def cmaes_sampler(space: SearchSpace, seed: int | None) -> optuna.samplers.BaseSampler:
    """Optuna's CMA-ES (default settings) told illegal points as the worst result."""
    return LegalOnly(optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False),
                     space, "penalty")


#: The factories above by strategy name.
PEERS: dict[str, Callable[[SearchSpace, int | None], optuna.samplers.BaseSampler]] = {
    "gp": gp_sampler, "cmaes": cmaes_sampler,
}
