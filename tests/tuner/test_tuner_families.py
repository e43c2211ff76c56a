"""A second kernel family (row-wise LSE) is tuned through the family interface alone."""

from __future__ import annotations

import dataclasses

from tuner_synthetic import SyntheticBackend
from tuner_testlib import FAST

from flashtune.codegen.spec import KernelConfig
from flashtune.tuner.api import tune


def test_lse_family_is_tuned_by_the_synthetic_backend(db_url: str) -> None:
    best = KernelConfig(32, 64, 2, 1)
    backend = SyntheticBackend(best=best)
    opts = dataclasses.replace(FAST, trials=8, sampler="grid")
    [summary] = tune(64, "fp16", False, [1024], op="lse", backend=backend, db=db_url,
                     options=opts)
    assert summary.winner == best
    assert summary.bucket.problem.op == "lse"
