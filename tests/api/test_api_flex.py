"""flashtune.flex_attention and attention(score_mod=..., mask_mod=...) on the emulator:
the same Python functions (api.flex_mods, every ready modification) give the results of
torch.nn.attention.flex_attention on the CPU and of a float64 reference that applies them to
the dense score matrix, within flash-attn's low-precision rule; a block mask's empty key
tiles are never computed (the emulator's tensor-core counters), and skipping changes no
result; SDPA's attn_mask (bool and additive float) against torch's SDPA and float64. One
case, drawn with the run's seed, in the default run; all under -m sweep."""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from flex_fixtures import (
    Fn,
    dense,
    docs_of,
    four_documents,
    grid,
    launch_with_ranges,
    random_flashmask,
)

import flashtune
from flashtune.api import flex_mods
from flashtune.api.block_mask import create_block_mask
from flashtune.api.flex import traced_feature
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.codegen.trace import trace
from flashtune.families import render
from flashtune.families.fwd import FORWARD
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions

pytestmark = pytest.mark.emulator

_SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
#: (score_mod, mask_mod) of a case, made from (heads, sequence length, generator).
Case = Callable[[int, int, torch.Generator], tuple[Fn, Fn]]


CASES: dict[str, Case] = {
    "flashmask-causal": lambda h, n, g: (None, random_flashmask(h, n, g, True)),
    "flashmask-bidirectional": lambda h, n, g: (flex_mods.softcap(4.0),
                                                random_flashmask(h, n, g, False)),
    "t5-causal": lambda h, n, g: (flex_mods.t5_relative_bias(torch.randn(h, 32, generator=g),
                                                             n, 64), flex_mods.causal),
    "alibi-sliding-window": lambda h, n, g: (flex_mods.alibi(torch.rand(h, generator=g)),
                                             flex_mods.sliding_window_causal(40)),
    "softcap-document": lambda h, n, g: (flex_mods.softcap(2.0),
                                         flex_mods.document(docs_of(n, g))),
    "document-bidirectional": lambda h, n, g: (None,
                                               flex_mods.document(docs_of(n, g), causal=False)),
    "prefix-lm": lambda h, n, g: (None, flex_mods.prefix_lm(torch.tensor([17, 90]))),
    "global-tokens": lambda h, n, g: (None, flex_mods.global_tokens(5, 20)),
    "dilated-window": lambda h, n, g: (None, flex_mods.dilated_window(12, 3)),
    "t5-only": lambda h, n, g: (flex_mods.t5_relative_bias(torch.randn(h, 32, generator=g),
                                                           n, 64), None),
}
#: The default run draws one case: a ready modification, or SDPA's bool or float attn_mask.
_SAMPLED = random.Random(_SEED).choice([*sorted(CASES), "sdpa-bool", "sdpa-float"])


def _run_case(name: str, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, heads, heads_kv, n, dim = 2, 4, 2, 150, 64
    score_mod, mask_mod = CASES[name](heads, n, gen)
    q = torch.randn(batch, heads, n, dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch, heads_kv, n, dim, generator=gen).to(dtype) for _ in "kv")
    where = f"case {name} {dtype} seed={seed}"
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, n, n)
    out, lse = flashtune.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=True,
                                        return_lse=True, backend="emulator")
    scale = dim ** -0.5
    ref, ref_lse = dense(q, k, v, scale, score_mod, mask_mod, torch.float64)
    low, _ = dense(q, k, v, scale, score_mod, mask_mod, dtype)
    # flash-attn's rule: the error is at most twice PyTorch's own in this dtype.
    bound = 2 * (low.double() - ref).abs().max().item() + 1e-5
    error = (out.double() - ref).abs().max().item()
    assert error <= bound, f"{where}: max error {error:.3g} > {bound:.3g}"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), where
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=2e-3, rtol=1e-3,
                               msg=lambda m: f"{where}: LSE: {m}")
    # torch's own flex_attention (CPU, unfused, float32) computes the same thing.
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs_mask = (None if mask_mod is None
                       else torch_block_mask(mask_mod, None, None, n, n, device="cpu"))
        theirs = torch_flex(q.float(), k.float(), v.float(), score_mod, theirs_mask,
                            enable_gqa=True)
    torch.testing.assert_close(theirs.double(), ref, atol=1e-4, rtol=1e-4,
                               msg=lambda m: f"{where}: torch's flex_attention: {m}")
    error_theirs = (out.double() - theirs.double()).abs().max().item()
    assert error_theirs <= bound + 1e-4, f"{where}: {error_theirs:.3g} from torch's"


@pytest.mark.usefixtures("dispatcher", "poisoned_outputs")
def test_a_sampled_modification_matches_torch_and_float64() -> None:
    seed = random.Random(f"{_SEED}-{_SAMPLED}").randrange(2**31)
    if _SAMPLED.startswith("sdpa-"):
        _sdpa_case(_SAMPLED.removeprefix("sdpa-"), seed)
    else:
        _run_case(_SAMPLED, torch.float16, seed)


@pytest.mark.sweep
@pytest.mark.usefixtures("dispatcher", "poisoned_outputs")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_modification_matches_torch_and_float64(name: str, dtype: torch.dtype) -> None:
    _run_case(name, dtype, random.Random(f"{_SEED}-{name}-{dtype}").randrange(2**31))


def _mma_per_tile(head_dim: int, config: KernelConfig) -> int:
    """mma.sync m16n8k16 of one key tile per block: Q K^T and P V of every warp."""
    mma_dim = -(-head_dim // 16) * 16
    m_tiles = config.rows_per_warp // 16
    qk = m_tiles * (config.block_n // 8) * (mma_dim // 16)
    pv = m_tiles * (mma_dim // 8) * (config.block_n // 16)
    return config.num_warps * (qk + pv)


@pytest.mark.usefixtures("dispatcher")
def test_a_block_mask_skips_the_empty_tiles() -> None:
    _skip_case(random.Random(f"{_SEED}-skip").random() < 0.5)


@pytest.mark.sweep
@pytest.mark.usefixtures("dispatcher")
@pytest.mark.parametrize("flash", [False, True], ids=["document-ids", "flashmask"])
def test_block_masks_skip_the_empty_tiles_in_both_forms(flash: bool) -> None:
    _skip_case(flash)


def _skip_case(flash: bool) -> None:
    """Causal document masking over 4 documents (the first long enough to hold full
    tiles), as a mask_mod of document ids or in FlashMask's column form (``flash``): each
    query tile computes exactly the key tiles that hold a key one of its rows sees (counted
    from the dense mask), the outputs match the float64 reference; with every tile walked
    (skipping off) the counters differ while the outputs stay the same; and the mask is
    evaluated on partial tiles only (marking every tile full changes the result)."""
    n, dim, config = 256, 32, KernelConfig(64, 32, 4, 2)
    cuts, docs, mask_mod = four_documents(n, _SEED, flash)
    block_mask = create_block_mask(mask_mod, 1, 1, n, n)
    traced = trace(None, mask_mod, tiles=True)
    problem = Problem(dim, DType.FP16, features=[traced_feature(traced)])
    shape = Shape(1, 1, 1, n, n)
    drawn = FORWARD.random_inputs(problem, shape, "cpu", _SEED)
    kernel = EmulatorBackend(options=LaunchOptions(counters=True)).load(
        render(problem, config))
    visible = mask_mod(*grid(1, 1, n, n))[0, 0]
    assert torch.equal(visible, flex_mods.document(docs)(*grid(1, 1, n, n))[0, 0])

    def launch(ranges: torch.Tensor, check: bool = True
               ) -> tuple[dict[str, torch.Tensor], list[int]]:
        outputs, counts, verdict = launch_with_ranges(FORWARD, problem, config, shape, kernel,
                                                      traced, ranges, drawn)
        if not check:
            assert not verdict.ok, f"cuts={cuts}: the mask was applied on full tiles"
            return outputs, counts
        assert verdict.ok, f"cuts={cuts}: {verdict.message}"
        q, k, v = (drawn.tensors[x].transpose(1, 2) for x in "qkv")
        ref, _ = dense(q, k, v, float(drawn.scalars["softmax_scale"]), None, mask_mod,
                       torch.float64)
        assert (outputs["o"].transpose(1, 2).double() - ref).abs().max() < 2e-3, cuts
        return outputs, counts

    ranges = block_mask.tiles(config.block_m, config.block_n, torch.device("cpu"))
    assert int((ranges[..., 3] - ranges[..., 2]).sum()) > 0, f"cuts={cuts}: no full tiles"
    skipped_out, skipped = launch(ranges)
    expected = []
    for m in range(n // config.block_m):
        rows = visible[m * config.block_m:(m + 1) * config.block_m]
        tiles = rows.view(config.block_m, n // config.block_n, config.block_n).any(-1).any(0)
        expected.append(_mma_per_tile(dim, config) * int(tiles.sum()))
    assert skipped == expected, f"cuts={cuts}"
    tiles = n // config.block_n
    every = torch.tensor([0, tiles, 0, 0], dtype=torch.int32).expand(1, 1, 4, 4)
    walked_out, walked = launch(every.contiguous())
    assert walked != skipped and sum(walked) > sum(skipped), f"cuts={cuts}"
    torch.testing.assert_close(walked_out["o"], skipped_out["o"], atol=0, rtol=0)
    all_full = ranges.clone()
    all_full[..., 2], all_full[..., 3] = ranges[..., 0], ranges[..., 1]
    launch(all_full, check=False)


def test_block_masks_are_reused_and_cheap() -> None:
    """One build serves many calls (its tile ranges memoised per tile size)."""
    docs = torch.arange(1024) // 100
    mask = create_block_mask(flex_mods.document(docs), None, None, 1024, 1024)
    first = mask.tiles(64, 32, torch.device("cpu"))
    assert mask.tiles(64, 32, torch.device("cpu")) is first
    assert 0.8 < mask.sparsity() < 1.0
    kinds = mask.kinds()
    assert set(torch.unique(kinds).tolist()) == {0, 1, 2}


def _sdpa_case(kind: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, heads, nq, nk, dim = 2, 2, 70, 90, 64
    q = torch.randn(batch, heads, nq, dim, generator=gen).half()
    k, v = (torch.randn(batch, heads, nk, dim, generator=gen).half() for _ in "kv")
    if kind == "bool":  # per batch, broadcast over heads; row 3 of batch 1 sees nothing
        mask = torch.rand(batch, 1, nq, nk, generator=gen) < 0.7
        mask[1, 0, 3] = False
    else:  # additive, per head and position, with some -inf
        mask = torch.randn(heads, nq, nk, generator=gen) * 2
        mask[:, :, ::7] = float("-inf")
    out = flashtune.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend="emulator")
    full = mask.expand(batch, heads, nq, nk)
    if kind == "bool":
        ref, _ = dense(q, k, v, dim ** -0.5, None, lambda b, h, i, j: full[b, h, i, j],
                       torch.float64)
        low, _ = dense(q, k, v, dim ** -0.5, None, lambda b, h, i, j: full[b, h, i, j],
                       torch.float16)
    else:
        def bias(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
            return s + full[b, h, i, j]
        ref, _ = dense(q, k, v, dim ** -0.5, bias, None, torch.float64)
        low, _ = dense(q, k, v, dim ** -0.5, bias, None, torch.float16)
    bound = 2 * (low.double() - ref).abs().max().item() + 1e-5
    error = (out.double() - ref).abs().max().item()
    assert error <= bound, f"{kind} seed={seed}: max error {error:.3g} > {bound:.3g}"
    # torch's own SDPA (float32, math) agrees where a row sees some key.
    theirs = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                              attn_mask=mask)
    seen = torch.isfinite(theirs).all(-1)
    torch.testing.assert_close(theirs.double()[seen], ref[seen], atol=1e-4, rtol=1e-4)
    if kind == "bool":
        assert (out[1, :, 3] == 0).all()  # a row that sees no key: O = 0


@pytest.mark.sweep
@pytest.mark.usefixtures("dispatcher", "poisoned_outputs")
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_attn_mask(kind: str) -> None:
    _sdpa_case(kind, random.Random(f"{_SEED}-{kind}").randrange(2**31))


@pytest.mark.sweep
@pytest.mark.usefixtures("dispatcher", "poisoned_outputs")
def test_varlen_modifications_see_the_sequence_and_its_positions() -> None:
    """attention_varlen with a score_mod and a mask_mod: b is the sequence's index and
    q_idx, kv_idx are positions within it (checked per sequence against float64)."""
    gen = torch.Generator().manual_seed(_SEED)
    lens_q, lens_k, heads, dim = [40, 0, 75, 9], [50, 7, 75, 30], 2, 64
    q = torch.randn(sum(lens_q), heads, dim, generator=gen).half()
    k, v = (torch.randn(sum(lens_k), heads, dim, generator=gen).half() for _ in "kv")
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)

    def score_mod(s: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return s + 0.5 * b - 0.05 * torch.abs(q_idx - kv_idx) + 0.25 * h

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx <= q_idx + 3 * b

    out, lse = flashtune.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                          score_mod=score_mod, mask_mod=mask_mod,
                                          return_lse=True, backend="emulator")
    for b, nq in enumerate(lens_q):
        if nq == 0:
            continue
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        qb, kb, vb = (t.transpose(0, 1)[None] for t in (q[rows], k[keys], v[keys]))

        def at_b(s: Any, _: Any, h: Any, i: Any, j: Any, b: int = b) -> Any:
            return score_mod(s, b, h, i, j)

        def mask_b(_: Any, h: Any, i: Any, j: Any, b: int = b) -> Any:
            return mask_mod(b, h, i, j)

        ref, ref_lse = dense(qb, kb, vb, dim ** -0.5, at_b, mask_b, torch.float64)
        low, _ = dense(qb, kb, vb, dim ** -0.5, at_b, mask_b, torch.float16)
        got = out[rows].transpose(0, 1)[None].double()
        bound = 2 * (low.double() - ref).abs().max().item() + 1e-5
        assert (got - ref).abs().max().item() <= bound, f"sequence {b}"
        # The LSE sees what O cannot: a bias constant over a sequence (0.5 b).
        torch.testing.assert_close(lse[:, rows].double(), ref_lse[0], atol=2e-3, rtol=1e-3)
