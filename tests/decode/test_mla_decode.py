"""MLA decoding in the emulator against float64 attention written here from the definition:
per sequence, scores = q . latent^T * scale over the 576-wide latent, softmax, O = P .
latent[:, :512]; the kernel's partial O and LSE of each split, merged in float64, must equal
it (a sequence with an empty cache: O = 0, LSE = +inf), and each split's partials must
match the family's own float64 reference. Outputs are poisoned with NaN before each run;
cache rows no sequence may read hold NaN. A seeded sample by default (page sizes none, 1, 3,
16, 64; 1 and 2 query rows, causal among 2; 16 and 32 heads; 1 and 3 splits), the grid
(page sizes 100 and 256, up to 128 heads, both dtypes) behind the sweep marker.

An FP8 latent cache (test_mla_fp8.py runs ``check_case`` on it) is dequantised here from
its bytes (``dequantise_rows``: the e4m3 code decoded from its bits, the product with the
float32 scale exact in float64, rounded to float32 then to bf16: the kernel's documented
order) before the same float64 attention."""

from __future__ import annotations

import os

import pytest
import torch
from mla_cases import GRID, MlaCase, run_case, sample

from flashtune.families.base import close_enough
from flashtune.families.checks import LSE_TOLERANCE, O_TOLERANCE
from flashtune.families.mla import MLA

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
NOPE = 512


def dense_reference(q: torch.Tensor, latent: torch.Tensor, scale: float, causal: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """O (seqlen_q, heads, 512) and LSE (heads, seqlen_q) of one sequence in float64; a row
    that sees no key has O = 0 and LSE = +inf."""
    q64, lat = q.to(torch.float64), latent.to(torch.float64)
    seqlen_q, length = q64.shape[0], lat.shape[0]
    scores = torch.einsum("qhd,kd->hqk", q64, lat) * scale
    if causal:
        visible = (torch.arange(length)[None, :]
                   <= torch.arange(seqlen_q)[:, None] + length - seqlen_q)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) if length else torch.full(
        scores.shape[:2], float("-inf"), dtype=torch.float64)
    seen = ~torch.isneginf(lse)
    probs = torch.exp(scores - lse.where(seen, 0.0)[..., None])
    o = torch.einsum("hqk,kd->qhd", probs, lat[:, :NOPE])
    return o, lse.where(seen, float("inf"))


def e4m3_value(code: torch.Tensor) -> torch.Tensor:
    """The float64 value of e4m3 codes (uint8) from their bits: sign, 4 exponent bits (bias
    7, 0 for subnormals), 3 mantissa bits; S.1111.111 is NaN."""
    code = code.to(torch.int64)
    e, m = (code >> 3) & 15, code & 7
    significand = torch.where(e > 0, 8 + m, m).to(torch.float64)
    mag = significand * torch.pow(2.0, (e.clamp(min=1) - 10).to(torch.float64))
    value = torch.where(code & 0x80 != 0, -mag, mag)
    return torch.where((e == 15) & (m == 7), float("nan"), value)


def dequantise_rows(rows: torch.Tensor) -> torch.Tensor:
    """The bf16 latent (n, 576), as float64, of FP8 rows (n, 656): 512 e4m3 codes, 4 float32
    scales (one per 128 codes), 64 bf16 RoPE values."""
    raw = rows.view(torch.uint8)
    scales = raw[:, 512:528].contiguous().view(torch.float32).to(torch.float64)
    exact = e4m3_value(raw[:, :512]) * scales.repeat_interleave(128, dim=1)
    nope = exact.to(torch.float32).to(torch.bfloat16)
    rope = raw[:, 528:].contiguous().view(torch.bfloat16)
    return torch.cat((nope, rope), dim=1).to(torch.float64)


def merge(o_part: torch.Tensor, lse_part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits of one sequence merged in float64: o_part (splits, heads, seqlen_q, 512),
    lse_part (splits, heads, seqlen_q) -> O (seqlen_q, heads, 512), LSE (heads, seqlen_q)."""
    lse_part = lse_part.to(torch.float64)
    lse = torch.logsumexp(lse_part, dim=0)
    seen = ~torch.isneginf(lse)
    weights = torch.exp(lse_part - lse.where(seen, 0.0)).nan_to_num(0.0)
    o = (weights[..., None] * o_part.to(torch.float64)).sum(0)
    return o.permute(1, 0, 2), lse.where(seen, float("inf"))


def check_case(case: MlaCase) -> None:
    inputs, outputs, _, _ = run_case(case, f"{SEED}-{case.key}")
    t = inputs.tensors
    verdict = MLA.compare(case.problem, case.shape, outputs, MLA.reference(case.problem,
                                                                            inputs))
    assert verdict.ok, verdict.message
    cache, table = t["kv_cache"], t.get("block_table")
    for b, length in enumerate(t["cache_seqlens"].tolist()):
        pos = torch.arange(length)
        if table is None:
            latent = cache[b, pos, 0]
        else:
            latent = cache[table[b, pos // cache.shape[1]].long(), pos % cache.shape[1], 0]
        if case.fp8_cache:
            assert latent.shape[-1] == 656
            latent = dequantise_rows(latent)
        want_o, want_lse = dense_reference(t["q"][b], latent, inputs.scalars["softmax_scale"],
                                           case.causal)
        got_o, got_lse = merge(outputs["o_part"][:, b], outputs["lse_part"][:, b])
        for name, got, want, tol in (("O", got_o, want_o, O_TOLERANCE[case.dtype]),
                                     ("LSE", got_lse, want_lse, LSE_TOLERANCE)):
            _, _, wrong = close_enough(f"sequence {b} {name}", got, want, tol)
            assert not wrong, f"{case.key}: {wrong}"
        if length == 0:  # every split empty: weight 0 (O = 0, LSE = -inf) in each
            assert bool((outputs["o_part"][:, b] == 0).all())
            assert bool(torch.isneginf(outputs["lse_part"][:, b]).all())


@pytest.mark.emulator
@pytest.mark.parametrize("case", sample(SEED), ids=lambda c: c.key)
def test_mla_matches_float64_on_a_sample(case: MlaCase) -> None:
    check_case(case)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("case", GRID, ids=lambda c: c.key)
def test_mla_matches_float64_grid(case: MlaCase) -> None:
    check_case(case)
