"""``flashtune.attention_varlen``: attention over sequences of different lengths packed along
the rows, in flash-attn's varlen layout.

The call is the custom op ``flashtune::attention_varlen_fwd`` (with a fake implementation,
so torch.compile traces it as one node); a plain eager call with nothing observing
operators calls the implementation directly. The kernel reads the cumulative lengths on the
device: nothing synchronises with the host.

Gradients: the op's autograd formula runs the backward kernels on the packed tensors
through a second custom op, ``flashtune::attention_varlen_bwd`` (with a fake
implementation, so torch.compile traces the backward graph too): dQ, dK, dV, the sinks'
gradient, with the forward's features (dropout's mask drawn again from its seed and
offset); ``deterministic`` as in ``flashtune.attention``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, overload

import torch

from flashtune.api import backward as _bwd
from flashtune.api import dropout as _dropout
from flashtune.api import forward as _fwd
from flashtune.api import fp8 as _fp8
from flashtune.api.flex import MaskModFn, ScoreModFn, modified_forward, refuse_grad
from flashtune.api.limits import check_softmax_scale
from flashtune.api.ops import deterministic_flag, direct_call_ok
from flashtune.api.validate import check_attention_inputs, check_fp8_attention_inputs
from flashtune.api.validate_varlen import check_varlen_inputs
from flashtune.api.variants import (
    NO_WINDOW,
    Variant,
    pad_head_dim,
    refuse_unsupported,
    resolve,
)
from flashtune.errors import InvalidInput
from flashtune.families.fwd.args import DropoutArgs, VarlenArgs

OP_NAME = "flashtune::attention_varlen_fwd"
BWD_OP_NAME = "flashtune::attention_varlen_bwd"


def _variant(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
             max_seqlen_k: int, causal: bool, window_left: int, window_right: int,
             softcap: float, alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None,
             dropout_p: float, dropout_seed: int, dropout_offset: int) -> Variant:
    """The Variant of the ops' arguments (the dropout's seed as a signed int64)."""
    varlen = VarlenArgs(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dropout = (DropoutArgs(dropout_seed % 2**64, dropout_offset, dropout_p)
               if dropout_p > 0.0 else None)
    return Variant(causal, (window_left, window_right), softcap, alibi_slopes, varlen,
                   sinks=sinks, dropout=dropout)


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: Variant,
         softmax_scale: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _fwd.forward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), variant.causal,
                            softmax_scale, backend, variant)
    return out[0], lse[0]


@torch.library.custom_op(OP_NAME, mutates_args=())
def attention_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                         softmax_scale: float, backend: str, window_left: int,
                         window_right: int, softcap: float,
                         alibi_slopes: torch.Tensor | None,
                         sinks: torch.Tensor | None = None, dropout_p: float = 0.0,
                         dropout_seed: int = 0, dropout_offset: int = 0,
                         deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """O (total_q, Hq, D) and LSE (Hq, total_q) of validated, resolved inputs (the
    dropout's seed as a signed int64, ``DropoutArgs.signed_seed``). ``deterministic`` only
    matters to the backward (an argument here so the autograd formula sees it)."""
    variant = _variant(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                       window_left, window_right, softcap, alibi_slopes, sinks, dropout_p,
                       dropout_seed, dropout_offset)
    return _run(q, k, v, variant, softmax_scale, backend)


@attention_varlen_fwd.register_fake
def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
          cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
          softmax_scale: float, backend: str, window_left: int, window_right: int,
          softcap: float, alibi_slopes: torch.Tensor | None,
          sinks: torch.Tensor | None = None, dropout_p: float = 0.0,
          dropout_seed: int = 0, dropout_offset: int = 0, deterministic: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
    return (q.new_empty((*q.shape[:2], v.shape[2])),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


@torch.library.custom_op(BWD_OP_NAME, mutates_args=())
def attention_varlen_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                         grad_lse: torch.Tensor | None, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                         causal: bool, softmax_scale: float, deterministic: bool,
                         backend: str, window_left: int, window_right: int, softcap: float,
                         alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None,
                         dropout_p: float, dropout_seed: int, dropout_offset: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ (total_q, Hq, D), dK, dV (total_k, Hkv, D) of the forward that produced ``out``
    and ``lse`` (Hq, total_q), with its features, and the gradient of ``sinks`` (an empty
    float32 tensor without sinks)."""
    variant = _variant(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                       window_left, window_right, softcap, alibi_slopes, sinks, dropout_p,
                       dropout_seed, dropout_offset)
    dq, dk, dv, dsinks = _bwd.backward(
        grad_out.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
        out.unsqueeze(0), lse.unsqueeze(0), None if grad_lse is None else grad_lse.unsqueeze(0),
        causal, softmax_scale, deterministic, backend, variant)
    return (dq[0], dk[0], dv[0],
            q.new_empty(0, dtype=torch.float32) if dsinks is None else dsinks)


@attention_varlen_bwd.register_fake
def _bwd_fake(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, grad_lse: torch.Tensor | None,
              cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
              max_seqlen_k: int, causal: bool, softmax_scale: float, deterministic: bool,
              backend: str, window_left: int, window_right: int, softcap: float,
              alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None,
              dropout_p: float, dropout_seed: int, dropout_offset: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dsinks = (q.new_empty(0, dtype=torch.float32) if sinks is None
              else torch.empty_like(sinks, dtype=torch.float32))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, backend, window_left, window_right,
     softcap, alibi_slopes) = inputs[:14]
    sinks = inputs[14] if len(inputs) > 14 else None
    ctx.dropout = tuple(inputs[15:18]) or (0.0, 0, 0)
    ctx.deterministic = bool(inputs[18]) if len(inputs) > 18 else False
    ctx.scalars = (max_q, max_k, causal, scale, ctx.deterministic, backend, window_left,
                   window_right, softcap)
    ctx.features = _variant(cu_q, cu_k, max_q, max_k, causal, window_left, window_right,
                            softcap, alibi_slopes, sinks, *ctx.dropout).features
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sinks)


def _backward(ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
              ) -> tuple[Any, ...]:
    """Gradients of the forward op's inputs: q, k, v and sinks (None for the others);
    FeatureNotSupported for features the backward families do not implement."""
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sinks = ctx.saved_tensors
    max_q, max_k, causal, scale, deterministic, backend, left, right, softcap = ctx.scalars
    refuse_unsupported("bwddet" if deterministic else "bwd", ctx.features, q.unsqueeze(0),
                       "flashtune.attention_varlen's backward pass")
    dq, dk, dv, dsinks = attention_varlen_bwd(
        grad_out, q, k, v, out, lse, grad_lse, cu_q, cu_k, max_q, max_k, causal, scale,
        deterministic, backend, left, right, softcap, alibi_slopes, sinks, *ctx.dropout)
    return (dq, dk, dv, *(None,) * 11, dsinks if sinks is not None else None,
            None, None, None, None)


attention_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


@overload
def attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
    causal: bool = ..., softmax_scale: float | None = ...,
    window_size: tuple[int, int] = ..., softcap: float | None = ...,
    alibi_slopes: torch.Tensor | None = ..., return_lse: Literal[False] = ...,
    backend: str | None = ..., sinks: torch.Tensor | None = ...,
    score_mod: ScoreModFn | None = ..., mask_mod: MaskModFn | None = ...,
    dropout_p: float = ..., deterministic: bool | None = ...,
    q_descale: torch.Tensor | None = ..., k_descale: torch.Tensor | None = ...,
    v_descale: torch.Tensor | None = ..., out_dtype: torch.dtype | None = ...) -> torch.Tensor: ...


@overload
def attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
    return_lse: Literal[True], causal: bool = ..., softmax_scale: float | None = ...,
    backend: str | None = ..., window_size: tuple[int, int] = ...,
    softcap: float | None = ..., alibi_slopes: torch.Tensor | None = ...,
    sinks: torch.Tensor | None = ..., score_mod: ScoreModFn | None = ...,
    mask_mod: MaskModFn | None = ..., dropout_p: float = ...,
    deterministic: bool | None = ...,
    q_descale: torch.Tensor | None = ..., k_descale: torch.Tensor | None = ...,
    v_descale: torch.Tensor | None = ..., out_dtype: torch.dtype | None = ...
) -> tuple[torch.Tensor, torch.Tensor]: ...


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str | None = None,
    sinks: torch.Tensor | None = None,
    score_mod: ScoreModFn | None = None,
    mask_mod: MaskModFn | None = None,
    dropout_p: float = 0.0,
    deterministic: bool | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a batch of sequences of different lengths, packed (flash-attn's
    ``flash_attn_varlen_func`` layout).

    q is (total_q, Hq, D) and k, v (total_k, Hkv, D) (v may have a head dim of its own, as
    in ``attention``; D up to 256, or 512 or 576): sequence b is rows
    cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q (and likewise of k and v, by
    cu_seqlens_k). ``cu_seqlens_q``, ``cu_seqlens_k``: int32 (batch + 1,) on q's device,
    starting at 0, non-decreasing, ending at total_q and total_k; zero-length sequences are
    allowed (a query row with no keys gets O = 0 and LSE = +inf). ``max_seqlen_q``,
    ``max_seqlen_k``: the longest sequences (the grid is sized by max_seqlen_q; they must be
    at least every length). The lengths are read by the kernel on the device: nothing
    synchronises (their values are checked on CPU tensors, and on CUDA tensors with
    FLASHTUNE_CHECK_INPUTS=1). ``causal`` aligns each sequence's diagonal to its
    bottom-right corner; ``softmax_scale``, ``window_size``, ``softcap``,
    ``alibi_slopes`` ((Hq,) or (batch, Hq) float32) and ``sinks`` ((Hq,) float32; a query
    row with no keys then gets LSE = sink) are as in ``attention``, per sequence.
    ``dropout_p`` as in ``attention`` (sequence b of the pack is the mask's batch b).
    Returns O (total_q, Hq, D) and, with ``return_lse``, the float32 LSE (Hq, total_q).
    Gradients flow to q, k, v and ``sinks`` (and through the LSE when it is returned and
    used), with every feature above; ``deterministic`` as in ``attention`` (None follows
    ``torch.use_deterministic_algorithms``). ``score_mod`` and ``mask_mod`` are as in
    ``attention``, per sequence (``b`` is the sequence's index and ``q_idx``, ``kv_idx``
    positions within it), with gradients and dropout as there.

    FP8 q, k and v (torch.float8_e4m3fn or float8_e5m2) go to the FP8 forward as in
    ``attention``, with ``q_descale``, ``k_descale``, ``v_descale`` float32
    (num_sequences, heads_kv) (one factor per sequence and KV head; None: 1.0) and
    ``out_dtype`` (torch.bfloat16, the
    default, or torch.float16); causal, GQA, ``window_size``, ``softcap``, ``alibi_slopes``
    and ``sinks`` are served, forward only.
    """
    descales = (q_descale, k_descale, v_descale)
    if _fp8.is_fp8(q):
        return _fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal, softmax_scale, window_size, softcap, alibi_slopes,
                           return_lse, backend, sinks, descales, out_dtype,
                           modified=score_mod is not None or mask_mod is not None,
                           dropout=dropout_p != 0.0)
    if isinstance(q, torch.Tensor) and (out_dtype is not None or any(
            d is not None for d in descales)):
        _fp8.refuse_fp8_arguments(q, descales, out_dtype)
    dim = None
    if isinstance(q, torch.Tensor) and not q.is_nested and q.dim() and q.shape[-1] % 8:
        q, k, v, dim = pad_head_dim(q, k, v)  # any head dim: one zero-padded copy each
    cu_q, cu_k, longest_q, longest_k = check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        functools.partial(check_attention_inputs, split_v=True))
    if not isinstance(causal, bool):
        raise InvalidInput(f"causal={causal!r} must be a bool (True or False)")
    scale = check_softmax_scale(softmax_scale, dim or q.shape[2])
    ordered = deterministic_flag(deterministic)
    varlen = VarlenArgs(cu_q, cu_k, longest_q, longest_k)
    variant = resolve(causal, window_size, softcap, alibi_slopes, q, varlen.batch,
                      (longest_q, longest_k), varlen, sinks)
    p = _dropout.check_dropout_p(dropout_p)
    if p:
        variant = dataclasses.replace(variant, dropout=_dropout.draw(
            q.device, varlen.batch * q.shape[1], p))
    drop = variant.dropout
    name = "" if backend is None else backend
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, variant.sinks))
    if score_mod is not None or mask_mod is not None:
        if variant.sinks is not None and variant.sinks.requires_grad:
            refuse_grad(variant.sinks)
        out, lse = modified_forward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), variant,
                                    scale, name, score_mod, mask_mod, deterministic=ordered)
        out, lse = out[0], lse[0]
    elif not needs_grad and direct_call_ok(q, k, v, cu_q, cu_k, variant.alibi_slopes,
                                           variant.sinks):
        out, lse = _run(q, k, v, variant, scale, name)
    else:
        out, lse = attention_varlen_fwd(q, k, v, cu_q, cu_k, longest_q, longest_k,
                                        variant.causal, scale, name, *variant.window,
                                        variant.softcap, variant.alibi_slopes,
                                        variant.sinks,
                                        *((drop.p, drop.signed_seed, drop.offset) if drop
                                          else (0.0, 0, 0)), ordered)
    if dim is not None:
        out = out[..., :dim]
    return (out, lse) if return_lse else out


def _fp8_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: object,
                cu_seqlens_k: object, max_seqlen_q: object, max_seqlen_k: object,
                causal: object, softmax_scale: float | None, window_size: tuple[int, int],
                softcap: float | None, alibi_slopes: torch.Tensor | None, return_lse: bool,
                backend: str | None, sinks: torch.Tensor | None,
                descales: tuple[torch.Tensor | None, ...], out_dtype: torch.dtype | None, *,
                modified: bool, dropout: bool
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``attention_varlen`` of FP8 q, k, v: the FP8 forward over the pack (one batch entry
    of total rows whose sequences the kernel reads from the cumulative lengths)."""
    _fp8.refuse_features(score_mod=modified, mask_mod=modified, dropout_p=dropout)
    cu_q, cu_k, longest_q, longest_k = check_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        check=check_fp8_attention_inputs)
    if not isinstance(causal, bool):
        raise InvalidInput(f"causal={causal!r} must be a bool (True or False)")
    varlen = VarlenArgs(cu_q, cu_k, longest_q, longest_k)
    variant = resolve(causal, window_size, softcap, alibi_slopes, q, varlen.batch,
                      (longest_q, longest_k), varlen, sinks)
    out, lse = _fp8.fp8_forward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), variant,
                                softmax_scale, "" if backend is None else backend,
                                (descales[0], descales[1], descales[2]), out_dtype)
    return (out[0], lse[0]) if return_lse else out[0]
