"""The rules every stored trial obeys beyond its own fields: codegen's and physics'.

``semantic_problem``: the problem, config and bucket are legal by codegen's own value types
(``Problem``, ``KernelConfig``, ``ProblemBucket``) and the stored fields match their keys.
``physics_problem``: the timing is possible on the device (``physics.implausible``). Both
return the reason a trial is refused, or None; the writer (local results) and bundle
validation (shared results) apply them before anything is stored.
"""

from __future__ import annotations

from flashtune.codegen.spec import KernelConfig, Problem, ProblemBucket
from flashtune.db.physics import implausible
from flashtune.db.records import DeviceRecord, Keyed, TrialRecord
from flashtune.errors import FlashtuneError


def semantic_problem(trial: TrialRecord) -> str | None:
    """Why ``trial`` breaks codegen's rules (illegal problem, config or bucket, fields that
    do not match their keys), or None when it is legal."""
    try:
        problem = Problem.from_dict(trial.problem.as_dict())
        config = KernelConfig.from_dict(trial.config.as_dict())
        ProblemBucket(problem, trial.seqlen, trial.shape_class)
    except (FlashtuneError, KeyError, TypeError) as exc:
        return f"trial {trial.uid}: {exc}"
    for kind, canonical, keyed in (("problem", Keyed.of(problem), trial.problem),
                                   ("config", Keyed.of(config), trial.config)):
        if canonical.key != keyed.key:
            return (f"trial {trial.uid}: {kind} key {keyed.key!r} does not match its fields, "
                    f"whose canonical key is {canonical.key!r}")
        # One key, one set of fields (the database's rule): defaults are spelled out.
        if canonical.fields != keyed.fields:
            return (f"trial {trial.uid}: {kind} {keyed.key!r} has fields {keyed.as_dict()}; "
                    f"expected its canonical fields {canonical.as_dict()}")
    return None


def physics_problem(trial: TrialRecord, device: DeviceRecord) -> str | None:
    """Why the timing of ``trial`` on ``device`` cannot be real, or None (see physics.py)."""
    if trial.median_ms is None:
        return None
    reason = implausible(Problem.from_key(trial.problem.key), trial.seqlen, trial.median_ms,
                        trial.tflops, device.arch, device.sm_count)
    if reason is None:
        return None
    return (f"trial {trial.uid} ({trial.bucket} {trial.config.key} on {device.name!r}) is "
            f"refused: {reason}")


