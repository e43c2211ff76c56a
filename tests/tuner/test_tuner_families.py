"""A second kernel family (row-wise LSE) is tuned through the family interface alone."""

from __future__ import annotations

import dataclasses

from tuner_synthetic import SyntheticMeasurer
from tuner_testlib import FAST

from flashtune.codegen.spec import KernelConfig
from flashtune.tuner.driver import tune


def test_lse_family_is_tuned_by_the_synthetic_backend(db_url: str) -> None:
    best = KernelConfig(32, 64, 2, 1)
    measurer = SyntheticMeasurer(best=best)
    opts = dataclasses.replace(FAST, trials=8, sampler="grid")
    [summary] = tune(64, "fp16", False, [1024], op="lse", measurer=measurer, db=db_url,
                     options=opts)
    assert summary.winner == best
    assert summary.bucket.problem.op == "lse"


def test_decode_family_tunes_its_split_count_and_the_runtime_uses_it(db_url: str) -> None:
    """The decode family's space includes a split count; a tuned winner that fixes one is
    what attention_with_kvcache then launches for that bucket (the caller's num_splits
    still wins)."""
    import torch

    import flashtune
    from flashtune.api.decode import choose_splits
    from flashtune.api.validate_kvcache import check_kvcache_inputs
    from flashtune.codegen.arch import get_arch
    from flashtune.codegen.spec import DType, Problem
    from flashtune.db.store import TuningStore
    from flashtune.families.decode import DECODE
    from flashtune.runtime.dispatch import Dispatcher, set_dispatcher

    problem = Problem(64, DType.FP16, op="decode")
    candidates = DECODE.candidates(problem, get_arch("sm_90"))
    # any fixed count beats the rest (split sizes: tests/decode/test_decode_invariant.py)
    fixed = {c.key(): 3.0 for c in candidates if c.extra("splits", 0)}
    measurer = SyntheticMeasurer(best=DECODE.default_config(problem, get_arch("sm_90")),
                               speed=fixed)
    [summary] = tune(64, "fp16", False, [4096], op="decode", measurer=measurer, db=db_url,
                     options=dataclasses.replace(FAST, trials=8))
    assert summary.winner is not None and summary.winner.key() in fixed
    splits = summary.winner.extra("splits", 0)

    set_dispatcher(Dispatcher(lambda: TuningStore(db_url, create=False)))
    try:
        q = torch.empty(4, 1, 8, 64, dtype=torch.float16, device="meta")
        cache = torch.empty(4, 4096, 2, 64, dtype=torch.float16, device="meta")
        lengths = torch.empty(4, dtype=torch.int32, device="meta")
        decode, _ = flashtune.explain_kvcache(q, cache, cache, lengths, arch="sm_90")
        assert decode.config == summary.winner and decode.tier.value != "default"
        layout = check_kvcache_inputs(q, cache, cache, lengths)
        assert choose_splits(0, decode.config, layout, 132) == splits
        assert choose_splits(5, decode.config, layout, 132) == 5
        heuristic = choose_splits(0, DECODE.default_config(problem, get_arch("sm_90")),
                                  layout, 132)
        assert heuristic > 1  # 4 sequences x 2 kv heads on 132 SMs: split by the rule
    finally:
        set_dispatcher(None)


def test_backward_family_is_tuned_with_its_own_buckets_and_default(db_url: str) -> None:
    """``tune --op bwd`` searches the backward space (dQ mode included) and stores the winner
    under the backward problem's own bucket, apart from the forward's."""
    from flashtune.codegen.arch import get_arch
    from flashtune.codegen.spec import Problem
    from flashtune.db.store import TuningStore
    from flashtune.families.bwd import BACKWARD

    problem = Problem(64, "fp16", True, op="bwd")
    best = BACKWARD.default_config(problem, get_arch("sm_90"))
    measurer = SyntheticMeasurer(best=best)
    opts = dataclasses.replace(FAST, trials=6, sampler="random")
    [summary] = tune(64, "fp16", True, [2048], op="bwd", measurer=measurer, db=db_url,
                     options=opts)
    assert summary.winner == best and summary.default == best
    assert summary.bucket.key() == "bwd_d64_fp16_causal_n2048"
    stored = {(e.problem, e.config.key) for e in TuningStore(db_url).all_best()}
    assert ("bwd_d64_fp16_causal", best.key()) in stored
