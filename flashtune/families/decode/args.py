"""The decode kernel's argument list: the contract with ``templates/decode_split.cu.jinja``.

    q (const T*), k_cache, v_cache (T*), k_new, v_new (const T*, null without appending),
    block_table (const int*, null when unpaged), cache_seqlens (const int*),
    o_part, lse_part (float*), status (int*),
    seqlen_q, seqlen_new, heads_q, heads_kv, num_splits, page_size, max_pages, num_pages,
    trap_on_error (int32),
    q, k_cache, v_cache, k_new, v_new strides in elements: batch or page, row, head (int64),
    block_table batch stride (int64), softmax_scale (float32)

An unpaged cache (batch, max_len, heads_kv, dim) is passed as ``batch`` pages of
``max_len`` rows with no block table (sequence b is page b). The grid is
(num_splits, heads_kv * m_blocks, batch) with m_blocks = ceil(group * seqlen_q / block_m).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashtune._lazy import lazy_module
from flashtune.codegen.abi import ArgType, PackedArgs

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

_ZERO3 = (0, 0, 0)


def _strides(t: torch.Tensor | None) -> tuple[int, int, int]:
    if t is None:
        return _ZERO3
    s = t.stride()
    return s[0], s[1], s[2]


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def pack_decode_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     k_new: torch.Tensor | None, v_new: torch.Tensor | None,
                     block_table: torch.Tensor | None, cache_seqlens: torch.Tensor,
                     o_part: torch.Tensor, lse_part: torch.Tensor, status: torch.Tensor, *,
                     num_splits: int, softmax_scale: float, trap_on_error: bool) -> PackedArgs:
    """The decode kernel's arguments for these tensors (see the module docstring)."""
    _, seqlen_q, heads_q, _ = q.shape
    num_pages, page_size, heads_kv, _ = k_cache.shape
    seqlen_new = 0 if k_new is None else k_new.shape[1]
    max_pages = 1 if block_table is None else block_table.shape[1]
    pointers = (q, k_cache, v_cache, k_new, v_new, block_table, cache_seqlens, o_part,
                lse_part, status)
    out: list[tuple[ArgType, int | float]] = [(ArgType.PTR, _ptr(t)) for t in pointers]
    out += [(ArgType.I32, n) for n in (seqlen_q, seqlen_new, heads_q, heads_kv, num_splits,
                                        page_size, max_pages, num_pages, int(trap_on_error))]
    for t in (q, k_cache, v_cache, k_new, v_new):
        out += [(ArgType.I64, s) for s in _strides(t)]
    out.append((ArgType.I64, 0 if block_table is None else block_table.stride(0)))
    out.append((ArgType.F32, softmax_scale))
    return tuple(out)


def m_blocks(heads_q: int, heads_kv: int, seqlen_q: int, block_m: int) -> int:
    """Row blocks per (batch, kv head): the group's packed rows in blocks of block_m."""
    return -(-(heads_q // heads_kv) * seqlen_q // block_m)


def decode_grid(batch: int, heads_q: int, heads_kv: int, seqlen_q: int, block_m: int,
                num_splits: int) -> tuple[int, int, int]:
    """Launch grid: (splits, kv heads x row blocks, batch)."""
    return (num_splits, heads_kv * m_blocks(heads_q, heads_kv, seqlen_q, block_m), batch)
