"""MLA decoding through the API: absorbed multi-head latent attention (DeepSeek V2/V3) over
a (paged) latent cache, FlashMLA's convention: ``v_cache=None`` and ``head_dim_v=512`` (V is
the first ``head_dim_v`` dims of the K cache).

One call launches the ``mla`` family's kernel (float32 partial O and LSE per split; every
query head of a sequence packed into one block's rows, so the block reads each latent row
once per split) and merges the splits by their LSE, as the ``combine`` kernel does, in
float32 torch operations: the combine family's kernels are compiled for head dims up to 256
(``Problem``), and the merge of 512-wide rows waits for wider head dims there. A call of
one split needs no merge. The plan is keyed by the problem's head dim, the latent's RoPE
width (``families.mla``); the split count is the caller's, else FlashAttention-2's
wave-efficiency heuristic over the SM count.

FP8 latent cache (FlashMLA's format, ``families.mla.fp8``): a ``torch.float8_e4m3fn`` (as
FlashMLA allocates it) or ``torch.uint8`` cache whose last dim is 656 bytes per token (512
e4m3 values, 4 float32 scales, 64 bf16 RoPE values) beside bf16 q; the kernel dequantises
it on chip, and the plan is the problem ``mla_d64_bf16-e4m3-bf16``. ``quantize_mla_latent``
writes such rows from a bf16 latent.
"""

from __future__ import annotations

import torch

from flashtune import settings
from flashtune.api.validate_kvcache import KvCacheLayout, check_cache_values
from flashtune.api.variants import NO_WINDOW
from flashtune.errors import InvalidInput
from flashtune.families.decode import NOMINAL_SMS
from flashtune.families.decode.splits import MAX_SPLITS, heuristic_splits
from flashtune.families.decode.status import STATUS_WORDS, describe
from flashtune.families.mla import ROPE_DIM, fp8
from flashtune.families.mla.args import mla_grid, pack_mla_args
from flashtune.families.mla.space import NOPE_DIM
from flashtune.runtime import plans

#: The latent's width: DeepSeek's kv_lora_rank (512, also V) plus its RoPE dims (64).
LATENT_DIM = NOPE_DIM + ROPE_DIM
#: Bytes per token of an FP8 latent cache (FlashMLA's rows).
FP8_ROW_BYTES = fp8.ROW_BYTES
#: Keys per block the split heuristic counts in (the default tile's).
_HEURISTIC_BLOCK_N = 32


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def quantize_mla_latent(latent: torch.Tensor) -> torch.Tensor:
    """FlashMLA's FP8 rows (..., 656) as ``torch.float8_e4m3fn`` of a bf16 latent (..., 576):
    per 128 latent dims a power-of-two float32 scale (the smallest with amax <= 448 x
    scale), the dims as e4m3 (round to nearest even), the 64 RoPE dims as bf16
    (``families.mla.fp8``). A paged cache (num_pages, page_size, 1, 576) becomes one of
    (num_pages, page_size, 1, 656)."""
    return fp8.quantize_latent(latent)


def is_latent_cache(k_cache: object) -> bool:
    """Whether ``k_cache`` is a tensor of latent rows: 576 values, or 656 bytes of FP8 rows."""
    return isinstance(k_cache, torch.Tensor) and k_cache.dim() > 0 and k_cache.shape[-1] == (
        fp8.ROW_BYTES if fp8.is_fp8_cache(k_cache) else LATENT_DIM)


def _check_fp8_cache(q: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """InvalidInput unless ``kv_cache`` (uint8 or float8_e4m3fn) is an FP8 latent cache of
    656-byte rows beside a bf16 q."""
    if q.dtype != torch.bfloat16:
        raise InvalidInput(f"q has dtype {q.dtype} beside an FP8 latent cache ({kv_cache.dtype});"
                           " expected torch.bfloat16 (the cache's RoPE part is bf16)")
    if kv_cache.shape[-1] != fp8.ROW_BYTES:
        raise InvalidInput(f"k_cache is an FP8 latent cache ({kv_cache.dtype}) of "
                           f"{kv_cache.shape[-1]} bytes per token (shape {_shape(kv_cache)}); "
                           f"expected {fp8.ROW_BYTES} (FlashMLA's rows: {fp8.NOPE} e4m3 values, "
                           f"{fp8.SCALES} float32 scales, {fp8.ROPE} bf16 RoPE values; "
                           "quantize_mla_latent writes them)")


def check_mla_inputs(q: torch.Tensor, kv_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                     block_table: torch.Tensor | None, head_dim_v: int) -> KvCacheLayout:
    """The call's sizes, or InvalidInput naming the argument, what it is and what is
    expected: q (B, Nq, Hq, 576) fp16/bf16; kv_cache (num_pages, page_size, 1, 576) with
    ``block_table`` (B, max_pages) int32, or (B, max_len, 1, 576) without, of q's dtype, or
    FP8 rows (..., 1, 656) of float8_e4m3fn or uint8 beside a bf16 q; cache_seqlens (B,)
    int32; head_dim_v 512; last dims contiguous, every tensor on q's device."""
    if head_dim_v != NOPE_DIM:
        raise InvalidInput(f"head_dim_v={head_dim_v}; the MLA kernel takes V as the first "
                           f"{NOPE_DIM} dims of the {LATENT_DIM}-wide latent: pass "
                           f"head_dim_v={NOPE_DIM}")
    for name, t, rank in (("q", q, 4), ("k_cache", kv_cache, 4),
                          ("cache_seqlens", cache_seqlens, 1), ("block_table", block_table, 2)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            raise InvalidInput(f"{name} must be a {rank}-dim torch.Tensor, got "
                               f"{_shape(t) if isinstance(t, torch.Tensor) else type(t)}")
        if t.device != q.device:
            raise InvalidInput(f"{name} is on {t.device} but q is on {q.device}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise InvalidInput(f"q has dtype {q.dtype}; expected torch.float16 or torch.bfloat16")
    fp8_cache = fp8.is_fp8_cache(kv_cache)
    if fp8_cache:
        _check_fp8_cache(q, kv_cache)
    elif kv_cache.dtype != q.dtype:
        raise InvalidInput(f"k_cache has dtype {kv_cache.dtype}; expected {q.dtype} (q's), "
                           f"or an FP8 latent cache: torch.float8_e4m3fn or torch.uint8 rows "
                           f"of {fp8.ROW_BYTES} bytes beside a bf16 q")
    for name, t in (("cache_seqlens", cache_seqlens), ("block_table", block_table)):
        if t is not None and t.dtype != torch.int32:
            raise InvalidInput(f"{name} has dtype {t.dtype}; expected torch.int32")
    batch, seqlen_q, heads_q, width = q.shape
    n0, n1, heads_kv, latent = kv_cache.shape
    if (fp8.ROW_BYTES if fp8_cache else LATENT_DIM) != latent or width != LATENT_DIM:
        raise InvalidInput(f"the latent is {latent} wide in k_cache and {width} in q; expected "
                           f"{LATENT_DIM} ({NOPE_DIM} latent dims, also V, + {ROPE_DIM} RoPE "
                           "dims: DeepSeek's absorbed MLA)")
    if heads_kv != 1:
        raise InvalidInput(f"k_cache has {heads_kv} heads (shape {_shape(kv_cache)}); MLA has "
                           f"one latent head shared by all query heads: expected (num_pages, "
                           f"page_size, 1, {latent})")
    if min(q.shape) < 1 or min(kv_cache.shape) < 1:
        raise InvalidInput(f"q {_shape(q)} or k_cache {_shape(kv_cache)} is empty")
    if tuple(cache_seqlens.shape) != (batch,):
        raise InvalidInput(f"cache_seqlens has shape {_shape(cache_seqlens)}; expected "
                           f"({batch},)")
    if block_table is None and n0 != batch:
        raise InvalidInput(f"the unpaged cache has {n0} sequences but q has batch {batch}")
    if block_table is not None and block_table.shape[0] != batch:
        raise InvalidInput(f"block_table has shape {_shape(block_table)}; expected ({batch}, "
                           "max_pages)")
    for name, t in (("q", q), ("k_cache", kv_cache)):
        step = 16 // t.element_size()  # the kernel copies 16-byte chunks
        if t.stride(-1) != 1 or any(s % step for s in t.stride()[:-1]) or t.data_ptr() % 16:
            raise InvalidInput(f"{name} has strides {t.stride()}; expected a contiguous last "
                               f"dim, other strides multiples of {step} and a 16-byte aligned "
                               "start (pass .contiguous())")
    max_pages = 1 if block_table is None else block_table.shape[1]
    return KvCacheLayout(batch, seqlen_q, heads_q, 1, LATENT_DIM, block_table is not None, n1,
                         max_pages, n0, 0)


def mla_with_kvcache(q: torch.Tensor, kv_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                     *, block_table: torch.Tensor | None = None, causal: bool = False,
                     softmax_scale: float | None = None, num_splits: int | None = None,
                     head_dim_v: int = NOPE_DIM, backend: str | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """O (B, Nq, Hq, 512) like q and the float32 LSE (B, Hq, Nq) of absorbed MLA decoding.

    q (B, Nq, Hq, 576): per query head the absorbed query (512 latent + 64 RoPE dims);
    kv_cache (num_pages, page_size, 1, 576) with ``block_table`` (B, max_pages) int32 (any
    page size), or unpaged (B, max_len, 1, 576); cache_seqlens (B,) int32 on q's device,
    the cached rows of each sequence (the query rows' own latents included). Scores are
    q . latent * softmax_scale (default 576 ** -0.5; DeepSeek passes its own), V is the first
    ``head_dim_v`` = 512 dims of each latent row. ``causal``: query row i sees key j iff
    j <= i + cache_seqlens[b] - Nq (speculative decoding's rows); a row that sees no key gets
    O = 0 and LSE = +inf. ``num_splits`` (1 to 128; None: the heuristic).

    An FP8 latent cache (FlashMLA's format: float8_e4m3fn or uint8, last dim 656 bytes per
    token, with a bf16 q; ``quantize_mla_latent``) is dequantised on chip: latent dim d is
    e4m3(d) x scale[d // 128] rounded to bf16 (exact for power-of-two scales), the RoPE
    dims as stored.

    Bad cache lengths and block-table entries are refused (InvalidInput) before the launch
    on the emulator and on the GPU with FLASHTUNE_CHECK_INPUTS=1; otherwise the kernel never
    follows them and stops with a trap."""
    layout = check_mla_inputs(q, kv_cache, cache_seqlens, block_table, head_dim_v)
    if num_splits is not None and not 0 <= num_splits <= MAX_SPLITS:
        raise InvalidInput(f"num_splits={num_splits}; expected 1 to {MAX_SPLITS}, or None")
    scale = LATENT_DIM ** -0.5 if softmax_scale is None else float(softmax_scale)
    name = backend or settings.BACKEND.get()
    # The plan is the MLA problem's: its head dim is the RoPE width (the last ROPE_DIM dims).
    kv_dtype = torch.float8_e4m3fn if fp8.is_fp8_cache(kv_cache) else None
    plan = plans.plan_for(q[..., NOPE_DIM:], causal, name, "mla", (), layout.capacity,
                          operands=plans.Operands(kv_dtype=kv_dtype))
    config = plan.source.config
    batch, seqlen_q, heads_q, _ = q.shape
    splits = num_splits or heuristic_splits(
        batch * -(-heads_q * seqlen_q // config.block_m), plan.sm_count or NOMINAL_SMS,
        -(-layout.capacity // _HEURISTIC_BLOCK_N))
    if not plan.on_gpu or settings.CHECK_INPUTS.get():
        check_cache_values(cache_seqlens, block_table, layout)
    trap = plan.on_gpu
    status = torch.zeros(STATUS_WORDS, dtype=torch.int32, device=q.device)
    o_part = torch.empty(splits, batch, heads_q, seqlen_q, NOPE_DIM, dtype=torch.float32,
                         device=q.device)
    lse_part = torch.empty(splits, batch, heads_q, seqlen_q, dtype=torch.float32,
                           device=q.device)
    plan.kernel.launch(mla_grid(batch, heads_q, seqlen_q, config.block_m, splits),
                       pack_mla_args(q, kv_cache, block_table, cache_seqlens, o_part,
                                     lse_part, status, num_splits=splits,
                                     softmax_scale=scale, trap_on_error=trap),
                       stream=plan.stream())
    if not trap and any(status.tolist()):
        raise InvalidInput(describe(status.tolist(), seqlen_new=0, capacity=layout.capacity,
                                    num_pages=layout.num_pages if layout.paged else None))
    out, lse = merge_splits(o_part, lse_part)
    return out.to(q.dtype), lse


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The combine's merge of (splits, B, H, Nq, D) partials: O (B, Nq, H, D) float32 and LSE
    (B, H, Nq), each split weighted by exp(LSE_s - LSE); a row whose splits are all empty
    (-inf) gets O = 0 and LSE = +inf, a NaN partial LSE stays NaN."""
    lse = torch.logsumexp(lse_part, dim=0)
    seen = ~torch.isneginf(lse)
    weights = torch.exp(lse_part - torch.where(seen, lse, 0.0))
    # A split with LSE -inf has weight exp(-inf) = 0 (its O is 0); a NaN LSE spreads NaN.
    o = (weights.unsqueeze(-1) * o_part).sum(0)
    return o.permute(0, 2, 1, 3), torch.where(seen, lse, float("inf"))


def attention_with_latent_cache(
    q: torch.Tensor, k_cache: torch.Tensor, cache_seqlens: torch.Tensor, *,
    block_table: torch.Tensor | None = None, k: torch.Tensor | None = None,
    v: torch.Tensor | None = None, causal: bool = False, softmax_scale: float | None = None,
    num_splits: int | None = None, return_lse: bool = False, backend: str | None = None,
    window_size: tuple[int, int] = NO_WINDOW, softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None, batch_invariant: bool | None = None,
    sinks: torch.Tensor | None = None, head_dim_v: int | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``attention_with_kvcache`` with ``v_cache=None`` (FlashMLA's convention: V is the
    first ``head_dim_v`` dims of ``k_cache``, 512 when None): ``mla_with_kvcache``, with
    O, or O and the LSE with ``return_lse``. The options the MLA kernel has not got are
    refused naming them: appending rows (k, v), a window, softcap, ALiBi, sinks and
    batch-invariant splits."""
    unsupported = [name for name, off in (
        ("k and v (appending rows)", k is None and v is None),
        ("window_size", tuple(window_size) == NO_WINDOW), ("softcap", not softcap),
        ("alibi_slopes", alibi_slopes is None), ("sinks", sinks is None),
        ("batch_invariant", not batch_invariant)) if not off]
    if unsupported:
        raise InvalidInput(f"v_cache=None (MLA decoding over a latent cache) does not take "
                           f"{', '.join(unsupported)}; leave them out, or pass a v_cache "
                           "for attention over separate K and V caches")
    out, lse = mla_with_kvcache(q, k_cache, cache_seqlens, block_table=block_table,
                                causal=causal, softmax_scale=softmax_scale,
                                num_splits=num_splits,
                                head_dim_v=NOPE_DIM if head_dim_v is None else head_dim_v,
                                backend=backend)
    return (out, lse) if return_lse else out
