"""Decoding with a block mask: ``attention_with_kvcache(..., block_mask=...)`` applies the
block mask's ``mask_mod`` exactly (q_idx the new row's absolute position, kv_idx the key's)
and each block of the split-KV kernel walks only the key tiles the mask marks non-empty for
one of its rows (``api.decode.decode_tile_ranges``), on the emulator.

Numerics are checked against a float64 reference that applies the same functions to the
dense score matrix of each sequence; the tile-skip test counts the kernel's tensor-core
operations (it fails when the ranges are ignored); refusals name what, the expected value
and the fix. The default run takes a seeded sample (FLASHTUNE_TEST_SEED, in the ids);
``-m sweep`` the grid.
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from decode_cases import call_api, run_emulated
from flex_fixtures import (
    with_ranges,
)

import flashtune
from flashtune.api.decode import decode_tile_ranges
from flashtune.api.flex import traced_feature
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.codegen.trace import trace
from flashtune.errors import InvalidInput
from flashtune.families.base import Inputs, close_enough
from flashtune.families.checks import LSE_TOLERANCE, O_TOLERANCE
from flashtune.families.decode import DECODE, DecodeCase
from flashtune.families.decode.reference import expected_caches, sequence_keys

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
CAPACITY = 160
BATCH = 2
Fn = Callable[..., Any]


def sliding(width: int) -> Fn:
    """Causal sliding window, wider for later heads (the mask varies with the head)."""
    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) & (q_idx - kv_idx < width + 8 * h)
    return mask_mod


def documents(seed: int) -> Fn:
    """Causal document masking with document ids per (sequence, position), drawn: the mask
    varies with the batch and reads a captured tensor."""
    gen = torch.Generator().manual_seed(seed)
    docs = torch.cumsum(torch.rand(BATCH, CAPACITY, generator=gen) < 0.03, dim=1).to(
        torch.int32)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (docs[b, q_idx] == docs[b, kv_idx]) & (kv_idx <= q_idx)
    return mask_mod


def prefix_lm(prefix: int) -> Fn:
    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx < prefix) | (kv_idx <= q_idx)
    return mask_mod


def tanh_cap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return 20.0 * torch.tanh(score / 20.0)


MASKS: dict[str, Callable[[int], Fn]] = {
    "sliding": lambda seed: sliding(24), "documents": documents,
    "prefix": lambda seed: prefix_lm(40)}
#: (mask, score_mod, page size, (heads_q, heads_kv), seqlen_q, append, splits, BLOCK_SIZE,
#: (head dim, V's head dim)).
GRID = tuple(itertools.product(
    sorted(MASKS), (None, "tanh"), (None, 1, 16), ((2, 2), (8, 2)), (1, 4), (False, True),
    (1, 3), (16, 32), ((64, 64), (512, 512))))


def _id(params: tuple[Any, ...]) -> str:
    mask, score, page, heads, nq, append, splits, block, dims = params
    return (f"{mask}-{score or 'plain'}-page{page}-h{heads[0]}x{heads[1]}-q{nq}-"
            f"{'append' if append else 'noappend'}-s{splits}-blk{block}-d{dims[0]}v{dims[1]}")


def dense_reference(inputs: Inputs, mask_mod: Fn, score_mod: Fn | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 O (B, Nq, Hq, Dv) and LSE (B, Hq, Nq) over each sequence's keys after
    appending, with ``score_mod`` and ``mask_mod`` applied to the dense scores at q_idx =
    i + total - Nq (a row that sees no key: O = 0, LSE = +inf, the API's convention)."""
    q = inputs.tensors["q"]
    scale = float(inputs.scalars["softmax_scale"])
    outs, lses = [], []
    for b, (keys, values) in enumerate(sequence_keys(inputs)):
        total, nq, heads = keys.shape[0], q.shape[1], q.shape[2]
        group = heads // keys.shape[1]
        k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[b].double(), k) * scale
        h = torch.arange(heads).view(-1, 1, 1)
        i = (torch.arange(nq) + total - nq).view(1, -1, 1)
        j = torch.arange(total).view(1, 1, -1)
        bt = torch.tensor(b)
        if score_mod is not None:
            s = score_mod(s, bt, h, i, j).double()
        s = s.masked_fill(~mask_mod(bt, h, i, j).expand(s.shape), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        seen = torch.isfinite(lse)
        p = torch.exp(s - torch.where(seen, lse, 0.0)[..., None])
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
        lses.append(torch.where(seen, lse, float("inf")))
    return torch.stack(outs), torch.stack(lses)


def _inputs(dims: tuple[int, int], page: int | None, heads: tuple[int, int], nq: int,
            append: bool, seed: int) -> Inputs:
    if dims[0] > 256:  # Gemma 4's 512/512: drawn with V of 256, widened (test_decode_wide)
        from test_decode_wide import wide_inputs
        return wide_inputs(dims[0], dims[1], page, heads, nq, append, seed,
                           capacity=CAPACITY)
    problem = Problem(dims[0], DType.BF16, op="decode")
    shape = Shape(BATCH, heads[0], heads[1], nq, CAPACITY)
    new = nq if append else 0
    room = DecodeCase(page, (0,) * BATCH, 0, 1).capacity(shape) - new
    lengths = (room, random.Random(seed).randrange(0, room))
    return DECODE.random_inputs(problem, shape, "cpu", seed=seed,
                                case=DecodeCase(page, lengths, new, 1))


def _check_api(params: tuple[Any, ...]) -> None:
    mask, score, page, heads, nq, append, splits, block, dims = params
    seed = SEED * 1009 + GRID.index(params)
    print(f"seed={seed} (FLASHTUNE_TEST_SEED={SEED}) {_id(params)}")
    inputs = _inputs(dims, page, heads, nq, append, seed)
    mask_mod = MASKS[mask](seed)
    score_mod = tanh_cap if score else None
    block_mask = flashtune.create_block_mask(mask_mod, BATCH, heads[0], CAPACITY, CAPACITY,
                                             BLOCK_SIZE=block)
    out, lse = call_api(inputs, return_lse=True, backend="emulator", block_mask=block_mask,
                        score_mod=score_mod, num_splits=splits)
    ref_o, ref_lse = dense_reference(inputs, mask_mod, score_mod)
    for name, got, want, tol in (("O", out, ref_o, O_TOLERANCE[DType.BF16]),
                                 ("LSE", lse, ref_lse, LSE_TOLERANCE)):
        _, _, wrong = close_enough(name, got, want, tol)
        assert not wrong, f"{_id(params)} seed {SEED}: {wrong}"
    for name, want in expected_caches(inputs).items():
        got = inputs.tensors[name]
        assert ((got == want) | (torch.isnan(got) & torch.isnan(want))).all(), name


def _sample() -> list[tuple[Any, ...]]:
    """Two masks drawn at head dim 64 (other knobs drawn; every mask is in the sweep), and
    one drawn case at 512/512."""
    rng = random.Random(f"{SEED}-decode-block-mask")
    return [rng.choice([c for c in GRID if c[0] == mask and c[8] == (64, 64)])
            for mask in rng.sample(sorted(MASKS), 2)] + [
                rng.choice([c for c in GRID if c[8] != (64, 64)])]


@pytest.mark.emulator
@pytest.mark.parametrize("params", _sample(), ids=_id)
def test_decoding_with_a_block_mask_matches_float64(params: tuple[Any, ...]) -> None:
    _check_api(params)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("params", GRID, ids=_id)
def test_decoding_with_a_block_mask_grid(params: tuple[Any, ...]) -> None:
    _check_api(params)


def _mma_per_tile(head_dim: int, config: KernelConfig) -> int:
    """mma.sync m16n8k16 of one key tile per block: Q K^T and P V of every warp."""
    m_tiles = config.rows_per_warp // 16
    dim = -(-head_dim // 16) * 16
    return config.num_warps * m_tiles * ((config.block_n // 8) * (dim // 16)
                                         + (dim // 8) * (config.block_n // 16))


@pytest.mark.emulator
def test_a_block_mask_skips_the_empty_key_tiles() -> None:
    """One sequence of 256 keys, 4 query heads on one kv head (one block), one new query
    row at position 255 under a sliding window of 24 (+ 8 per head): every block walks
    exactly the key tiles (32 keys) from the one holding the lowest key of a 16-key block
    the mask marks non-empty for its rows' query block, to the end, counted from the dense
    mask; with ranges that mark every block non-empty (skipping off) it walks all 8 tiles
    and the outputs stay the same (NaN-poisoned, against float64)."""
    n, heads, config = 256, 4, KernelConfig(64, 32, 4, 2)
    mask_mod = sliding(24)
    block_mask = flashtune.create_block_mask(mask_mod, 1, heads, n, n)
    traced = trace(None, mask_mod, tiles=True)
    problem = Problem(64, DType.FP16, op="decode", features=[traced_feature(traced)])
    shape = Shape(1, heads, 1, 1, n)
    drawn = DECODE.random_inputs(problem, shape, "cpu", seed=SEED,
                                 case=DecodeCase(None, (n,), 0, 1))
    ranges = decode_tile_ranges(block_mask, torch.device("cpu"))
    # The dense mask of the query block holding position 255 (rows 240..255), per head.
    q_idx = torch.arange(240, 256).view(-1, 1)
    kv_idx = torch.arange(n).view(1, -1)
    lowest = min(int(torch.nonzero(mask_mod(0, h, q_idx, kv_idx).any(0))[0])
                 for h in range(heads))
    expected_tiles = -(-(n - lowest // 16 * 16 // 32 * 32) // 32)
    everything = ranges.clone()
    everything[..., 0], everything[..., 1] = 0, n // 16
    counts = {}
    for name, r in (("mask", ranges), ("all", everything)):
        launch, kernel = run_emulated(problem, shape, with_ranges(problem, traced, r, drawn),
                                      config, counters=True)
        verdict = launch.verdict()
        assert verdict.ok, f"{name} (seed {SEED}): {verdict.message}"
        counters = kernel.last_counters
        assert counters is not None
        counts[name] = counters.mma_count
    per_tile = _mma_per_tile(64, config)
    assert counts["all"] == 8 * per_tile, counts
    assert expected_tiles < 8 and counts["mask"] == expected_tiles * per_tile, (
        counts, expected_tiles)


def _cache(capacity: int = 64) -> tuple[torch.Tensor, ...]:
    q = torch.zeros(2, 1, 4, 64, dtype=torch.float16)
    k_cache = torch.zeros(2, capacity, 2, 64, dtype=torch.float16)
    return q, k_cache, k_cache.clone(), torch.tensor([3, 5], dtype=torch.int32)


@pytest.mark.parametrize("sizes, match", [
    ((2, 4, 32, 64), r"Q_LEN, KV_LEN >= 64.*create_block_mask\(mask_mod, 2, 4, 64, 64\)"),
    ((2, 4, 64, 48), r"\(B, H, Q_LEN, KV_LEN\) = \(2, 4, 64, 48\).*capacity 64"),
    ((3, 4, 64, 64), r"expected B in \(1, 2\)"),
    ((1, 2, 64, 64), r"H in \(1, 4\)"),
])
def test_a_block_mask_that_does_not_cover_the_cache_is_refused(
        sizes: tuple[int, int, int, int], match: str) -> None:
    q, k_cache, v_cache, lens = _cache()
    block_mask = flashtune.create_block_mask(prefix_lm(8), *sizes)
    with pytest.raises(InvalidInput, match=match):
        flashtune.attention_with_kvcache(q, k_cache, v_cache, lens, block_mask=block_mask,
                                         backend="emulator")


def test_a_block_mask_with_a_mask_mod_or_of_another_type_is_refused() -> None:
    q, k_cache, v_cache, lens = _cache()
    block_mask = flashtune.create_block_mask(prefix_lm(8), 1, 1, 64, 64)
    with pytest.raises(InvalidInput, match="mask_mod and block_mask are both given"):
        flashtune.attention_with_kvcache(q, k_cache, v_cache, lens, block_mask=block_mask,
                                         mask_mod=prefix_lm(8), backend="emulator")
    with pytest.raises(InvalidInput, match="block_mask is a Tensor; expected a flashtune "
                                           "BlockMask"):
        flashtune.attention_with_kvcache(  # type: ignore[call-overload]  # ill-typed on purpose
            q, k_cache, v_cache, lens, backend="emulator", block_mask=torch.ones(64, 64))


@pytest.mark.parametrize("arch, dims, spill", [
    ("sm_90", (128, None), 0),
    pytest.param("sm_80", (128, None), 0, marks=pytest.mark.sweep),
    pytest.param("sm_80", (512, 256), 0, marks=pytest.mark.sweep),
    pytest.param("sm_90", (512, 256), 0, marks=pytest.mark.sweep),
], ids=str)
def test_block_mask_defaults_compile_with_nvrtc(arch: str, dims: tuple[int, int | None],
                                                spill: int) -> None:
    """The default decode config with a block mask compiles for the GPU within the spill
    allowance (none: test_decode_defaults compiles every head dim's)."""
    from flashtune import families
    from flashtune.codegen.arch import get_arch
    from flashtune.toolchain.compiler import compile_source

    traced = trace(None, sliding(24), tiles=True)
    problem = Problem(dims[0], DType.BF16, op="decode", head_dim_v=dims[1],
                      features=[traced_feature(traced)])
    config = DECODE.default_config(problem, get_arch(arch))
    resources = compile_source(families.render(problem, config), arch).resources
    assert resources.spill_bytes <= spill and resources.registers > 0, (
        f"{problem.key()} {config.key()} on {arch}: {resources}")
