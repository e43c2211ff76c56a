"""The float64 reference of split-KV decoding, written from the definition.

Sequence b's keys are its first cache_seqlens[b] cache rows (through the block table when
paged: position j is row j % page_size of page block_table[b, j // page_size]) followed by
the appended rows; the expected caches afterwards hold the appended rows at positions
cache_seqlens[b] + n. Split s covers keys ``splits.split_range`` (``SplitTable.split_range``
with a table); query position i sees key j iff j <= i + total - seqlen_q when causal; query
head h reads kv head h // group. Partial O is normalised within its split; a row that sees
no key of a split has O = 0 and LSE = -inf there.

Features (the forward's reference, ``fwd.reference.scaled_scores``, with Nk = total, the
sequence's keys after appending, and Nq = seqlen_q): a window, softcap and ALiBi apply to
each sequence's scores over all its keys before the split's keys are taken. Declared score
modifications (``codegen.score_mods``) then apply to them with the sequence's batch index,
the query head, q_idx = i + total - seqlen_q (the row's absolute position) and kv_idx = j.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from flashtune._lazy import lazy_module
from flashtune.codegen.score_mods import ScoreMod
from flashtune.families.base import Inputs
from flashtune.families.decode.splits import SplitTable, split_range
from flashtune.families.fwd.reference import scaled_scores
from flashtune.families.fwd.variants import VariantValues

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


def _positions(t: dict[str, torch.Tensor], b: int, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, row) of cache positions of sequence b."""
    table = t.get("block_table")
    if table is None:
        return torch.full_like(positions, b), positions
    page_size = t["k_cache"].shape[1]
    return table[b, positions // page_size].long(), positions % page_size


def sequence_keys(inputs: Inputs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence, its keys and values (total, heads_kv, dim) in float64, from the caches
    as drawn (``*_before``) and the new rows; an FP8 cache's rows times the sequence's own
    descale factors (``k_descale``, ``v_descale``: (batch, heads_kv)), so a page two
    sequences share is dequantised with each one's factors."""
    t = dict(inputs.tensors)
    out = []
    for b, length in enumerate(t["cache_seqlens"].tolist()):
        pages, rows = _positions(t, b, torch.arange(length, device=t["q"].device))
        kv = []
        for name in ("k", "v"):
            cached = t[f"{name}_cache_before"][pages, rows].to(torch.float64)
            if f"{name}_descale" in t:
                cached = cached * t[f"{name}_descale"][b].to(torch.float64)[None, :, None]
            if f"{name}_new" in t:
                cached = torch.cat([cached, t[f"{name}_new"][b].to(torch.float64)])
            kv.append(cached)
        out.append((kv[0], kv[1]))
    return out


def expected_caches(inputs: Inputs) -> dict[str, torch.Tensor]:
    """The caches after the call: as drawn, with the new rows written at their positions."""
    t = dict(inputs.tensors)
    out = {name: t[f"{name}_before"].clone() for name in ("k_cache", "v_cache")}
    if "k_new" not in t:
        return out
    seqlen_new = t["k_new"].shape[1]
    for b, length in enumerate(t["cache_seqlens"].tolist()):
        positions = torch.arange(length, length + seqlen_new, device=t["q"].device)
        pages, rows = _positions(t, b, positions)
        for name in ("k", "v"):
            out[f"{name}_cache"][pages, rows] = t[f"{name}_new"][b]
    return out


def _slopes(variant: VariantValues | None, b: int) -> torch.Tensor | None:
    """Sequence b's ALiBi slopes (heads_q,), or None."""
    slopes = None if variant is None else variant.alibi_slopes
    if slopes is None:
        return None
    return slopes[b] if slopes.dim() == 2 else slopes


def partial_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, begin: int,
                      end: int, total: int, causal: bool, scale: float,
                      variant: VariantValues | None = None, batch: int = 0,
                      mods: Sequence[ScoreMod] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """O (seqlen_q, heads_q, dim) normalised over keys [begin, end) and LSE (heads_q,
    seqlen_q) of sequence ``batch`` in float64, with the features of ``variant`` (None:
    none) and the declared modifications ``mods`` (their params from ``variant.mods``);
    rows that see none of them: O = 0, LSE = -inf."""
    seqlen_q, heads_q, dim = q.shape
    group = heads_q // keys.shape[1]
    k = keys[:total].repeat_interleave(group, dim=1)
    v = values[begin:end].repeat_interleave(group, dim=1)
    softcap = variant.softcap if variant is not None and variant.softcap > 0 else None
    window = variant.window if variant is not None else (-1, -1)
    # New row i is at position i + total - seqlen_q: the modifications' q_idx.
    scores = scaled_scores(q.to(torch.float64)[None], k[None], scale, causal, window=window,
                           softcap=softcap, alibi_slopes=_slopes(variant, batch), mods=mods,
                           mod_values=variant.mods if variant is not None else {},
                           first_batch=batch, mod_row0=total - seqlen_q)[0]
    scores = scores[..., begin:end]
    lse = torch.logsumexp(scores, dim=-1) if end > begin else torch.full(
        (heads_q, seqlen_q), float("-inf"), dtype=torch.float64, device=q.device)
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0)[..., None])
    o = torch.einsum("hqk,khd->qhd", probs, v)
    return o, lse


def split_table_of(inputs: Inputs) -> SplitTable | None:
    """The split table of the inputs (their ``split_table`` words), or None."""
    words = inputs.tensors.get("split_table")
    if words is None:
        return None
    pairs = [tuple(int(w) for w in row) for row in words.tolist()]
    return SplitTable(tuple(b for b, _ in pairs[:-1]), tuple(s for _, s in pairs))


def decode_reference(inputs: Inputs, causal: bool, variant: VariantValues | None = None,
                     mods: Sequence[ScoreMod] = ()) -> dict[str, torch.Tensor]:
    """Partial O (splits, batch, heads_q, seqlen_q, V's head dim) and LSE (splits, batch, heads_q,
    seqlen_q) in float64 with the features of ``variant`` and the declared modifications
    ``mods``, and the expected caches."""
    q = inputs.tensors["q"]
    batch, seqlen_q, heads_q, _ = q.shape
    dim = inputs.tensors["v_cache"].shape[3]  # V's (and O's) head dim
    splits = int(inputs.scalars["num_splits"])
    scale = float(inputs.scalars["softmax_scale"])
    o_part = torch.zeros(splits, batch, heads_q, seqlen_q, dim, dtype=torch.float64,
                         device=q.device)
    lse_part = torch.full((splits, batch, heads_q, seqlen_q), float("-inf"),
                          dtype=torch.float64, device=q.device)
    table = split_table_of(inputs)
    for b, (keys, values) in enumerate(sequence_keys(inputs)):
        total = keys.shape[0]
        for s in range(splits):
            begin, end = (split_range(total, splits, s) if table is None
                          else table.split_range(total, s))
            if begin == end:
                break  # this split and all later ones are empty
            o, lse = partial_attention(q[b], keys, values, begin, end, total, causal, scale,
                                       variant, b, mods)
            o_part[s, b] = o.permute(1, 0, 2)
            lse_part[s, b] = lse
    return {"o_part": o_part, "lse_part": lse_part, **expected_caches(inputs)}


def attention_with_kvcache_reference(inputs: Inputs, causal: bool,
                                     variant: VariantValues | None = None
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """O (batch, seqlen_q, heads_q, dim) and LSE (batch, heads_q, seqlen_q) over all keys in
    float64, as the API returns them: a row that sees no key has O = 0 and LSE = +inf."""
    q = inputs.tensors["q"]
    scale = float(inputs.scalars["softmax_scale"])
    outs, lses = [], []
    for b, (keys, values) in enumerate(sequence_keys(inputs)):
        total = keys.shape[0]
        o, lse = partial_attention(q[b], keys, values, 0, total, total, causal, scale,
                                   variant, b)
        outs.append(o)
        lses.append(lse.masked_fill(torch.isneginf(lse), float("inf")))
    return torch.stack(outs), torch.stack(lses)
