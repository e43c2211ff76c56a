"""Inputs and the float64 reference of MLA decoding.

A call's sizes beyond its Shape (batch, heads_q, heads_kv = 1, seqlen_q, seqlen_k = the
cache capacity per sequence) are a ``DecodeCase`` of the decode family (page size, per-
sequence cache lengths, split count) without appended rows: the query rows' own latent rows
are already in the cache. Latent rows that no sequence may read (past its length, and the
spare pages no block table names) hold NaN, so a kernel that reads one fails verification;
block-table slots a sequence does not use hold -1.

FP8 latent cache (``space.fp8_cache``, FlashMLA's 656-byte rows, ``mla.fp8``): a random bf16
latent quantised by ``fp8.quantize_latent``, then each group's scale multiplied by a factor
drawn from [0.75, 1.25) in 1 of 2 groups (so the kernel's float32 product and bf16 rounding
are exercised, not only exact power-of-two scales); unreadable rows hold NaN codes (0x7F),
NaN scales and NaN RoPE values. The reference dequantises the rows as the kernel does
(``fp8.dequantize_latent``), then computes in float64.

Reference, from the definition: sequence b's keys are its first cache_seqlens[b] latent
rows (through the block table when paged: position j is row j % page_size of page
block_table[b, j // page_size]); scores = q . latent * scale over all 512 + RoPE dims, V =
the first 512 dims of the same rows; split s covers keys ``decode.splits.split_range``;
query position i sees key j iff j <= i + cache_len - seqlen_q when causal. Partial O is
normalised within its split; a row that sees no key of a split has O = 0, LSE = -inf.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashtune._lazy import lazy_module
from flashtune.codegen.spec import Problem, Shape
from flashtune.errors import InvalidInput
from flashtune.families.base import Inputs, torch_dtype
from flashtune.families.decode.inputs import SPARE_PAGES, DecodeCase
from flashtune.families.decode.reference import partial_attention
from flashtune.families.decode.splits import split_range
from flashtune.families.mla import fp8
from flashtune.families.mla.space import NOPE_DIM, fp8_cache, latent_dim

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


def make_inputs(problem: Problem, shape: Shape, case: DecodeCase, device: torch.device | str,
                gen: torch.Generator) -> Inputs:
    """Random inputs of ``case`` (no appended rows): q (batch, seqlen_q, heads_q, latent),
    kv_cache (num_pages, page_size, 1, latent) or unpaged (batch, capacity, 1, latent),
    cache_seqlens, block_table (paged). Scalars: softmax_scale (latent ** -0.5, a convention
    of the tests: DeepSeek scales by the query/key head dim 192), num_splits."""
    if case.seqlen_new or shape.heads_kv != 1:
        raise InvalidInput(f"an MLA case has one latent head and no appended rows, got "
                           f"heads_kv={shape.heads_kv}, seqlen_new={case.seqlen_new}")
    case.check(shape)
    dt, width, b = torch_dtype(problem.dtype), latent_dim(problem), shape.batch
    q = torch.randn(b, shape.seqlen_q, shape.heads_q, width, generator=gen, device=device)
    ends = torch.tensor(case.cache_seqlens, device=device)
    tensors: dict[str, torch.Tensor] = {"q": q.to(dt)}
    if case.page_size is None:
        live = torch.arange(shape.seqlen_k, device=device)[None, :] < ends[:, None]
        pool = torch.randn(b, shape.seqlen_k, 1, width, generator=gen, device=device)
    else:
        page, slots = case.page_size, case.max_pages(shape)
        num_pages = b * slots + SPARE_PAGES
        order = torch.randperm(num_pages, generator=gen, device=gen.device).to(device)
        table = order[: b * slots].view(b, slots).to(torch.int32)
        used = -(-ends // page)
        table = table.masked_fill(torch.arange(slots, device=device)[None, :] >= used[:, None],
                                  -1)
        live = torch.zeros(num_pages, page, dtype=torch.bool, device=device)
        positions = torch.arange(slots * page, device=device).view(slots, page)
        for i in range(b):
            for s in range(int(used[i])):
                live[int(table[i, s])] = positions[s] < int(ends[i])
        pool = torch.randn(num_pages, page, 1, width, generator=gen, device=device)
        tensors["block_table"] = table.contiguous()
    if fp8_cache(problem):
        tensors["kv_cache"] = _fp8_pool(pool, live, gen)
    else:
        tensors["kv_cache"] = pool.masked_fill(~live[..., None, None], float("nan")).to(dt)
    tensors["cache_seqlens"] = ends.to(torch.int32)
    return Inputs(tensors, {"softmax_scale": width ** -0.5, "num_splits": case.num_splits})


def _fp8_pool(pool: torch.Tensor, live: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """FP8 rows (..., 656) of the float32 latent pool (..., 576): quantised, half the scales
    moved off powers of two, rows where ``live`` is False poisoned with NaN."""
    raw = fp8.quantize_latent(pool.to(torch.bfloat16)).view(torch.uint8).clone()
    scales = raw[..., fp8.SCALE_OFFSET:fp8.ROPE_OFFSET].contiguous().view(torch.float32)
    factor = 0.75 + 0.5 * torch.rand(scales.shape, generator=gen, device=gen.device)
    moved = torch.rand(scales.shape, generator=gen, device=gen.device) < 0.5
    scales = torch.where(moved.to(scales.device), scales * factor.to(scales.device), scales)
    raw[..., fp8.SCALE_OFFSET:fp8.ROPE_OFFSET] = scales.view(torch.uint8)
    dead = ~live[..., None, None]
    raw[..., : fp8.NOPE] = raw[..., : fp8.NOPE].masked_fill(dead, 0x7F)
    nan_scale = torch.tensor([float("nan")], dtype=torch.float32).view(torch.uint8)
    nan_rope = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8)
    raw[..., fp8.SCALE_OFFSET:fp8.ROPE_OFFSET] = torch.where(
        dead, nan_scale.repeat(fp8.SCALES).to(raw.device),
        raw[..., fp8.SCALE_OFFSET:fp8.ROPE_OFFSET])
    raw[..., fp8.ROPE_OFFSET:] = torch.where(
        dead, nan_rope.repeat(fp8.ROPE).to(raw.device), raw[..., fp8.ROPE_OFFSET:])
    return raw.view(torch.float8_e4m3fn)


def sequence_latents(inputs: Inputs) -> list[torch.Tensor]:
    """Per sequence, its latent rows (cache_len, latent) in float64 (an FP8 cache's
    dequantised as the kernel does)."""
    t = inputs.tensors
    cache, table = t["kv_cache"], t.get("block_table")
    if fp8.is_fp8_cache(cache):
        cache = fp8.dequantize_latent(cache)
    out = []
    for b, length in enumerate(t["cache_seqlens"].tolist()):
        positions = torch.arange(length, device=cache.device)
        if table is None:
            rows = cache[b, positions, 0]
        else:
            page_size = cache.shape[1]
            rows = cache[table[b, positions // page_size].long(), positions % page_size, 0]
        out.append(rows.to(torch.float64))
    return out


def mla_reference(inputs: Inputs, causal: bool) -> dict[str, torch.Tensor]:
    """Partial O (splits, batch, heads_q, seqlen_q, 512) and LSE (splits, batch, heads_q,
    seqlen_q) in float64 (the module docstring's definition)."""
    q = inputs.tensors["q"]
    batch, seqlen_q, heads_q, _ = q.shape
    splits = int(inputs.scalars["num_splits"])
    scale = float(inputs.scalars["softmax_scale"])
    o_part = torch.zeros(splits, batch, heads_q, seqlen_q, NOPE_DIM, dtype=torch.float64,
                         device=q.device)
    lse_part = torch.full((splits, batch, heads_q, seqlen_q), float("-inf"),
                          dtype=torch.float64, device=q.device)
    for b, latent in enumerate(sequence_latents(inputs)):
        total = latent.shape[0]
        keys, values = latent[:, None, :], latent[:, None, :NOPE_DIM]
        for s in range(splits):
            begin, end = split_range(total, splits, s)
            if begin == end:
                break  # this split and all later ones are empty
            o, lse = partial_attention(q[b], keys, values, begin, end, total, causal, scale)
            o_part[s, b] = o.permute(1, 0, 2)
            lse_part[s, b] = lse
    return {"o_part": o_part, "lse_part": lse_part}
