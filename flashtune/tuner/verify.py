"""The tuner's verification step: runtime.verify's verdict as a typed trial outcome.

A wrong result is recorded as wrong_result and can never become a bucket's best.
"""

from __future__ import annotations

import torch

from flashtune.codegen.spec import Shape
from flashtune.db.records import TrialStatus
from flashtune.families.base import Verdict
from flashtune.runtime.backends.base import LoadedKernel
from flashtune.runtime.launch import verify
from flashtune.tuner.measure import VerifyOutcome


def outcome(verdict: Verdict) -> VerifyOutcome:
    if verdict.ok:
        return VerifyOutcome(TrialStatus.OK, max_abs_error=verdict.max_abs)
    finite = verdict.max_abs if verdict.max_abs != float("inf") else None
    return VerifyOutcome(TrialStatus.WRONG_RESULT, max_abs_error=finite, error=verdict.message)


def check_kernel(kernel: LoadedKernel, shape: Shape, device: torch.device | str, *,
                 stream: int = 0) -> VerifyOutcome:
    """Launch ``kernel`` once on fresh inputs and compare with its family's reference."""
    return outcome(verify(kernel, shape, device, stream=stream))
