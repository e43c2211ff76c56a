"""The decode kernel's argument list, declared once (``DECODE_ABI``): the signature of
``templates/decode_split.cu.jinja`` and the packer are generated from it.

    q (const T*), k_cache, v_cache (T*), k_new, v_new (const T*, null without appending:
    q's type, also beside an e4m3 cache),
    block_table (const int*, null when unpaged), cache_seqlens (const int*),
    o_part, lse_part (float*), status (int*),
    split_table (const int*, null: even splits), o (T*), lse (float*) (null: partials only),
    seqlen_q, seqlen_new, heads_q, heads_kv, num_splits, split_buckets, page_size, max_pages,
    num_pages, trap_on_error (int32),
    q, k_cache, v_cache, k_new, v_new, o strides in elements: batch or page, row, head (int64),
    block_table batch stride (int64), softmax_scale (float32)
    then the features' values, those of the Problem's switches only (the forward's, by the
    same names: ``fwd.args.feature_values``): window: window_left, window_right (int32);
    softcap: softcap (float32); alibi: alibi_slopes (const float*), alibi_batch_stride
    (int64); then the params of the problem's declared score modifications
    (``codegen.score_mods``: scalars, and captured tensors with their sizes), in key order.

An e4m3 cache (``DECODE8_ABI``, the ``decode8`` family): k_cache and v_cache are e4m3 bytes
(strides in values, i.e. bytes), and the float32 (batch, heads_kv) descale factors
k_descale, v_descale (const float*) follow every other argument.

An unpaged cache (batch, max_len, heads_kv, dim) is passed as ``batch`` pages of
``max_len`` rows with no block table (sequence b is page b). The grid is
(num_splits, heads_kv * m_blocks, batch) with m_blocks = ceil(group * seqlen_q / block_m).

Splits: without a table, ``num_splits`` even pieces of each sequence (``splits.split_range``);
with ``split_table`` (``splits.SplitTable.words``, (split_buckets, 2) int32), pieces of the
size of the sequence's own length bucket, chosen on the device (``num_splits`` is then the
grid's split count, ``SplitTable.grid_splits``). A launch of one split given ``o`` and ``lse``
writes O (the input type) and the LSE itself (+inf for a row that sees no key), exactly
what the combine of one split writes, and the combine is not launched.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from flashtune.codegen.abi import (
    Element,
    EntryAbi,
    PackedArgs,
    scalar,
    size,
    stride,
    strides,
    tensor,
)

if TYPE_CHECKING:
    import torch

_KV, _F, _I, _L = Element.KV, Element.FLOAT, Element.INT, Element.INT64
_PAGE_STRIDES = ("page", "row", "head")

#: The decode kernel's arguments; the caches are written in place (no ``__restrict__``:
#: the appended rows are read back through them).
DECODE_ABI = EntryAbi("decode_split", score_mods=True, args=(
    tensor("q", Element.Q, const=True), tensor("k_cache", _KV, restrict=False),
    tensor("v_cache", _KV, restrict=False),
    tensor("k_new", Element.Q, const=True, restrict=False, optional=True, wrap=True),
    tensor("v_new", Element.Q, const=True, restrict=False, optional=True),
    tensor("block_table", _I, const=True, optional=True),
    tensor("cache_seqlens", _I, const=True, wrap=True), tensor("o_part", _F),
    tensor("lse_part", _F, wrap=True), tensor("status", _I, restrict=False),
    tensor("split_table", _I, const=True, optional=True, wrap=True),
    tensor("o", Element.O, optional=True), tensor("lse", _F, optional=True),
    scalar("seqlen_q", _I, size("q", 1), wrap=True),
    scalar("seqlen_new", _I, size("k_new", 1, optional=True)),
    scalar("heads_q", _I, size("q", 2)), scalar("heads_kv", _I, size("k_cache", 2)),
    scalar("num_splits", _I),
    scalar("split_buckets", _I, size("split_table", 0, optional=True), wrap=True),
    scalar("page_size", _I, size("k_cache", 1)),
    scalar("max_pages", _I, size("block_table", 1, optional=True, default=1), wrap=True),
    scalar("num_pages", _I, size("k_cache", 0)), scalar("trap_on_error", _I),
    *strides("q"), *strides("k", "k_cache", _PAGE_STRIDES),
    *strides("v", "v_cache", _PAGE_STRIDES), *strides("kn", "k_new", optional=True),
    *strides("vn", "v_new", optional=True), *strides("o", optional=True),
    scalar("bt_batch_stride", _L, stride("block_table", 0, optional=True), wrap=True),
    scalar("softmax_scale", _F),
    scalar("window_left", _I, feature="window"), scalar("window_right", _I, feature="window"),
    scalar("softcap", _F, feature="softcap"),
    tensor("alibi_slopes", _F, const=True, feature="alibi", wrap=True),
    scalar("alibi_batch_stride", _L, feature="alibi"),
))

_pack = DECODE_ABI.packer()

#: The e4m3-cache kernel's arguments: the decode kernel's, then the caches' descale factors.
CACHE_DESCALES = ("k_descale", "v_descale")
DECODE8_ABI = DECODE_ABI.extended("decode_split8", *(
    tensor(name, _F, const=True, wrap=i == 0) for i, name in enumerate(CACHE_DESCALES)))


def pack_decode_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     k_new: torch.Tensor | None, v_new: torch.Tensor | None,
                     block_table: torch.Tensor | None, cache_seqlens: torch.Tensor,
                     o_part: torch.Tensor, lse_part: torch.Tensor, status: torch.Tensor, *,
                     num_splits: int, softmax_scale: float, trap_on_error: bool,
                     split_table: torch.Tensor | None = None, o: torch.Tensor | None = None,
                     lse: torch.Tensor | None = None, features: Collection[str] = (),
                     feature_args: Mapping[str, object] | None = None,
                     descales: tuple[torch.Tensor, torch.Tensor] | None = None) -> PackedArgs:
    """The decode kernel's arguments for these tensors (see the module docstring); a
    kernel with ``features`` on also takes their values ``feature_args`` (by name,
    ``fwd.args.feature_values``). ``split_table``: the (buckets, 2) int32
    ``SplitTable.words`` on the device, or None for ``num_splits`` even splits; ``o`` and
    ``lse``: the final outputs, written directly by a launch of one split (no combine);
    ``descales``: an e4m3 cache's (k_descale, v_descale), the ``DECODE8_ABI``'s last
    arguments."""
    if descales is not None:
        values = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k_new": k_new,
                  "v_new": v_new, "block_table": block_table, "cache_seqlens": cache_seqlens,
                  "o_part": o_part, "lse_part": lse_part, "status": status,
                  "split_table": split_table, "o": o, "lse": lse, "num_splits": num_splits,
                  "trap_on_error": int(trap_on_error), "softmax_scale": softmax_scale,
                  **(feature_args or {}), **dict(zip(CACHE_DESCALES, descales, strict=True))}
        return DECODE8_ABI.pack(values, features)
    if not features:
        return _pack(q, k_cache, v_cache, k_new, v_new, block_table, cache_seqlens, o_part,
                     lse_part, status, split_table, o, lse, num_splits, int(trap_on_error),
                     softmax_scale)
    return DECODE_ABI.packer(features)(q, k_cache, v_cache, k_new, v_new, block_table,
                                       cache_seqlens, o_part, lse_part, status, split_table,
                                       o, lse, num_splits, int(trap_on_error), softmax_scale,
                                       **(feature_args or {}))


def m_blocks(heads_q: int, heads_kv: int, seqlen_q: int, block_m: int) -> int:
    """Row blocks per (batch, kv head): the group's packed rows in blocks of block_m."""
    return -(-(heads_q // heads_kv) * seqlen_q // block_m)


def decode_grid(batch: int, heads_q: int, heads_kv: int, seqlen_q: int, block_m: int,
                num_splits: int) -> tuple[int, int, int]:
    """Launch grid: (splits, kv heads x row blocks, batch)."""
    return (num_splits, heads_kv * m_blocks(heads_q, heads_kv, seqlen_q, block_m), batch)
