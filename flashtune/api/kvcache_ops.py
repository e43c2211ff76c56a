"""The PyTorch-facing decoding API: ``attention_with_kvcache`` and ``explain_kvcache``.

The call is the custom op ``flashtune::attention_with_kvcache`` (torch.library, with a fake
implementation, so torch.compile traces it as one node; it mutates k_cache and v_cache when
new rows are appended). A plain eager call with nothing observing operators calls the same
implementation directly, as ``attention`` does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal, overload

import torch

from flashtune import settings
from flashtune.api import decode as _decode
from flashtune.api import mla as _mla
from flashtune.api.block_mask import BlockMask, with_tile_ranges
from flashtune.api.flex import MaskModFn, ScoreModFn, refuse_grad, traced_feature
from flashtune.api.fp8 import check_descale
from flashtune.api.ops import check_no_grad, direct_call_ok
from flashtune.api.validate import check_softmax_scale
from flashtune.api.validate_kvcache import FP8_CACHE_DTYPE, check_kvcache_inputs, is_fp8_cache
from flashtune.api.variants import (
    NO_WINDOW,
    Variant,
    padded_head_dim,
    refuse_unsupported,
    resolve,
    zero_pad,
)
from flashtune.codegen.trace import trace
from flashtune.errors import InvalidInput
from flashtune.families.decode.splits import check_num_splits
from flashtune.runtime.dispatch import Decision
from flashtune.runtime.plans import Operands

OP_NAME = "flashtune::attention_with_kvcache"


@torch.library.custom_op(OP_NAME, mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                              k: torch.Tensor | None, v: torch.Tensor | None, causal: bool,
                              softmax_scale: float, num_splits: int, backend: str,
                              window_left: int = -1, window_right: int = -1,
                              softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                              batch_invariant: bool = False,
                              sinks: torch.Tensor | None = None,
                              k_descale: torch.Tensor | None = None,
                              v_descale: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """O (B, Nq, Hq, D) and LSE (B, Hq, Nq, float32) of validated inputs and features
    (a window of (-1, -1), a softcap of 0.0, no slopes and no sinks: off); num_splits 0:
    the split mode's choice; an e4m3 cache's validated descale factors (else None)."""
    layout = check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, block_table, k, v)
    variant = Variant(causal, (window_left, window_right), softcap, alibi_slopes,
                      sinks=sinks)
    descales = None if k_descale is None or v_descale is None else (k_descale, v_descale)
    return _decode.run_decode(q, k_cache, v_cache, cache_seqlens, block_table, k, v, layout,
                              causal, softmax_scale, num_splits, backend,
                              variant if variant.features else None, batch_invariant,
                              descales)


@attention_with_kvcache_op.register_fake
def _fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
          k: torch.Tensor | None, v: torch.Tensor | None, causal: bool, softmax_scale: float,
          num_splits: int, backend: str, window_left: int = -1, window_right: int = -1,
          softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
          batch_invariant: bool = False, sinks: torch.Tensor | None = None,
          k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, heads_q, dim = q.shape
    return (torch.empty_like(q) if v_cache.shape[3] == dim
            else q.new_empty((batch, seqlen_q, heads_q, v_cache.shape[3])),
            q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32))


@overload
def attention_with_kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
    cache_seqlens: torch.Tensor, *, block_table: torch.Tensor | None = ...,
    k: torch.Tensor | None = ..., v: torch.Tensor | None = ..., causal: bool = ...,
    softmax_scale: float | None = ..., num_splits: int | None = ...,
    return_lse: Literal[False] = ..., backend: str | None = ...,
    window_size: tuple[int, int] = ..., softcap: float | None = ...,
    alibi_slopes: torch.Tensor | None = ..., batch_invariant: bool | None = ...,
    sinks: torch.Tensor | None = ..., score_mod: ScoreModFn | None = ...,
    mask_mod: MaskModFn | None = ..., head_dim_v: int | None = ...,
    k_descale: torch.Tensor | None = ..., v_descale: torch.Tensor | None = ...,
    block_mask: BlockMask | None = ...
) -> torch.Tensor: ...


@overload
def attention_with_kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
    cache_seqlens: torch.Tensor, *, block_table: torch.Tensor | None = ...,
    k: torch.Tensor | None = ..., v: torch.Tensor | None = ..., causal: bool = ...,
    softmax_scale: float | None = ..., num_splits: int | None = ...,
    return_lse: Literal[True], backend: str | None = ...,
    window_size: tuple[int, int] = ..., softcap: float | None = ...,
    alibi_slopes: torch.Tensor | None = ..., batch_invariant: bool | None = ...,
    sinks: torch.Tensor | None = ..., score_mod: ScoreModFn | None = ...,
    mask_mod: MaskModFn | None = ..., head_dim_v: int | None = ...,
    k_descale: torch.Tensor | None = ..., v_descale: torch.Tensor | None = ...,
    block_mask: BlockMask | None = ...
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def attention_with_kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
    cache_seqlens: torch.Tensor, *, block_table: torch.Tensor | None = ...,
    k: torch.Tensor | None = ..., v: torch.Tensor | None = ..., causal: bool = ...,
    softmax_scale: float | None = ..., num_splits: int | None = ..., return_lse: bool,
    backend: str | None = ..., window_size: tuple[int, int] = ...,
    softcap: float | None = ..., alibi_slopes: torch.Tensor | None = ...,
    batch_invariant: bool | None = ..., sinks: torch.Tensor | None = ...,
    score_mod: ScoreModFn | None = ..., mask_mod: MaskModFn | None = ...,
    head_dim_v: int | None = ..., k_descale: torch.Tensor | None = ...,
    v_descale: torch.Tensor | None = ..., block_mask: BlockMask | None = ...
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    backend: str | None = None,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    batch_invariant: bool | None = None,
    sinks: torch.Tensor | None = None,
    score_mod: ScoreModFn | None = None,
    mask_mod: MaskModFn | None = None,
    head_dim_v: int | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a few new query rows per sequence over a KV cache, in flash-attn's layout.

    q is (B, Nq, Hq, D) with a small Nq (decoding; speculative decoding), fp16 or bf16. The
    cache is k_cache, v_cache (B, max_len, Hkv, D), or paged (num_pages, page_size, Hkv, D)
    with ``block_table`` (B, max_pages) int32: position j of sequence b is row
    j % page_size of page block_table[b, j // page_size] (any page size >= 1; slots past a
    sequence's pages are never read). ``cache_seqlens`` (B,) int32, on q's device, holds each
    sequence's cache length; it is never read back to the host (no synchronisation: the call
    can be captured in a CUDA graph). With ``k`` and ``v`` (B, Nnew, Hkv, D) the new rows are
    written into the cache at positions cache_seqlens[b] ... + Nnew - 1 (in place, as
    flash-attn does; cache_seqlens itself is not changed) and attended to after the cached
    ones. Hq must be a multiple of Hkv (GQA/MQA: the group's query heads share one read of
    each K/V element). q and k may also be 512 or 576 wide (Gemma 4; DeepSeek's absorbed
    576 / 512), and v_cache (and v) may have a head dim of its own, a multiple of 8 up to
    512: O is as wide as V, and a V wider than 256 runs in column chunks of 256, one call
    each (Q K^T recomputed: K is read once per chunk). A head dim up to 256 that is not a
    multiple of 8 (59, 111, ...) is
    zero-padded to one, as ``attention`` does: one copy of q and of each cache per call
    (and one copy back into the caches when appending), so store a cache padded to a
    multiple of 8 to avoid them.

    ``causal``: query row i sees key j iff j <= i + total - Nq (bottom-right aligned, total =
    cache_seqlens[b] + Nnew); a row that sees no key gets O = 0 and LSE = +inf.
    ``softmax_scale`` defaults to 1/sqrt(D). ``num_splits`` (1 to 128) splits each sequence's
    keys across that many blocks whose partial results are merged by their LSE; None or 0
    (flash-attn's "choose") splits each sequence by the tuned split size of its own
    context-length bucket, chosen on the device (when the problem has tuned split sizes),
    else by the tuned bucket's count, else by FlashAttention-2's wave-efficiency heuristic
    for this GPU. A call of one split writes O and LSE without the merge. Returns O
    (B, Nq, Hq, D), and with ``return_lse`` also the float32 natural-log LSE (B, Hq, Nq).
    ``backend`` as in ``attention``.

    A cache length below 0 or beyond the capacity (max_len, or page_size x max_pages) and a
    block-table entry outside [0, num_pages) for a page a sequence uses are never followed:
    they raise InvalidInput before anything is appended (the cache is left as it was) on the
    emulator and on the GPU with FLASHTUNE_CHECK_INPUTS=1 (one synchronisation per call), as
    does a page that one sequence appends into while another block-table slot uses it (a
    race on a GPU; a shared prefix page that is only read is fine). Otherwise the kernel
    stops with a trap and the error surfaces at the next synchronisation, and shared pages
    are not looked for: that needs the block table on the host, a synchronisation.

    ``window_size``, ``softcap`` and ``alibi_slopes`` are ``attention``'s, with Nk the
    sequence's keys after appending (total) and Nq its new query rows: query row i sees
    keys i + total - Nq - left <= j <= i + total - Nq + right (-1: unbounded; causal makes
    right 0); softcap replaces S by softcap * tanh(S / softcap); ALiBi (float32 slopes of
    (heads_q,) or (batch, heads_q)) adds -slope * |i + total - Nq - j| after it. ``sinks``
    (float32 (heads_q,)) is ``attention``'s: each head's logit joins every row's softmax
    denominator (in the merge of the splits), and a row that sees no key gets LSE = sink.

    ``batch_invariant`` (None: the FLASHTUNE_BATCH_INVARIANT setting, off by default): each
    sequence is split by a fixed number of keys for its own length (the split table) and
    the tile is the same for every cache capacity, so a sequence's O and LSE are bitwise
    the same whatever the batch size, the other sequences' lengths and the other requests
    (deterministic: nothing is accumulated atomically). ``num_splits`` must then be None.

    ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)``:
    ``attention``'s traced modifications (``codegen.trace``), applied after softcap and
    ALiBi, with b the sequence, h the query head, q_idx = i + total - Nq the new row's
    absolute position in its sequence and kv_idx = j the key's (0 .. total - 1), so
    ``mask_mod`` ``q_idx >= kv_idx`` is the causal mask; a key the call's own masks hide
    stays hidden whatever they return. Captured tensors are read on every call (their
    values may change between calls). Forward only: a captured tensor that requires grad
    raises BackwardNotAvailable; such a call runs the kernels directly (not as the custom
    op). ``block_mask`` (``flashtune.create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN)``, B 1
    or the batch, H 1 or Hq, Q_LEN and KV_LEN at least the cache's capacity, since q_idx
    and kv_idx are absolute positions): its ``mask_mod`` is applied to every score as
    ``mask_mod`` is, and each block of the decode kernel walks only the key tiles between
    the lowest and the highest key block the mask marks non-empty for one of its rows (and
    those it appends new rows to); not together with ``mask_mod``.

    ``v_cache=None``: MLA decoding over a latent cache (FlashMLA's convention, the ``mla``
    family): k_cache holds 576 values per token (the 512-wide latent and 64 RoPE dims) in
    one KV head shared by every query head, q is 576 wide, and V is the first
    ``head_dim_v`` (None: 512, the only width served) dims of the same cache, so O is 512
    wide (``api.mla.attention_with_latent_cache``; what that kernel has not got is refused
    by name). Or FlashMLA's FP8 latent cache beside a bf16 q: float8_e4m3fn (or uint8)
    rows of 656 bytes (512 e4m3 values, 4 float32 scales, 64 bf16 RoPE values;
    ``flashtune.quantize_mla_latent`` writes them), dequantised on chip. ``head_dim_v``
    with a ``v_cache`` is refused.

    An e4m3 KV cache (``k_cache`` and ``v_cache`` of torch.float8_e4m3fn, paged or not, q and
    the new rows ``k``, ``v`` fp16 or bf16): ``k_descale``, ``v_descale`` are float32
    (B, Hkv) tensors on q's device (None: 1.0), positive and finite (they are not read back
    to be checked), FlashAttention-3's convention, so that the
    key j of (b, h) is ``k_descale[b, h] * k_cache[...]`` (``v_descale`` likewise). The
    cache is dequantised on chip (exactly: every e4m3 value is an fp16 and a bf16 value;
    ``k_descale`` joins the softmax scale, ``v_descale`` scales O), and the new rows are
    quantised in the kernel with their (b, h)'s descale, as
    ``(x.float() / descale).clamp(-448, 448).to(torch.float8_e4m3fn)`` (round to nearest
    even, saturating), appended, and attended to as appended. Every feature above applies
    (softcap and ALiBi act on the scores of the dequantised keys). Needs sm_89 or later
    (the e4m3 conversions); an e5m2 cache, an FP8 q or FP8 new rows are refused by name.
    O and the LSE are as for a 16-bit cache. The cache's element type is part of the tuning
    key (``decode8_d128_bf16-e4m3-bf16_...``).
    """
    if v_cache is None:
        width = _mla.LATENT_DIM
        if not _mla.is_latent_cache(k_cache):
            got = tuple(k_cache.shape) if isinstance(k_cache, torch.Tensor) else k_cache
            raise InvalidInput(f"v_cache must be a torch.Tensor (B, max_len, Hkv, D) or paged, "
                               f"got NoneType; v_cache=None is MLA decoding over a latent "
                               f"cache of {width} values per token (or FP8 rows of "
                               f"{_mla.FP8_ROW_BYTES} bytes), but k_cache is {got}")
        if score_mod is not None or mask_mod is not None or block_mask is not None:
            raise InvalidInput("v_cache=None (MLA decoding over a latent cache) does not take "
                               "score_mod, mask_mod or block_mask; leave them out, or pass a "
                               "v_cache")
        if k_descale is not None or v_descale is not None:
            raise InvalidInput("k_descale/v_descale are for an e4m3 k_cache and v_cache; "
                               "v_cache=None (MLA decoding over a latent cache) takes none: "
                               "leave them out")
        return _mla.attention_with_latent_cache(
            q, k_cache, cache_seqlens, block_table=block_table, k=k, v=v, causal=causal,
            softmax_scale=softmax_scale, num_splits=num_splits, return_lse=return_lse,
            backend=backend, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, batch_invariant=batch_invariant, sinks=sinks,
            head_dim_v=head_dim_v)
    if head_dim_v is not None:
        raise InvalidInput(f"head_dim_v={head_dim_v} with a v_cache: V's head dim is v_cache's "
                           "last dim; head_dim_v is for v_cache=None (MLA decoding, V the "
                           "first head_dim_v dims of k_cache)")
    dim = padded_head_dim(q, k_cache, v_cache, k, v)
    if dim is not None:  # any head dim: zero-padded copies, the appended rows copied back
        return _padded_call(dim, q, k_cache, v_cache, cache_seqlens, block_table, k, v,
                            causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
                            return_lse=return_lse, backend=backend, window_size=window_size,
                            softcap=softcap, alibi_slopes=alibi_slopes,
                            batch_invariant=batch_invariant, sinks=sinks,
                            score_mod=score_mod, mask_mod=mask_mod, k_descale=k_descale,
                            v_descale=v_descale, block_mask=block_mask)
    layout = check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, block_table, k, v)
    descales = cache_descales(q, k_cache, k_descale, v_descale)
    check_no_grad(q, k_cache, v_cache, k, v, sinks if isinstance(sinks, torch.Tensor) else None)
    if not isinstance(causal, bool):
        raise InvalidInput(f"causal={causal!r} must be a bool (True or False)")
    variant = None
    if (window_size != NO_WINDOW or softcap is not None or alibi_slopes is not None
            or sinks is not None):
        variant = resolve(causal, window_size, softcap, alibi_slopes, q, q.shape[0], None,
                          sinks=sinks)
        refuse_unsupported("decode", variant.features, q, "flashtune.attention_with_kvcache",
                           _decode.kernel_head_dim_v(layout))
        causal = variant.causal
        if not variant.features:
            variant = None
    if block_mask is not None:
        if mask_mod is not None:
            raise InvalidInput("mask_mod and block_mask are both given; a block mask carries its "
                               "own mask_mod (create_block_mask's): pass one of them")
        _decode.check_block_mask(block_mask, layout)
    if score_mod is not None or mask_mod is not None or block_mask is not None:
        variant = modified_variant(variant or Variant(causal), q, score_mod, mask_mod,
                                   block_mask)
    scale = check_softmax_scale(softmax_scale, q.shape[3])
    splits = 0 if num_splits is None else check_num_splits(num_splits, choose=True)
    invariant = settings.BATCH_INVARIANT.get() if batch_invariant is None else batch_invariant
    if not isinstance(invariant, bool):
        raise InvalidInput(f"batch_invariant={batch_invariant!r} must be a bool or None (the "
                           "FLASHTUNE_BATCH_INVARIANT setting)")
    if invariant and splits:
        raise InvalidInput(f"num_splits={num_splits} with batch_invariant=True: a "
                           "batch-invariant call splits each sequence by a fixed number of "
                           "keys for its own length; pass num_splits=None")
    name = "" if backend is None else backend
    if (variant is not None and variant.traced) or direct_call_ok(
            q, k_cache, v_cache, cache_seqlens, block_table, k, v,
            variant.sinks if variant is not None else None):
        # A traced modification's captured tensors are no op argument: called directly.
        out, lse = _decode.run_decode(q, k_cache, v_cache, cache_seqlens, block_table, k, v,
                                      layout, causal, scale, splits, name, variant, invariant,
                                      descales)
    elif variant is None:
        out, lse = attention_with_kvcache_op(q, k_cache, v_cache, cache_seqlens, block_table,
                                             k, v, causal, scale, splits, name,
                                             batch_invariant=invariant,
                                             **_descale_args(descales))
    else:
        out, lse = attention_with_kvcache_op(q, k_cache, v_cache, cache_seqlens, block_table,
                                             k, v, causal, scale, splits, name,
                                             *variant.window, variant.softcap,
                                             variant.alibi_slopes, invariant, variant.sinks,
                                             **_descale_args(descales))
    return (out, lse) if return_lse else out


def cache_descales(q: torch.Tensor, k_cache: torch.Tensor, k_descale: object,
                   v_descale: object) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The descale factors of a validated call: an e4m3 cache's, checked as the FP8
    forward's (float32 (batch, heads_kv), contiguous, on q's device; None: ones), or None for
    a 16-bit cache, which takes none (InvalidInput naming the one given)."""
    if is_fp8_cache(k_cache):
        k, v = (check_descale(name, value, q, k_cache) for name, value in
                (("k_descale", k_descale), ("v_descale", v_descale)))
        return k, v
    for name, value in (("k_descale", k_descale), ("v_descale", v_descale)):
        if value is not None:
            raise InvalidInput(f"{name} is given but k_cache has dtype {k_cache.dtype}: "
                               f"descale factors are for an e4m3 cache ({FP8_CACHE_DTYPE}); "
                               "drop it, or pass an e4m3 k_cache and v_cache")
    return None


def _descale_args(descales: tuple[torch.Tensor, torch.Tensor] | None) -> dict[str, Any]:
    """The op's descale keywords of a call (none for a 16-bit cache)."""
    if descales is None:
        return {}
    return {"k_descale": descales[0], "v_descale": descales[1]}


def modified_variant(variant: Variant, q: torch.Tensor, score_mod: ScoreModFn | None,
                     mask_mod: MaskModFn | None, block_mask: BlockMask | None = None
                     ) -> Variant:
    """``variant`` with the traced ``score_mod`` / ``mask_mod`` (``api.flex``: registered as
    a feature once, its captured tensors as float32 / int32 on q's device); InvalidInput or
    UnsupportedModification naming a bad one, BackwardNotAvailable for a captured tensor that
    requires grad (decoding has no backward). ``block_mask`` (validated): its ``mask_mod`` is
    the one traced, and the kernel takes its key ranges (``api.decode.decode_tile_ranges``)."""
    if block_mask is not None:
        mask_mod = block_mask.mask_mod
    traced = trace(score_mod, mask_mod, tiles=block_mask is not None)
    refuse_grad(*traced.captured, what="flashtune.attention_with_kvcache with a score_mod, "
                "mask_mod or block_mask")
    values = traced.values(q.device)
    if block_mask is not None:
        ranges = _decode.decode_tile_ranges(block_mask, q.device)
        values = with_tile_ranges(traced, values, ranges)
    return replace(variant, traced=(traced_feature(traced),), mods=values)


def _padded_call(dim: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                 k: torch.Tensor | None, v: torch.Tensor | None, *, softmax_scale: float | None,
                 return_lse: bool, **options: Any
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``attention_with_kvcache`` for a head dim ``dim`` that is not a multiple of 8, as the
    forward serves it: q, the caches and the new rows zero-padded to the next multiple of 8
    (zero columns change neither Q K^T nor the kept columns of P V), the softmax scale kept
    at 1/sqrt(dim), O a view of the padded output; with new rows, the padded caches (which
    received them) are copied back into the caller's, so they are appended in place as the
    call promises. One copy of each cache per call, two with new rows: store a cache at a
    multiple of 8 to avoid them."""
    pq, pk_cache, pv_cache = (zero_pad(t, dim) for t in (q, k_cache, v_cache))
    pk, pv = (None if t is None else zero_pad(t, dim) for t in (k, v))
    scale = check_softmax_scale(softmax_scale, dim)
    out, lse = attention_with_kvcache(pq, pk_cache, pv_cache, cache_seqlens,
                                      block_table=block_table, k=pk, v=pv, return_lse=True,
                                      softmax_scale=scale, **options)
    if k is not None:
        k_cache.copy_(pk_cache[..., :dim])
        v_cache.copy_(pv_cache[..., :dim])
    out = out[..., :dim]
    return (out, lse) if return_lse else out


def explain_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cache_seqlens: torch.Tensor, *, block_table: torch.Tensor | None = None,
                    causal: bool = False, backend: str | None = None, arch: str | None = None
                    ) -> tuple[Decision, Decision]:
    """The decode and combine configs flashtune would run for this call, and why (nothing is
    compiled); ``arch`` asks about a virtual GPU of that arch. An e4m3 cache is explained as
    its family's (``decode8``); a V wider than 256 by its first column chunk's kernels."""
    layout = check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, block_table)
    if q.device.type == "meta" and arch is None:
        from flashtune.runtime.plans import emulator_arch

        arch = emulator_arch()
    return _decode.decide(q, causal, layout.capacity, backend, arch,
                          _decode.shape_class_of(layout), Operands(
                              kv_dtype=k_cache.dtype if is_fp8_cache(k_cache) else None,
                              head_dim_v=_decode.kernel_head_dim_v(layout)))
