"""The MLA decode kernel's argument list, declared once (``MLA_ABI``): the signature of
``templates/mla_decode.cu.jinja`` and the packer are generated from it.

    q (const T*), kv_cache (const T*), block_table (const int*, null when unpaged),
    cache_seqlens (const int*), o_part, lse_part (float*), status (int*),
    seqlen_q, heads_q, num_splits, page_size, max_pages, num_pages, trap_on_error (int32),
    q strides in elements: batch, row, head; kv_cache strides: page, row (int64),
    block_table batch stride (int64), softmax_scale (float32).

q is (batch, seqlen_q, heads_q, latent); the latent cache is (num_pages, page_size, 1,
latent) (FlashMLA's layout: one kv head). An unpaged cache (batch, max_len, 1, latent) is
passed as ``batch`` pages of ``max_len`` rows with no block table (sequence b is page b).
The grid is (num_splits, m_blocks, batch), m_blocks = ceil(heads_q * seqlen_q / block_m).
"""

from __future__ import annotations

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

_F, _I, _L = Element.FLOAT, Element.INT, Element.INT64

MLA_ABI = EntryAbi("mla_decode", (
    tensor("q", Element.Q, const=True), tensor("kv_cache", Element.KV, const=True),
    tensor("block_table", _I, const=True, optional=True),
    tensor("cache_seqlens", _I, const=True, wrap=True), tensor("o_part", _F),
    tensor("lse_part", _F), tensor("status", _I, restrict=False),
    scalar("seqlen_q", _I, size("q", 1), wrap=True), scalar("heads_q", _I, size("q", 2)),
    scalar("num_splits", _I), scalar("page_size", _I, size("kv_cache", 1)),
    scalar("max_pages", _I, size("block_table", 1, optional=True, default=1), wrap=True),
    scalar("num_pages", _I, size("kv_cache", 0)), scalar("trap_on_error", _I),
    *strides("q"), *strides("kv", "kv_cache", ("page", "row")),
    scalar("bt_batch_stride", _L, stride("block_table", 0, optional=True), wrap=True),
    scalar("softmax_scale", _F),
))

_pack = MLA_ABI.packer()


def pack_mla_args(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor | None,
                  cache_seqlens: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor,
                  status: torch.Tensor, *, num_splits: int, softmax_scale: float,
                  trap_on_error: bool) -> PackedArgs:
    """The MLA decode kernel's arguments for these tensors (see the module docstring)."""
    return _pack(q, kv_cache, block_table, cache_seqlens, o_part, lse_part, status, num_splits,
                 int(trap_on_error), softmax_scale)


def mla_grid(batch: int, heads_q: int, seqlen_q: int, block_m: int, num_splits: int
             ) -> tuple[int, int, int]:
    """Launch grid: (splits, row blocks of the packed heads x query rows, batch)."""
    return (num_splits, -(-heads_q * seqlen_q // block_m), batch)
