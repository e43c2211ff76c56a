"""MLA decoding reads each latent byte once per (sequence, split), proved by the emulator's
cp.async byte counter: the latent rows of every sequence (sum of the cache lengths x 576 x
element size) plus the block's packed Q rows once per non-empty split, nothing else through
cp.async (the block table and cache lengths are plain loads, O and LSE stores). The default
tiles cover the packed rows (heads x query rows <= block_m: one row block); a sequence with
more packed rows than block_m is read once per row block (sweep: 128 heads x 2 rows). A
seeded sample by default, every page size (none, 1, 3, 16, 64, 100, 256) under sweep.
An FP8 latent cache (test_mla_fp8.py) reads its 656-byte rows the same way: 656 bytes per
cached token, Q's 16-bit rows as before."""

from __future__ import annotations

import os

import pytest
from mla_cases import GRID, MlaCase, run_case, sample

from flashtune.families.decode.splits import split_range
from flashtune.families.mla.fp8 import ROW_BYTES
from flashtune.families.mla.space import latent_dim

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])


def check_bytes(case: MlaCase) -> None:
    inputs, _, counters, config = run_case(case, f"{SEED}-bytes-{case.key}")
    lengths = inputs.tensors["cache_seqlens"].tolist()
    elem = case.problem.dtype.itemsize
    row_bytes = latent_dim(case.problem) * elem
    cache_row_bytes = ROW_BYTES if case.fp8_cache else row_bytes
    rows = case.heads * case.seqlen_q
    m_blocks = -(-rows // config.block_m)
    nonempty = sum(1 for n in lengths for s in range(case.num_splits)
                   if split_range(n, case.num_splits, s)[0] < split_range(n, case.num_splits,
                                                                          s)[1])
    latent_bytes = sum(lengths) * cache_row_bytes * m_blocks
    q_bytes = rows * row_bytes * nonempty
    assert counters.cp_async_bytes == latent_bytes + q_bytes, (
        case.key, counters.cp_async_bytes, latent_bytes, q_bytes)
    # An FP8 row is 656 bytes: every other row starts mid 32-byte sector, so a warp's
    # copies of a tile touch up to one sector per row more than the bytes need.
    assert counters.coalescing_efficiency == 1.0 or (
        case.fp8_cache and counters.coalescing_efficiency > 0.95)


@pytest.mark.emulator
@pytest.mark.parametrize("case", sample(SEED + 11), ids=lambda c: c.key)
def test_latent_read_once_on_a_sample(case: MlaCase) -> None:
    assert case.heads * case.seqlen_q <= 64  # one row block: the minimum
    check_bytes(case)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("case", GRID, ids=lambda c: c.key)
def test_latent_read_once_grid(case: MlaCase) -> None:
    check_bytes(case)
