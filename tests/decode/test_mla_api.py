"""MLA decoding through the API (``api.mla.mla_with_kvcache``) in the emulator: O and LSE
against float64 dense attention of each sequence (paged and unpaged, causal speculative
rows, an empty cache: O = 0, LSE = +inf), and the refusals naming the argument and the
expected value (a latent of the wrong width, head_dim_v, more than one latent head, a bad
block-table entry)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from mla_cases import MlaCase
from test_mla_decode import dense_reference

import flashtune
from flashtune.api.mla import attention_with_latent_cache, mla_with_kvcache
from flashtune.codegen.spec import DType
from flashtune.errors import InvalidInput
from flashtune.families.base import close_enough
from flashtune.families.checks import LSE_TOLERANCE, O_TOLERANCE
from flashtune.families.decode import DecodeCase
from flashtune.families.mla import MLA

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])


def _inputs(case: MlaCase, lengths: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    inputs = MLA.random_inputs(case.problem, case.shape, "cpu", seed=seed,
                               case=DecodeCase(case.page_size, lengths, 0, case.num_splits))
    return dict(inputs.tensors)


@pytest.mark.emulator
@pytest.mark.parametrize("page_size,seqlen_q,splits", [(16, 2, 3), (None, 1, 1)])
def test_api_matches_float64(page_size: int | None, seqlen_q: int, splits: int) -> None:
    case = MlaCase(DType.BF16, page_size, seqlen_q, 16, splits)
    rng = random.Random(f"{SEED}-api-{page_size}-{seqlen_q}")
    lengths = (150, rng.randrange(seqlen_q, 150), 0)
    t = _inputs(case, lengths, rng.randrange(1 << 30))
    if page_size is None:  # flashtune's decoding entry with v_cache=None
        out, lse = flashtune.attention_with_kvcache(
            t["q"], t["kv_cache"], None, t["cache_seqlens"], causal=case.causal,
            num_splits=splits, return_lse=True, head_dim_v=512, backend="emulator")
    else:
        out, lse = mla_with_kvcache(t["q"], t["kv_cache"], t["cache_seqlens"],
                                    block_table=t.get("block_table"), causal=case.causal,
                                    num_splits=splits, backend="emulator")
    assert out.shape == (3, seqlen_q, 16, 512) and out.dtype == torch.bfloat16
    cache, table = t["kv_cache"], t.get("block_table")
    for b, length in enumerate(lengths):
        pos = torch.arange(length)
        latent = (cache[b, pos, 0] if table is None else
                  cache[table[b, pos // cache.shape[1]].long(), pos % cache.shape[1], 0])
        want_o, want_lse = dense_reference(t["q"][b], latent, 576 ** -0.5, case.causal)
        for name, got, want, tol in (("O", out[b], want_o, O_TOLERANCE[DType.BF16]),
                                     ("LSE", lse[b], want_lse, LSE_TOLERANCE)):
            _, _, wrong = close_enough(f"sequence {b} {name}", got, want, tol)
            assert not wrong, wrong
    assert bool((out[2] == 0).all()) and bool(torch.isposinf(lse[2]).all())


def test_api_refuses_bad_inputs_naming_the_expected_value() -> None:
    case = MlaCase(DType.BF16, 16, 1, 16, 1)
    t = _inputs(case, (40, 20, 0), SEED)
    q, cache, lengths = t["q"], t["kv_cache"], t["cache_seqlens"]
    table = t["block_table"]
    with pytest.raises(InvalidInput, match="expected 576"):
        mla_with_kvcache(q[..., :512].contiguous(), cache[..., :512].contiguous(), lengths,
                         block_table=table, backend="emulator")
    with pytest.raises(InvalidInput, match="head_dim_v=512"):
        mla_with_kvcache(q, cache, lengths, block_table=table, head_dim_v=128,
                         backend="emulator")
    with pytest.raises(InvalidInput, match="one latent head"):
        mla_with_kvcache(q, cache.expand(-1, -1, 2, -1).contiguous(), lengths,
                         block_table=table, backend="emulator")
    bad = table.clone()
    bad[0, 1] = 999
    with pytest.raises(InvalidInput, match=r"block_table\[0, 1\] = 999"):
        mla_with_kvcache(q, cache, lengths, block_table=bad, backend="emulator")


def test_the_latent_entry_refuses_what_the_kernel_has_not_got() -> None:
    case = MlaCase(DType.BF16, 16, 1, 16, 1)
    t = _inputs(case, (40, 20, 0), SEED)
    with pytest.raises(InvalidInput, match="window_size, softcap"):
        attention_with_latent_cache(t["q"], t["kv_cache"], t["cache_seqlens"],
                                    block_table=t["block_table"], window_size=(8, 0),
                                    softcap=30.0, backend="emulator")
    with pytest.raises(InvalidInput, match="k and v"):
        attention_with_latent_cache(t["q"], t["kv_cache"], t["cache_seqlens"],
                                    block_table=t["block_table"], k=t["q"], v=t["q"],
                                    backend="emulator")


def test_the_decoding_entry_routes_only_latent_calls() -> None:
    """``head_dim_v`` belongs to ``v_cache=None``; a latent call takes no modification."""
    case = MlaCase(DType.BF16, 16, 1, 16, 1)
    t = _inputs(case, (40, 20, 0), SEED)
    with pytest.raises(InvalidInput, match=r"head_dim_v=512 with a v_cache"):
        flashtune.attention_with_kvcache(t["q"], t["kv_cache"], t["kv_cache"],
                                         t["cache_seqlens"], head_dim_v=512,
                                         backend="emulator")
    with pytest.raises(InvalidInput, match=r"v_cache=None .* score_mod, mask_mod or block_mask"):
        flashtune.attention_with_kvcache(t["q"], t["kv_cache"], None, t["cache_seqlens"],
                                         block_table=t["block_table"],
                                         score_mod=lambda s, b, h, i, j: s,
                                         backend="emulator")
