"""The PyTorch-facing API: attention(), scaled_dot_product_attention(), explain().

The forward pass is the custom op ``flashtune::attention_fwd`` (torch.library) with a fake
implementation, so torch.compile traces through it as one graph node and CUDA graphs capture
it (it synchronises nothing and allocates only its outputs). A plain eager call with nothing
that observes operators (no compile, tracing, dispatch or function modes, functorch
transforms or profiler) and no input that needs a gradient calls the same implementation
directly, which saves the operator dispatch (several microseconds of host time per call).

Gradients: the op's autograd formula runs the backward kernels through a second custom op,
``flashtune::attention_bwd`` (also with a fake implementation, so torch.compile traces the
backward graph too). ``deterministic=True`` promises bitwise-reproducible gradients (dQ is
summed in a fixed order); the default follows ``torch.use_deterministic_algorithms``. A
gradient flowing into the LSE output (``return_lse=True``) is included.

Attention features (``window_size``, ``softcap``, ``alibi_slopes``; api/variants.py) have
their gradients too: the backward kernels take the forward's feature values (a sliding
window's query tiles outside it are skipped, softcap's tanh is differentiated). Dropout
(``dropout_p``; api/dropout.py) passes its seed and offset through both ops, so the
backward draws the forward's mask again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, overload

import torch

from flashtune.api import backward as _bwd
from flashtune.api import dropout as _dropout
from flashtune.api import forward as _fwd
from flashtune.api import fp8 as _fp8
from flashtune.api.flex import (
    MaskModFn,
    ScoreModFn,
    attn_mask_mods,
    check_bhsd,
    modified_forward,
    refuse_grad,
)
from flashtune.api.limits import check_softmax_scale
from flashtune.api.sdpa_causal import top_left_forward
from flashtune.api.validate import check_attention_inputs, check_fp8_attention_inputs
from flashtune.api.variants import (
    NO_WINDOW,
    Variant,
    pad_head_dim,
    refuse_unsupported,
    resolve,
)
from flashtune.errors import BackwardNotAvailable, InvalidInput
from flashtune.families.fwd.args import DropoutArgs
from flashtune.runtime import plans
from flashtune.runtime.dispatch import Decision

OP_NAME = "flashtune::attention_fwd"
BWD_OP_NAME = "flashtune::attention_bwd"


@torch.library.custom_op(OP_NAME, mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  softmax_scale: float, backend: str, deterministic: bool = False,
                  window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                  alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                  dropout_p: float = 0.0, dropout_seed: int = 0, dropout_offset: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """O (B, Nq, Hq, D) and LSE (B, Hq, Nq, float32) of validated inputs. ``deterministic``
    only matters to the backward (it is an argument here so the autograd formula sees it).
    The features are those of a resolved ``variants.Variant`` (defaults: off); the dropout's
    seed is its 64 bits as a signed int (``DropoutArgs.signed_seed``)."""
    variant = _variant(causal, window_left, window_right, softcap, alibi_slopes, sinks,
                       dropout_p, dropout_seed, dropout_offset)
    return _fwd.forward(q, k, v, causal, softmax_scale, backend, variant)


def _variant(causal: bool, window_left: int, window_right: int, softcap: float,
             alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None, dropout_p: float,
             dropout_seed: int, dropout_offset: int) -> Variant:
    """The Variant of the ops' feature arguments."""
    dropout = (DropoutArgs(dropout_seed % 2**64, dropout_offset, dropout_p) if dropout_p > 0.0
               else None)
    return Variant(causal, (window_left, window_right), softcap, alibi_slopes, sinks=sinks,
                   dropout=dropout)


@attention_fwd.register_fake
def _attention_fwd_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        softmax_scale: float, backend: str, deterministic: bool = False,
                        window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                        alibi_slopes: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None, dropout_p: float = 0.0,
                        dropout_seed: int = 0, dropout_offset: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, heads_q, head_dim = q.shape
    return (torch.empty_like(q) if v.shape[3] == head_dim
            else q.new_empty((batch, seqlen_q, heads_q, v.shape[3])),
            q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32))


@torch.library.custom_op(BWD_OP_NAME, mutates_args=())
def attention_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, grad_lse: torch.Tensor | None,
                  causal: bool, softmax_scale: float, deterministic: bool, backend: str,
                  window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                  alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                  dropout_p: float = 0.0, dropout_seed: int = 0, dropout_offset: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of the forward that produced ``out`` and ``lse``, with its features (the
    dropout's mask drawn again from its seed and offset), and the gradient of ``sinks`` (an
    empty float32 tensor without sinks)."""
    variant = _variant(causal, window_left, window_right, softcap, alibi_slopes, sinks,
                       dropout_p, dropout_seed, dropout_offset)
    dq, dk, dv, dsinks = _bwd.backward(grad_out, q, k, v, out, lse, grad_lse, causal,
                                       softmax_scale, deterministic, backend, variant)
    return dq, dk, dv, q.new_empty(0, dtype=torch.float32) if dsinks is None else dsinks


@attention_bwd.register_fake
def _attention_bwd_fake(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        grad_lse: torch.Tensor | None, causal: bool, softmax_scale: float,
                        deterministic: bool, backend: str, window_left: int = -1,
                        window_right: int = -1, softcap: float = 0.0,
                        alibi_slopes: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None, dropout_p: float = 0.0,
                        dropout_seed: int = 0, dropout_offset: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dsinks = (q.new_empty(0, dtype=torch.float32) if sinks is None
              else torch.empty_like(sinks, dtype=torch.float32))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, causal, softmax_scale, backend, deterministic = inputs[:7]
    window_left, window_right, softcap, alibi_slopes, sinks = inputs[7:12]
    ctx.dropout = tuple(inputs[12:]) or (0.0, 0, 0)
    ctx.features = _variant(causal, window_left, window_right, softcap, alibi_slopes, sinks,
                            *ctx.dropout).features
    ctx.window = (window_left, window_right)
    ctx.softcap = softcap
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale
    ctx.backend = backend
    ctx.deterministic = deterministic


def _backward(ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
              ) -> tuple[Any, ...]:
    """Gradients of (q, k, v, causal, softmax_scale, backend, deterministic, window_left,
    window_right, softcap, alibi_slopes, sinks, dropout_p, dropout_seed, dropout_offset);
    FeatureNotSupported for features the backward families do not implement."""
    q, k, v, out, lse, alibi_slopes, sinks = ctx.saved_tensors
    refuse_unsupported("bwddet" if ctx.deterministic else "bwd", ctx.features, q,
                       "flashtune.attention's backward pass")
    dq, dk, dv, dsinks = attention_bwd(grad_out, q, k, v, out, lse, grad_lse, ctx.causal,
                                       ctx.softmax_scale, ctx.deterministic, ctx.backend,
                                       ctx.window[0], ctx.window[1], ctx.softcap,
                                       alibi_slopes, sinks, *ctx.dropout)
    return (dq, dk, dv, None, None, None, None, None, None, None, None,
            dsinks if sinks is not None else None, None, None, None)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


#: Said by the operations that have no backward pass (decoding with a KV cache).
_NO_BACKWARD = (
    "this flashtune operation (decoding with a KV cache) has no backward pass, so it cannot "
    "compute gradients; expected inputs that do not require grad. Call it under "
    "torch.no_grad() / torch.inference_mode() or pass detached tensors; flashtune.attention "
    "and flashtune.scaled_dot_product_attention support training"
)


def check_no_grad(*tensors: torch.Tensor | None) -> None:
    """BackwardNotAvailable when grad mode is on and an input requires grad (for operations
    without a backward pass)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise BackwardNotAvailable(_NO_BACKWARD)


def _needs_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def deterministic_flag(value: object) -> bool:
    """``deterministic`` as a bool: None follows torch.are_deterministic_algorithms_enabled()."""
    if value is None:
        return bool(torch.are_deterministic_algorithms_enabled())
    if not isinstance(value, bool):
        raise InvalidInput(f"deterministic={value!r} must be True, False or None (None follows "
                           "torch.use_deterministic_algorithms)")
    return value


_C: Any = torch._C


def direct_call_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   *others: torch.Tensor | None) -> bool:
    """True when calling the implementation directly is indistinguishable from the op (plain
    tensors, nothing observing operators); ``others``: further inputs, None when absent."""
    if torch.compiler.is_compiling():
        return False
    return not (
        type(q) is not torch.Tensor or type(k) is not torch.Tensor
        or type(v) is not torch.Tensor or q.is_meta
        or (others and any(t is not None and type(t) is not torch.Tensor for t in others))
        or _C._len_torch_dispatch_stack() or _C._is_torch_function_mode_enabled()
        or _C._are_functorch_transforms_active() or _C._autograd._profiler_enabled()
        or _C._get_tracing_state() is not None
    )


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              softmax_scale: float | None = ..., q_descale: torch.Tensor | None = ...,
              k_descale: torch.Tensor | None = ..., v_descale: torch.Tensor | None = ...,
              out_dtype: torch.dtype | None = ..., return_lse: Literal[False] = ...,
              backend: str | None = ..., deterministic: bool | None = ...,
              window_size: tuple[int, int] = ..., softcap: float | None = ...,
              alibi_slopes: torch.Tensor | None = ...,
              sinks: torch.Tensor | None = ..., score_mod: ScoreModFn | None = ...,
              mask_mod: MaskModFn | None = ..., dropout_p: float = ...,
              return_dropout_mask: Literal[False] = ...) -> torch.Tensor: ...


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              softmax_scale: float | None = ..., q_descale: torch.Tensor | None = ...,
              k_descale: torch.Tensor | None = ..., v_descale: torch.Tensor | None = ...,
              out_dtype: torch.dtype | None = ..., return_lse: Literal[True],
              backend: str | None = ..., deterministic: bool | None = ...,
              window_size: tuple[int, int] = ..., softcap: float | None = ...,
              alibi_slopes: torch.Tensor | None = ...,
              sinks: torch.Tensor | None = ..., score_mod: ScoreModFn | None = ...,
              mask_mod: MaskModFn | None = ..., dropout_p: float = ...,
              return_dropout_mask: Literal[False] = ...) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              softmax_scale: float | None = ..., q_descale: torch.Tensor | None = ...,
              k_descale: torch.Tensor | None = ..., v_descale: torch.Tensor | None = ...,
              out_dtype: torch.dtype | None = ..., return_lse: bool,
              backend: str | None = ..., deterministic: bool | None = ...,
              window_size: tuple[int, int] = ..., softcap: float | None = ...,
              alibi_slopes: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
              score_mod: ScoreModFn | None = ..., mask_mod: MaskModFn | None = ...,
              dropout_p: float = ..., return_dropout_mask: Literal[False] = ...
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = ...,
              softmax_scale: float | None = ..., q_descale: torch.Tensor | None = ...,
              k_descale: torch.Tensor | None = ..., v_descale: torch.Tensor | None = ...,
              out_dtype: torch.dtype | None = ..., return_lse: bool = ...,
              backend: str | None = ..., deterministic: bool | None = ...,
              window_size: tuple[int, int] = ..., softcap: float | None = ...,
              alibi_slopes: torch.Tensor | None = ..., sinks: torch.Tensor | None = ...,
              score_mod: ScoreModFn | None = ..., mask_mod: MaskModFn | None = ...,
              dropout_p: float = ..., return_dropout_mask: Literal[True]
              ) -> tuple[torch.Tensor, ...]: ...


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
    deterministic: bool | None = None,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    score_mod: ScoreModFn | None = None,
    mask_mod: MaskModFn | None = None,
    dropout_p: float = 0.0,
    return_dropout_mask: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Scaled dot-product attention in flash-attn's layout.

    q is (B, Nq, Hq, D); k and v are (B, Nk, Hkv, D) with Hq a multiple of Hkv (grouped-query
    attention); fp16 or bf16; D up to 256, or 512 or 576 (a D that is not a multiple of 8 is
    zero-padded to one: one copy of q, k and v, and O is a view of the padded output); the
    last dim contiguous. v may have a head dim Dv of its own (a multiple of 8 up to 256, or
    up to D for D 512 or 576, run in column chunks of 256; DeepSeek's prefill: D = 192,
    Dv = 128): O is then (B, Nq, Hq, Dv) and gradients flow as usual. Returns
    O (B, Nq, Hq, D), and with ``return_lse`` also the natural-log log-sum-exp of the scaled
    scores, float32 (B, Hq, Nq). ``causal`` masks key j from query i unless
    j <= i + Nk - Nq (the diagonal aligned to the bottom-right corner, as in flash-attn); a
    query row that sees no key gets O = 0 and LSE = +inf. ``softmax_scale`` defaults to
    1/sqrt(D). ``backend``: None (FLASHTUNE_BACKEND, default ``auto``: CUDA tensors on the
    GPU), ``"cuda"`` or ``"emulator"`` (CPU tensors, slow; for verification).

    Gradients flow to q, k and v (and through the LSE when it is returned and used).
    ``deterministic=True`` makes them bitwise reproducible run to run on one device (dQ is
    summed over key tiles in a fixed order, somewhat slower); False allows float32 atomics,
    whose order varies; None (default) follows ``torch.use_deterministic_algorithms``.

    Features (flash-attn's keywords; a backward through one the backward families do not
    implement raises FeatureNotSupported): ``window_size=(left, right)``: query i sees key j only if
    i + Nk - Nq - left <= j <= i + Nk - Nq + right, -1 meaning unbounded on that side
    (``causal=True`` sets right to 0); key tiles outside every row's window are skipped.
    ``softcap``: scores s become softcap * tanh(s / softcap) (None or 0.0, flash-attn's
    default: off, the plain kernel; else > 0).
    ``alibi_slopes``: float32 (Hq,) or (B, Hq) on q's device; scores get the bias
    -slope * |i + Nk - Nq - j|. ``sinks``: float32 (Hq,) on q's device (gpt-oss's attention
    sinks, which may require grad): one logit per query head, not scaled, joins each row's
    softmax denominator and contributes no value, O = sum_j exp(s_j) v_j / (exp(sink) +
    sum_j exp(s_j)), and the LSE includes it (a row that sees no key gets O = 0 and
    LSE = sink).
    ``dropout_p``: FlashAttention-2's attention dropout (training): each softmax probability
    is zeroed with probability ``dropout_p`` and the kept ones scaled by 1 / (1 - dropout_p)
    (the LSE is the undropped softmax's); the mask is drawn from torch's default generator
    of the tensors' device (``api.dropout``: same seed, same output; each call draws anew)
    and drawn again, never stored, by the backward. ``return_dropout_mask=True`` appends
    the kept mask, bool (B, Hq, Nq, Nk), drawn on the host with the kernels' definition
    (for testing: it costs B Hq Nq Nk bytes). Each feature is a compile-time variant of the
    kernel (its own tuning key), not a run-time branch.

    ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)``:
    FlexAttention's modifications (``flashtune.flex_attention``), traced into the kernel
    (``codegen.trace``; h is the query head, the indices are positions within the
    sequences); applied after softcap and ALiBi, and a masked key stays hidden whatever they
    return. Gradients flow through them to q, k, v and to the float tensors they capture
    that require grad (``api.flex_grad``); sinks that require grad raise
    BackwardNotAvailable with them. Dropout combines with them (the mask drawn from the
    same positions, the backward drawing it again).
    """
    descales = (q_descale, k_descale, v_descale)
    if _fp8.is_fp8(q):
        _fp8.refuse_features(score_mod=score_mod is not None, mask_mod=mask_mod is not None,
                             dropout_p=dropout_p != 0.0,
                             return_dropout_mask=return_dropout_mask)
        if not isinstance(causal, bool):
            raise InvalidInput(f"causal={causal!r} must be a bool (True or False)")
        check_fp8_attention_inputs(q, k, v)
        variant8 = resolve(causal, window_size, softcap, alibi_slopes, q, q.shape[0],
                           (q.shape[1], k.shape[1]), sinks=sinks)
        out8, lse8 = _fp8.fp8_forward(q, k, v, variant8, softmax_scale,
                                      "" if backend is None else backend, descales, out_dtype)
        return (out8, lse8) if return_lse else out8
    if isinstance(q, torch.Tensor) and (out_dtype is not None or any(
            d is not None for d in descales)):
        _fp8.refuse_fp8_arguments(q, descales, out_dtype)
    dim = None
    if isinstance(q, torch.Tensor) and not q.is_nested and q.dim() and q.shape[-1] % 8:
        q, k, v, dim = pad_head_dim(q, k, v)  # any head dim: one zero-padded copy each
    check_attention_inputs(q, k, v, split_v=True)
    if not isinstance(causal, bool):
        raise InvalidInput(f"causal={causal!r} must be a bool (True or False)")
    scale = check_softmax_scale(softmax_scale, dim or q.shape[3])
    ordered = deterministic_flag(deterministic)
    name = "" if backend is None else backend
    p = 0.0 if isinstance(dropout_p, float) and dropout_p == 0.0 else (
        _dropout.check_dropout_p(dropout_p))
    if return_dropout_mask and not p:
        raise InvalidInput("return_dropout_mask=True needs dropout_p > 0 (there is no mask "
                           "without dropout)")
    modified = score_mod is not None or mask_mod is not None
    variant: Variant | None = None  # plain attention (the hot path resolves nothing)
    if modified or p or window_size != NO_WINDOW or softcap is not None or (
            alibi_slopes is not None or sinks is not None):
        variant = resolve(causal, window_size, softcap, alibi_slopes, q, q.shape[0],
                          (q.shape[1], k.shape[1]), sinks=sinks)
        if p:
            variant = dataclasses.replace(variant, dropout=_dropout.draw(
                q.device, q.shape[0] * q.shape[2], p))
        causal = variant.causal
    needs_grad = _needs_grad(q, k, v) or (torch.is_grad_enabled() and sinks is not None
                                          and sinks.requires_grad)
    if modified:
        assert variant is not None
        if variant.sinks is not None and variant.sinks.requires_grad:
            refuse_grad(variant.sinks, what="attention with sinks that require grad and a "
                        "score_mod or mask_mod")
        out, lse = modified_forward(q, k, v, variant, scale, name, score_mod, mask_mod,
                                    deterministic=ordered)
    else:
        out, lse = _plain_or_featured(q, k, v, causal, scale, name, ordered, variant,
                                      needs_grad, alibi_slopes, sinks)
    if dim is not None:
        out = out[..., :dim]
    result: tuple[torch.Tensor, ...] = (out, lse) if return_lse else (out,)
    if return_dropout_mask and variant is not None and variant.dropout is not None:
        result += (_dropout.mask_of(variant.dropout, q.shape[0], q.shape[2], q.shape[1],
                                    k.shape[1], q.device),)
    return result if len(result) > 1 else out


def _plain_or_featured(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       scale: float, name: str, ordered: bool, variant: Variant | None,
                       needs_grad: bool, alibi_slopes: torch.Tensor | None,
                       sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """O and LSE of a call without modifications, recorded for autograd when it
    ``needs_grad`` (``variant``: its features, None for plain attention; ``alibi_slopes``
    and ``sinks`` as the caller passed them)."""
    if not needs_grad and direct_call_ok(q, k, v, alibi_slopes, sinks):
        return _fwd.forward(q, k, v, causal, scale, name, variant)
    if variant is None:
        out, lse = attention_fwd(q, k, v, causal, scale, name, ordered)
        return out, lse
    drop = variant.dropout
    out, lse = attention_fwd(q, k, v, causal, scale, name, ordered, *variant.window,
                             variant.softcap, variant.alibi_slopes, variant.sinks,
                             *((drop.p, drop.signed_seed, drop.offset) if drop else ()))
    return out, lse


def _sdpa_unsupported(what: str, fix: str) -> InvalidInput:
    return InvalidInput(f"flashtune.scaled_dot_product_attention does not support {what}; "
                        f"{fix}")


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """A drop-in for torch.nn.functional.scaled_dot_product_attention on (B, H, N, D) inputs.

    Supported: 4-D fp16/bf16 inputs, ``is_causal``, ``scale``, ``dropout_p`` (as in
    ``attention``; torch's own kernels draw other masks) and ``enable_gqa`` (Hq a
    multiple of Hkv). ``is_causal`` has torch's meaning: the mask is aligned to the top-left
    corner (query i sees key j iff j <= i), which for L != S is not ``attention``'s
    bottom-right ``causal``; it is served as two calls (``api.sdpa_causal``; gradients
    included). Not supported (InvalidInput saying so): ``attn_mask`` with ``is_causal``, and
    Hq != Hkv without ``enable_gqa``. The inputs are passed as transposed views and the
    result is a transposed view: nothing is copied (but for L > S with ``is_causal``, whose
    two row blocks are concatenated). ``backend`` is
    as in ``attention``; gradients flow as there (deterministic when
    ``torch.use_deterministic_algorithms(True)`` is set).

    ``attn_mask`` (bool: True attends; or floating: added to the scaled scores),
    broadcastable to (B, H, L, S), is served as a captured tensor read by a traced
    modification (``api.flex.attn_mask_mods``); a query row that sees no key gets O = 0
    (torch's math path gives NaN there). Gradients flow to q, k, v and to a float mask that
    requires grad (summed over its broadcast dims).
    """
    check_bhsd(query, key, value, enable_gqa)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if attn_mask is not None:
        if is_causal:
            raise _sdpa_unsupported("attn_mask together with is_causal", "fold the causal "
                                    "mask into attn_mask (torch refuses the pair too)")
        shape = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        score_mod, mask_mod = attn_mask_mods(attn_mask, shape)
        out = attention(q, k, v, softmax_scale=scale, backend=backend, score_mod=score_mod,
                        mask_mod=mask_mod, dropout_p=dropout_p)
        return out.transpose(1, 2)
    if is_causal and query.shape[2] != key.shape[2]:  # torch's top-left mask: two calls

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            return attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True,
                             backend=backend, dropout_p=dropout_p)

        out, _ = top_left_forward(attend, q, k, v)
    else:
        out = attention(q, k, v, causal=is_causal, softmax_scale=scale, backend=backend,
                        dropout_p=dropout_p)
    return out.transpose(1, 2)


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    backend: str | None = None,
    arch: str | None = None,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> Decision:
    """Which config flashtune would run for this call, and why (nothing is compiled).

    ``str(decision)`` or ``decision.describe()`` prints the problem, bucket, device, the tier
    that answered (exact, nearest, same_arch, default) and the config. ``arch`` asks about a
    virtual GPU of that arch instead of the tensors' device (meta tensors work too). The
    features (``window_size``, ``softcap``, ``alibi_slopes``, ``sinks``) are as in
    ``attention``.
    """
    check_attention_inputs(q, k, v)
    if q.device.type == "meta" and arch is None:
        arch = plans.emulator_arch()
    variant = resolve(causal, window_size, softcap, alibi_slopes, q, q.shape[0],
                      (q.shape[1], k.shape[1]), sinks=sinks)
    decision, _ = _fwd.decide(q, k, variant.causal, backend, arch, features=variant.features)
    return decision
