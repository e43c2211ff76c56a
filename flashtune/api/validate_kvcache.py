"""Validation of the tensors handed to ``attention_with_kvcache``.

Everything that tensor metadata can tell is checked here, before a launch, with an
InvalidInput that says what was wrong, what was expected and how to fix it. What only the
data can tell (cache lengths, block-table entries, which live on the device) is checked by
``check_cache_values`` before a checked call (the emulator, or FLASHTUNE_CHECK_INPUTS=1:
nothing is written to the cache of a refused call) and otherwise by the decode kernel
itself, which never follows a bad value (see ``flashtune.families.decode.status``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashtune.api.limits import MAX_GRID_YZ, MAX_INT32, MAX_SEQLEN
from flashtune.api.validate import SUPPORTED_DEVICES, SUPPORTED_DTYPES
from flashtune.codegen.spec import MAX_HEAD_DIM, WIDE_HEAD_DIMS
from flashtune.errors import InvalidInput
from flashtune.families.decode.status import (
    BEYOND_CAPACITY,
    NEGATIVE_LENGTH,
    PAGE_INDEX,
    describe,
)

_Q = "(batch, seqlen_q, heads_q, head_dim)"
_CACHE = "(batch, max_len, heads_kv, head_dim)"
_PAGED = "(num_pages, page_size, heads_kv, head_dim)"
_NEW = "(batch, seqlen_new, heads_kv, head_dim)"
#: V's widest head dim: twice one kernel's O (a wider V runs in column chunks of
#: MAX_HEAD_DIM, ``api.decode.run_decode``), e.g. Gemma 4's 512.
MAX_V_HEAD_DIM = 2 * MAX_HEAD_DIM


@dataclass(frozen=True)
class KvCacheLayout:
    """The sizes of one validated call.

    An unpaged cache is described as ``batch`` pages of ``max_len`` rows (sequence b is page
    b), so ``capacity = page_size * max_pages`` holds for both layouts."""

    batch: int
    seqlen_q: int
    heads_q: int
    heads_kv: int
    head_dim: int
    paged: bool
    page_size: int
    max_pages: int
    num_pages: int
    seqlen_new: int
    #: V's (and O's) head dim where it is not Q/K's (None: ``head_dim``).
    head_dim_v: int | None = None

    @property
    def capacity(self) -> int:
        return self.page_size * self.max_pages

    @property
    def v_head_dim(self) -> int:
        """V's (and O's) head dim."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _named(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
           k: torch.Tensor | None, v: torch.Tensor | None) -> list[tuple[str, torch.Tensor]]:
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
             ("cache_seqlens", cache_seqlens), ("block_table", block_table), ("k", k), ("v", v)]
    return [(n, t) for n, t in named if t is not None]


_OPTIONAL = ("block_table", "k", "v")
_LAYOUTS = {"q": _Q, "k_cache": f"{_CACHE} or paged {_PAGED}",
            "v_cache": f"{_CACHE} or paged {_PAGED}", "k": _NEW, "v": _NEW,
            "cache_seqlens": "(batch,) int32", "block_table": "(batch, max_pages) int32"}


def _check_types_and_ranks(named: Sequence[tuple[str, object]]) -> None:
    ranks = {"cache_seqlens": 1, "block_table": 2}
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            fix = (" (an empty cache has cache_seqlens = torch.zeros(batch, dtype=torch.int32)"
                   ")" if name == "cache_seqlens" else "")
            raise InvalidInput(f"{name} must be a torch.Tensor {_LAYOUTS[name]}, got "
                               f"{type(t).__name__}; pass one{fix}")
        if t.is_nested or t.layout != torch.strided:
            raise InvalidInput(f"{name} is a {'nested' if t.is_nested else str(t.layout)} "
                               f"tensor; expected a dense (strided) tensor {_LAYOUTS[name]}")
        want = ranks.get(name, 4)
        if t.dim() != want:
            raise InvalidInput(f"{name} has {t.dim()} dims (shape {_shape(t)}); expected "
                               f"{want} dims {_LAYOUTS[name]}")


#: The FP8 cache type decoding serves (with k_descale, v_descale): e4m3, as FA3's.
FP8_CACHE_DTYPE = torch.float8_e4m3fn
_CACHES = ("k_cache", "v_cache")


def is_fp8_cache(k_cache: object) -> bool:
    """Whether ``k_cache`` is an e4m3 cache (the call goes to the ``decode8`` family)."""
    return isinstance(k_cache, torch.Tensor) and k_cache.dtype == FP8_CACHE_DTYPE


def _check_fp8_cache_dtype(name: str, t: torch.Tensor, q: torch.Tensor, fp8: bool) -> None:
    """InvalidInput for a cache or new rows of an FP8 type decoding does not take there."""
    if (name in _CACHES and t.dtype != FP8_CACHE_DTYPE and t.is_floating_point()
            and t.dtype.itemsize == 1):
        raise InvalidInput(f"{name} has dtype {t.dtype}; expected {q.dtype} (q's dtype) or "
                           f"{FP8_CACHE_DTYPE} (an e4m3 cache, with k_descale and v_descale): "
                           "e5m2 caches are not served. Store the cache as "
                           f"{FP8_CACHE_DTYPE}, or convert it with {name}.to(q.dtype)")
    if name in ("k", "v") and fp8 and t.dtype != q.dtype:
        raise InvalidInput(f"{name} (the new rows) has dtype {t.dtype}; expected {q.dtype}, "
                           "q's dtype: the kernel quantises new rows into the e4m3 cache with "
                           f"its descale factors. Pass them unquantised: {name}.to(q.dtype)")


def _check_dtypes_and_devices(q: torch.Tensor, named: list[tuple[str, torch.Tensor]]) -> None:
    if q.dtype not in SUPPORTED_DTYPES:
        raise InvalidInput(f"q has dtype {q.dtype}; expected torch.float16 or torch.bfloat16 "
                           f"(also beside a {FP8_CACHE_DTYPE} KV cache: only k_cache and "
                           "v_cache may be FP8). Convert with q.half() or q.bfloat16()")
    fp8 = any(name == "k_cache" and is_fp8_cache(t) for name, t in named)
    for name, t in named:
        _check_fp8_cache_dtype(name, t, q, fp8)
        want = torch.int32 if name in ("cache_seqlens", "block_table") else q.dtype
        if fp8 and name in _CACHES:
            want = FP8_CACHE_DTYPE
        if t.dtype != want:
            fix = (f"{name}.to(torch.int32)" if want == torch.int32
                   else f"(x / descale).to({FP8_CACHE_DTYPE})" if want == FP8_CACHE_DTYPE
                   else f"{name}.to(q.dtype)")
            what = ("like k_cache: an e4m3 cache holds K and V in e4m3"
                    if want == FP8_CACHE_DTYPE else "the dtype of q for the cache and new "
                    "rows, int32 for lengths and pages")
            raise InvalidInput(f"{name} has dtype {t.dtype}; expected {want} ({what}). "
                               f"Convert with {fix}")
        if t.device != q.device:
            raise InvalidInput(f"{name} is on {t.device} but q is on {q.device}; every "
                               f"tensor must be on one device (cache_seqlens and block_table "
                               f"too: they are read by the kernel). Move it with "
                               f"{name}.to(q.device)")
    if q.device.type not in SUPPORTED_DEVICES:
        raise InvalidInput(f"tensors are on {q.device}; expected CUDA tensors (or CPU tensors "
                           "with backend='emulator'). Move them with .cuda()")


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                  k: torch.Tensor | None, v: torch.Tensor | None) -> KvCacheLayout:
    batch, seqlen_q, heads_q, head_dim = q.shape
    if q.numel() == 0:
        raise InvalidInput(f"q is empty (shape {_shape(q)}); expected every dim of {_Q} >= 1")
    if tuple(k_cache.shape[:3]) != tuple(v_cache.shape[:3]):
        raise InvalidInput(f"k_cache has shape {_shape(k_cache)} but v_cache has "
                           f"{_shape(v_cache)}; expected equal shapes but for the last (head) "
                           "dim")
    n0, n1, heads_kv, head_dim_kv = k_cache.shape
    head_dim_v = v_cache.shape[3]
    layout = _PAGED if block_table is not None else _CACHE
    if head_dim_kv != head_dim:
        raise InvalidInput(f"q has head_dim {head_dim} but the cache has {head_dim_kv}; "
                           "expected equal head dims")
    if head_dim % 8 or not (head_dim <= MAX_HEAD_DIM or head_dim in WIDE_HEAD_DIMS):
        raise InvalidInput(f"head_dim={head_dim} (q and k_cache) is not supported; expected a "
                           f"multiple of 8 <= {MAX_HEAD_DIM} or one of {WIDE_HEAD_DIMS} (pad q "
                           "and the cache with zeros to one)")
    if head_dim_v % 8 or head_dim_v > MAX_V_HEAD_DIM:
        raise InvalidInput(f"v_cache's head dim {head_dim_v} is not supported; expected a "
                           f"multiple of 8 <= {MAX_V_HEAD_DIM} (V wider than {MAX_HEAD_DIM} "
                           f"runs in column chunks of {MAX_HEAD_DIM}; pad v_cache with zeros "
                           "to a multiple of 8)")
    if is_fp8_cache(k_cache) and (head_dim_v != head_dim or head_dim > MAX_HEAD_DIM):
        raise InvalidInput(f"an e4m3 cache of head dims {head_dim} (K) and {head_dim_v} (V) is "
                           f"not served: the e4m3-cache kernel (decode8) takes equal head dims "
                           f"of at most {MAX_HEAD_DIM}; use a 16-bit cache (fp16/bf16) for "
                           "these head dims")
    if min(n0, n1, heads_kv) < 1:
        raise InvalidInput(f"the cache is empty (shape {_shape(k_cache)}); expected every "
                           f"dim of {layout} >= 1")
    if heads_q % heads_kv:
        raise InvalidInput(f"q has {heads_q} heads but the cache has {heads_kv}; expected the "
                           "q heads to be a multiple of the kv heads (grouped-query attention)")
    if tuple(cache_seqlens.shape) != (batch,):
        raise InvalidInput(f"cache_seqlens has shape {_shape(cache_seqlens)}; expected "
                           f"({batch},): one length per sequence of q")
    if block_table is None:
        if n0 != batch:
            raise InvalidInput(f"the cache has {n0} sequences but q has batch {batch}; "
                               f"expected an unpaged cache {_CACHE}, or pass block_table for a "
                               f"paged cache {_PAGED}")
        page_size, max_pages, num_pages = n1, 1, batch
    else:
        if block_table.shape[0] != batch or block_table.shape[1] < 1:
            raise InvalidInput(f"block_table has shape {_shape(block_table)}; expected "
                               f"({batch}, max_pages) with max_pages >= 1")
        page_size, max_pages, num_pages = n1, block_table.shape[1], n0
    seqlen_new = 0
    if (k is None) != (v is None):
        raise InvalidInput("pass both k and v (the new rows to append) or neither")
    if k is not None and v is not None:
        want = (batch, k.shape[1], heads_kv, head_dim)
        want_v = (*want[:3], head_dim_v)
        if tuple(k.shape) != want or tuple(v.shape) != want_v or k.shape[1] < 1:
            raise InvalidInput(f"k has shape {_shape(k)} and v {_shape(v)}; expected both "
                               f"{_NEW} = (batch {batch}, seqlen_new >= 1, heads_kv "
                               f"{heads_kv}, head_dim {head_dim} for k and {head_dim_v} for v, "
                               "the caches' own)")
        seqlen_new = k.shape[1]
    if page_size * max_pages > MAX_SEQLEN or seqlen_q > MAX_SEQLEN or num_pages > MAX_INT32:
        raise InvalidInput(f"the cache capacity of {page_size * max_pages} rows per sequence, "
                           f"seqlen_q={seqlen_q} or {num_pages} pages exceed the limits "
                           f"({MAX_SEQLEN} rows: the kernel's 32-bit index arithmetic adds "
                           f"two lengths and a tile; {MAX_INT32} pages); split the call")
    group_rows = heads_q // heads_kv * seqlen_q  # one block per 16 of them at the most
    if batch > MAX_GRID_YZ or heads_kv * -(-group_rows // 16) > MAX_GRID_YZ:
        raise InvalidInput(f"batch={batch}, heads_q={heads_q}, seqlen_q={seqlen_q} exceed the "
                           f"CUDA grid limit {MAX_GRID_YZ}; split the call along batch or "
                           "queries")
    return KvCacheLayout(batch, seqlen_q, heads_q, heads_kv, head_dim, block_table is not None,
                         page_size, max_pages, num_pages, seqlen_new,
                         None if head_dim_v == head_dim else head_dim_v)


def overlapping(t: torch.Tensor) -> bool:
    """True when two different indices of ``t`` address the same element."""
    extent = 1
    for stride, size in sorted((abs(s), n) for s, n in zip(t.stride(), t.shape, strict=True)
                               if n > 1):
        if stride < extent:
            return True
        extent = stride * (size - 1) + extent
    return False


def _check_strides(named: list[tuple[str, torch.Tensor]]) -> None:
    for name, t in named:
        if name in ("cache_seqlens", "block_table"):
            if t.shape[-1] > 1 and t.stride(-1) != 1:
                raise InvalidInput(f"{name} has stride {t.stride(-1)} in its last dim; "
                                   f"expected 1. Call {name}.contiguous() first")
            continue
        if t.stride(-1) != 1:
            raise InvalidInput(f"{name} has stride {t.stride(-1)} in its last (head_dim) dim "
                               f"(strides {tuple(t.stride())}); expected 1. Call "
                               f"{name}.contiguous() first")
        for dim in range(3):
            if t.shape[dim] > 1 and t.stride(dim) % 8:
                raise InvalidInput(f"{name} has stride {t.stride(dim)} in dim {dim} (strides "
                                   f"{tuple(t.stride())}); expected multiples of 8 elements "
                                   f"(the kernel moves 16-byte chunks). Call "
                                   f"{name}.contiguous() first")
        if name in ("k_cache", "v_cache") and overlapping(t):
            raise InvalidInput(f"{name} (shape {_shape(t)}, strides {tuple(t.stride())}) has "
                               "pages or rows that share memory (an expanded or overlapping "
                               "view); appending would write one row for several. Pass a "
                               f"cache whose pages are distinct memory, e.g. "
                               f"{name}.contiguous()")


def check_kvcache_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
                         k: torch.Tensor | None = None, v: torch.Tensor | None = None
                         ) -> KvCacheLayout:
    """The layout of a call, or InvalidInput: types and ranks, dtypes (fp16/bf16 for q, the
    cache and the new rows, all equal, or an e4m3 cache beside them; int32 lengths and
    pages), one device, shapes
    (unpaged or paged cache, GQA, one length per sequence, new rows of both k and v), grid
    and int32 limits, and strides (contiguous last dims, multiples of 8 elsewhere, caches
    whose rows do not share memory)."""
    named = _named(q, k_cache, v_cache, cache_seqlens, block_table, k, v)
    # The required four are checked even when None (a clear error, not an AttributeError).
    given: list[tuple[str, object]] = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                                       ("cache_seqlens", cache_seqlens)]
    _check_types_and_ranks(given + [(n, t) for n, t in named if n in _OPTIONAL])
    _check_dtypes_and_devices(q, named)
    layout = _check_shapes(q, k_cache, v_cache, cache_seqlens, block_table, k, v)
    _check_strides(named)
    return layout


def _first(mask: torch.Tensor) -> tuple[int, ...] | None:
    """The first index (row-major) where ``mask`` holds, or None."""
    where = mask.nonzero()
    return tuple(int(i) for i in where[0]) if where.shape[0] else None


def check_cache_values(cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                       layout: KvCacheLayout) -> None:
    """InvalidInput for a bad cache length or block-table entry, or for a page that one
    sequence appends into while another slot (of any sequence) also uses it, before any
    kernel runs: so a refused call leaves the cache exactly as it was.

    It reads the lengths and the table on the host (a synchronisation on the GPU, which is
    why unchecked GPU calls leave the lengths and pages to the kernel, and do not look for
    shared pages). The messages are the kernel's own (``families.decode.status``); a page
    shared while appending is refused because the rows written into it would also be read
    or written by the other user (a race on a GPU): copy a shared prefix page before
    appending into it."""
    lengths = cache_seqlens.detach().to("cpu", torch.int64)
    new, capacity = layout.seqlen_new, layout.capacity
    num_pages = layout.num_pages if layout.paged else None

    def refuse(code: int, batch: int, index: int, value: int) -> InvalidInput:
        return InvalidInput(describe((code, batch, index, value), seqlen_new=new,
                                     capacity=capacity, num_pages=num_pages))

    for code, bad in ((NEGATIVE_LENGTH, lengths < 0),
                      (BEYOND_CAPACITY, lengths + new > capacity)):
        at = _first(bad)
        if at is not None:
            raise refuse(code, at[0], 0, int(lengths[at[0]]))
    if block_table is None:
        return  # an unpaged cache: sequence b owns rows b of its own (non-overlapping) page
    table = block_table.detach().to("cpu", torch.int64)
    slots = torch.arange(layout.max_pages)[None, :]
    used = slots < ((lengths + new + layout.page_size - 1) // layout.page_size)[:, None]
    at = _first(used & ((table < 0) | (table >= layout.num_pages)))
    if at is not None:
        raise refuse(PAGE_INDEX, at[0], at[1], int(table[at]))
    if new == 0:
        return
    written = used & (slots >= (lengths // layout.page_size)[:, None])
    users = torch.bincount(table[used], minlength=layout.num_pages)
    at = _first(written & (users[table.clamp(0, layout.num_pages - 1)] > 1))
    if at is not None:
        page = int(table[at])
        others = [(int(b), int(s)) for b, s in (used & (table == page)).nonzero()
                  if (int(b), int(s)) != at]
        b, s = others[0]
        raise InvalidInput(
            f"block_table[{at[0]}, {at[1]}] = {page}: sequence {at[0]} appends its new rows "
            f"into page {page}, which block_table[{b}, {s}] (sequence {b}) also uses; a page "
            "that receives new rows must belong to one slot of one sequence (rows written "
            "there would be read or overwritten by the other: a race on a GPU). Give the "
            "appending sequence its own copy of the page (copy-on-write) before the call")
