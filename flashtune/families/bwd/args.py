"""The argument lists of the backward kernels: the contract with their templates.

Main kernel (``flash_bwd.cu.jinja``):

    q, k, v, do (const T*), lse, dsum (const float*), dk, dv (T*), dq_accum (float*),
    seqlen_q, seqlen_k, heads_q, heads_kv (int32),
    q, k, v, do, dk, dv strides in elements: batch, row, head (int64 each, 18 in all),
    softmax_scale (float32)

Preprocess (``bwd_pre.cu.jinja``): o, do (const T*), dsum, dq_accum (float*), seqlen_q,
heads_q, dq_slices (int32), o and do strides (6 x int64).

Convert (``bwd_sum.cu.jinja``): dq_accum (const float*), dq (T*), seqlen_q, heads_q,
dq_slices (int32), dq strides (3 x int64), softmax_scale (float32).

Q, dO, O, dQ are (batch, seqlen_q, heads_q, dim); K, V, dK, dV (batch, seqlen_k, heads_kv,
dim), each with a contiguous last dim; LSE and D are contiguous float32 (batch, heads_q,
seqlen_q); the dQ accumulator is contiguous float32 (slices, batch, heads_q, seqlen_q, dim).
These run on every backward call, so they are built as flat tuples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashtune._lazy import lazy_module
from flashtune.codegen.abi import ArgType, PackedArgs

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

_P, _I, _L, _F = ArgType.PTR, ArgType.I32, ArgType.I64, ArgType.F32

MAIN_ARG_TYPES: tuple[ArgType, ...] = (_P,) * 9 + (_I,) * 4 + (_L,) * 18 + (_F,)
PRE_ARG_TYPES: tuple[ArgType, ...] = (_P,) * 4 + (_I,) * 3 + (_L,) * 6
SUM_ARG_TYPES: tuple[ArgType, ...] = (_P,) * 2 + (_I,) * 3 + (_L,) * 3 + (_F,)


def _strides(*tensors: torch.Tensor) -> tuple[int, ...]:
    out: list[int] = []
    for t in tensors:
        s = t.stride()
        out += (s[0], s[1], s[2])
    return tuple(out)


def main_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
              lse: torch.Tensor, dsum: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
              dq_accum: torch.Tensor, softmax_scale: float) -> PackedArgs:
    """The main kernel's arguments for these tensors."""
    _, seqlen_q, heads_q, _ = q.shape
    _, seqlen_k, heads_kv, _ = k.shape
    values = (q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), lse.data_ptr(),
              dsum.data_ptr(), dk.data_ptr(), dv.data_ptr(), dq_accum.data_ptr(),
              seqlen_q, seqlen_k, heads_q, heads_kv,
              *_strides(q, k, v, dout, dk, dv), softmax_scale)
    return tuple(zip(MAIN_ARG_TYPES, values, strict=True))


def pre_args(out: torch.Tensor, dout: torch.Tensor, dsum: torch.Tensor,
             dq_accum: torch.Tensor) -> PackedArgs:
    """The preprocess kernel's arguments (D into ``dsum``, zeros into ``dq_accum``)."""
    _, seqlen_q, heads_q, _ = out.shape
    values = (out.data_ptr(), dout.data_ptr(), dsum.data_ptr(), dq_accum.data_ptr(),
              seqlen_q, heads_q, dq_accum.shape[0], *_strides(out, dout))
    return tuple(zip(PRE_ARG_TYPES, values, strict=True))


def sum_args(dq_accum: torch.Tensor, dq: torch.Tensor, softmax_scale: float) -> PackedArgs:
    """The convert kernel's arguments (the accumulator's slices into ``dq``)."""
    _, seqlen_q, heads_q, _ = dq.shape
    values = (dq_accum.data_ptr(), dq.data_ptr(), seqlen_q, heads_q, dq_accum.shape[0],
              *_strides(dq), softmax_scale)
    return tuple(zip(SUM_ARG_TYPES, values, strict=True))


def row_grid(seqlen_q: int, heads_q: int, batch: int, block_m: int) -> tuple[int, int, int]:
    """Grid of the preprocess and convert kernels: (query tiles, query heads, batch)."""
    return ((seqlen_q + block_m - 1) // block_m, heads_q, batch)


def main_grid(seqlen_k: int, heads_kv: int, batch: int, block_n: int, dq_slices: int | None
              ) -> tuple[int, int, int]:
    """Grid of the main kernel: (key tiles, or the dQ slices of the split mode, kv heads,
    batch)."""
    key_tiles = (seqlen_k + block_n - 1) // block_n
    blocks = key_tiles if dq_slices is None else min(dq_slices, key_tiles)
    return (blocks, heads_kv, batch)
