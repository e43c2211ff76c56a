"""The argument lists of the backward kernels, declared once each (``MAIN_ABI``,
``PRE_ABI``, ``SUM_ABI``): their templates' signatures and packers are generated from them.

Main kernel (``flash_bwd.cu.jinja``):

    q, k, v, do (const T*), lse, dsum (const float*), dk, dv (T*), dq_accum (float*),
    seqlen_q, seqlen_k, heads_q, heads_kv (int32),
    q, k, v, do, dk, dv strides in elements: batch, row, head (int64 each, 18 in all),
    softmax_scale (float32)
    then the features' values, those of the Problem's switches only (the forward's, by the
    same names: ``fwd.args.feature_values``): window: window_left, window_right (int32);
    softcap: softcap (float32); alibi: alibi_slopes (const float*), alibi_batch_stride
    (int64); varlen: cu_seqlens_q, cu_seqlens_k (const int*, batch + 1 each); dropout:
    dropout_seed, dropout_offset (int64), dropout_p (float32); with declared score
    modifications, dscore (float*, may be null: float32 (B, Hq, Nq, Nk), zeroed, receives
    the gradients by the modified scores; varlen: (sequences, Hq, longest Nq, longest Nk),
    sequence b's positions at its top left), dscore_rows and dscore_cols (int32: its last
    two dims) and then the modifications' params, in key order.

Preprocess (``bwd_pre.cu.jinja``): o, do (const T*), dsum, dq_accum (float*), seqlen_q,
heads_q, dq_slices (int32), o and do strides (6 x int64).

Convert (``bwd_sum.cu.jinja``): dq_accum (const float*), dq (T*), seqlen_q, heads_q,
dq_slices (int32), dq strides (3 x int64), softmax_scale (float32).

Q, dO, O, dQ are (batch, seqlen_q, heads_q, dim); K, V, dK, dV (batch, seqlen_k, heads_kv,
dim), each with a contiguous last dim; LSE and D are contiguous float32 (batch, heads_q,
seqlen_q); the dQ accumulator is contiguous float32 (slices, batch, heads_q, seqlen_q, dim).
With varlen they are the forward's packed layout: a batch dim of 1 and seqlen_q, seqlen_k the
total rows (Q, dO, O, dQ (1, total_q, heads_q, dim), K, V, dK, dV (1, total_k, heads_kv,
dim), LSE and D (1, heads_q, total_q), the accumulator (slices, 1, heads_q, total_q, dim)),
and the main kernel's grid is (key tiles of the longest key sequence, or the dQ slices,
kv heads (times the output column chunks of a head dim above 256), number of sequences).
The preprocess and the convert are row-wise with no mask,
so a packed batch is to them the batch of one sequence of total_q rows.
The packers run on every backward call: they are the ABIs' generated straight-line code.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from flashtune.codegen.abi import (
    WITH_SCORE_MODS,
    Element,
    EntryAbi,
    scalar,
    size,
    strides,
    tensor,
)
from flashtune.families.fwd.args import DROPOUT_ARGS, VARLEN_ARGS
from flashtune.families.launch_args import grid

if TYPE_CHECKING:
    import torch

_Q, _KV, _O, _F, _I = Element.Q, Element.KV, Element.O, Element.FLOAT, Element.INT

#: The main kernel's arguments (``flash_bwd.cu.jinja``); dO has O's element type.
MAIN_ABI = EntryAbi("flash_bwd", (
    tensor("q", _Q, const=True), tensor("k", _KV, const=True),
    tensor("v", _KV, const=True, wrap=True), tensor("dout", _O, const=True),
    tensor("lse", _F, const=True, wrap=True), tensor("dsum", _F, const=True),
    tensor("dk", _KV, wrap=True), tensor("dv", _KV), tensor("dq_accum", _F),
    scalar("seqlen_q", _I, size("q", 1), wrap=True), scalar("seqlen_k", _I, size("k", 1)),
    scalar("heads_q", _I, size("q", 2)), scalar("heads_kv", _I, size("k", 2)),
    *strides("q"), *strides("k"), *strides("v"), *strides("do", "dout"), *strides("dk"),
    *strides("dv"),
    scalar("softmax_scale", _F, wrap=True),
    scalar("window_left", _I, feature="window"), scalar("window_right", _I, feature="window"),
    scalar("softcap", _F, feature="softcap"),
    tensor("alibi_slopes", _F, const=True, feature="alibi", wrap=True),
    scalar("alibi_batch_stride", Element.INT64, feature="alibi"),
    *VARLEN_ARGS,
    *DROPOUT_ARGS,
    tensor("dscore", _F, optional=True, feature=WITH_SCORE_MODS, wrap=True),
    scalar("dscore_rows", _I, feature=WITH_SCORE_MODS),
    scalar("dscore_cols", _I, feature=WITH_SCORE_MODS),
), score_mods=True)

#: The preprocess kernel's arguments (``bwd_pre.cu.jinja``).
PRE_ABI = EntryAbi("bwd_pre", (
    tensor("o", _O, const=True), tensor("dout", _O, const=True), tensor("dsum", _F),
    tensor("dq_accum", _F, wrap=True), scalar("seqlen_q", _I, size("o", 1)),
    scalar("heads_q", _I, size("o", 2)), scalar("dq_slices", _I, size("dq_accum", 0)),
    *strides("o"), *strides("do", "dout"),
))

_DQ_STRIDES = strides("dq", wrap=False)

#: The convert kernel's arguments (``bwd_sum.cu.jinja``).
SUM_ABI = EntryAbi("bwd_sum", (
    tensor("dq_accum", _F, const=True), tensor("dq", _Q),
    scalar("seqlen_q", _I, size("dq", 1)), scalar("heads_q", _I, size("dq", 2)),
    scalar("dq_slices", _I, size("dq_accum", 0), wrap=True),
    _DQ_STRIDES[0], _DQ_STRIDES[1], dataclasses.replace(_DQ_STRIDES[2], wrap=True),
    scalar("softmax_scale", _F),
))

#: The plain main kernel's arguments for (q, k, v, dout, lse, dsum, dk, dv, dq_accum,
#: softmax_scale); with features, ``MAIN_ABI.packer(features)`` takes their values after.
main_args = MAIN_ABI.packer()
#: The preprocess kernel's arguments (D into ``dsum``, zeros into ``dq_accum``) for
#: (o, dout, dsum, dq_accum).
pre_args = PRE_ABI.packer()
#: The convert kernel's arguments (the accumulator's slices into ``dq``) for
#: (dq_accum, dq, softmax_scale).
sum_args = SUM_ABI.packer()

#: Grid of the preprocess and convert kernels: (query tiles, query heads, batch).
row_grid = grid


def dscore_values(dscore: torch.Tensor | None) -> dict[str, object]:
    """The main kernel's dscore arguments: the buffer (or None) and its last two dims."""
    rows, cols = (0, 0) if dscore is None else (int(dscore.shape[2]), int(dscore.shape[3]))
    return {"dscore": dscore, "dscore_rows": rows, "dscore_cols": cols}


def main_grid(seqlen_k: int, heads_kv: int, batch: int, block_n: int, dq_slices: int | None,
              chunks: int = 1) -> tuple[int, int, int]:
    """Grid of the main kernel: (key tiles, or the dQ slices of the split mode, kv heads x
    the config's output column chunks, batch)."""
    key_tiles = (seqlen_k + block_n - 1) // block_n
    blocks = key_tiles if dq_slices is None else min(dq_slices, key_tiles)
    return (blocks, heads_kv * chunks, batch)
