"""The measurement behind the FP8 backward's operand precisions
(benchmarks/fp8_backward_error.py): FP8 Q, K, V and dO with P and dS kept 16-bit stay within
the 16-bit backward's error class (well inside flash-attn's 3x rule), while rounding P to
e4m3 multiplies dV's error, and rounding dS multiplies dQ's, by several times. The table is
printed (``-s``) with the seed."""

from __future__ import annotations

import os

import fp8_backward_error as bench
import pytest

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])


@pytest.mark.parametrize("causal", [True, False])
def test_fp8_inputs_with_16bit_p_and_ds_keep_the_16bit_error(causal: bool) -> None:
    torch_err, rows = bench.measure(seqlen=256, head_dim=64, causal=causal, seed=SEED)
    print(f"seed={SEED} causal={causal}\n{bench._table(torch_err, rows)}")
    sixteen, chosen, fp8_p, fp8_ds, _ = rows
    for name in bench.GRADS:
        assert chosen.ratios[name] <= 1.5, (name, chosen)  # the rule allows 3
        assert chosen.errors[name] <= 3 * sixteen.errors[name], (name, chosen, sixteen)
    # Max-abs errors of one small problem are noisy: over seeds 0-59, both masks, the
    # smallest ratios seen were 4.3x (dV, FP8 P), 2.6x (dQ) and 2.3x (dK, FP8 dS), the 1st
    # percentiles 5.2x, 3.9x and 4.9x; the bounds sit below those minima.
    assert fp8_p.errors["dv"] >= 3 * chosen.errors["dv"], (fp8_p, chosen)
    assert fp8_ds.errors["dq"] >= 2 * chosen.errors["dq"], (fp8_ds, chosen)
    assert fp8_ds.errors["dk"] >= 2 * chosen.errors["dk"], (fp8_ds, chosen)
