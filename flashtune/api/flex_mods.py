"""Ready modifications for ``flashtune.flex_attention`` (and ``attention``'s ``score_mod`` /
``mask_mod``), each written in the traced set of ``codegen.trace``, so the same functions run
in ``torch.nn.attention.flex_attention`` unchanged.

Score modifications (``score_mod(score, b, h, q_idx, kv_idx)``): ``t5_relative_bias``,
``alibi``, ``softcap``. Mask modifications (``mask_mod(b, h, q_idx, kv_idx)``, True where a
key is visible): ``causal``, ``document``, ``prefix_lm``, ``sliding_window_causal``,
``global_tokens``, ``dilated_window``, and FlashMask's column-wise kinds (``flashmask``).
Combine masks with ``both``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from flashtune.errors import InvalidInput

Fn = Callable[..., Any]


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInput(f"{name}={value!r} must be an int >= 1")
    return value


def t5_buckets(max_len: int, num_buckets: int = 32, max_distance: int = 128,
               bidirectional: bool = True) -> torch.Tensor:
    """int32 (2 max_len - 1,): the T5 bucket of each relative position kv - q, indexed by
    kv - q + max_len - 1 (Raffel et al.; exact buckets for short distances, logarithmic
    ones up to ``max_distance``)."""
    rel = torch.arange(-(max_len - 1), max_len, dtype=torch.int64)
    buckets = torch.zeros_like(rel)
    n = num_buckets
    if bidirectional:
        n //= 2
        buckets += (rel > 0).to(torch.int64) * n
        rel = rel.abs()
    else:
        rel = -torch.clamp(rel, max=0)
    exact = n // 2
    far = exact + (torch.log(rel.clamp(min=1).double() / exact)
                   / math.log(max_distance / exact) * (n - exact)).to(torch.int64)
    far = torch.clamp(far, max=n - 1)
    return (buckets + torch.where(rel < exact, rel, far)).to(torch.int32)


def t5_relative_bias(bias: torch.Tensor, max_len: int, max_distance: int = 128,
                     bidirectional: bool = True) -> Fn:
    """T5's learned relative position bias: ``bias`` (heads, num_buckets), added per head
    at the bucket of kv_idx - q_idx (sequences up to ``max_len``)."""
    if not isinstance(bias, torch.Tensor) or bias.dim() != 2:
        raise InvalidInput("bias must be a (heads, num_buckets) tensor")
    table = t5_buckets(_positive("max_len", max_len), bias.shape[1], max_distance,
                       bidirectional).to(bias.device)
    offset = max_len - 1

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + bias[h, table[kv_idx - q_idx + offset]]
    return score_mod


def alibi(slopes: torch.Tensor) -> Fn:
    """ALiBi in FlexAttention's form: ``score + slopes[h] * (kv_idx - q_idx)``."""
    if not isinstance(slopes, torch.Tensor) or slopes.dim() != 1:
        raise InvalidInput("slopes must be a (heads,) tensor")

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + slopes[h] * (kv_idx - q_idx)
    return score_mod


def softcap(cap: float) -> Fn:
    """Logit softcapping: ``cap * tanh(score / cap)``."""
    if not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap > 0):
        raise InvalidInput(f"cap={cap!r} must be a finite number > 0, e.g. 30.0")
    cap = float(cap)

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return cap * torch.tanh(score / cap)
    return score_mod


def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """The causal mask aligned to the top-left corner (FlexAttention's): kv_idx <= q_idx."""
    return q_idx >= kv_idx


def document(doc_ids: torch.Tensor, causal: bool = True) -> Fn:
    """Document masking of packed sequences: ``doc_ids`` (total,) int, the document of
    each position; a query sees the keys of its own document (and, causal, not later)."""
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() != 1:
        raise InvalidInput("doc_ids must be a 1-D integer tensor (total,)")
    if causal:
        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)
        return mask_mod

    def bidirectional(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return doc_ids[q_idx] == doc_ids[kv_idx]
    return bidirectional


def prefix_lm(prefix_lengths: torch.Tensor) -> Fn:
    """Prefix-LM: ``prefix_lengths`` (batch,) int; every query sees its sequence's prefix
    (bidirectional) and the keys up to itself."""
    if not isinstance(prefix_lengths, torch.Tensor) or prefix_lengths.dim() != 1:
        raise InvalidInput("prefix_lengths must be a 1-D integer tensor (batch,)")

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) | (kv_idx < prefix_lengths[b])
    return mask_mod


def sliding_window_causal(window: int) -> Fn:
    """Causal attention to the last ``window`` keys: q - window < kv <= q."""
    window = _positive("window", window)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
    return mask_mod


def global_tokens(num_global: int, window: int) -> Fn:
    """A symmetric window of ``window`` keys each side, plus ``num_global`` global tokens
    at the start that see and are seen by every position (Longformer, BigBird)."""
    num_global, window = _positive("num_global", num_global), _positive("window", window)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (abs(q_idx - kv_idx) <= window) | (kv_idx < num_global) | (q_idx < num_global)
    return mask_mod


def dilated_window(window: int, dilation: int) -> Fn:
    """A causal dilated window: every ``dilation``-th key, ``window`` of them, back from
    the query."""
    window, dilation = _positive("window", window), _positive("dilation", dilation)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        d = q_idx - kv_idx
        return (d >= 0) & (d < window * dilation) & (d % dilation == 0)
    return mask_mod


def _column_reader(name: str, t: torch.Tensor | None) -> Callable[[Any, Any, Any], Any] | None:
    """``read(b, h, kv_idx)`` of a FlashMask column vector (S,), (H, S) or (B, H, S) int
    (a size-1 dim is read at index 0), or None for None."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or not 1 <= t.dim() <= 3:
        raise InvalidInput(f"{name} must be an integer tensor (S,), (H, S) or (B, H, S) of "
                           "row indices, one per key column")
    full = t.reshape((1,) * (3 - t.dim()) + tuple(t.shape))
    by_batch, by_head = full.shape[0] > 1, full.shape[1] > 1

    def read(b: Any, h: Any, kv_idx: Any) -> Any:
        return full[b if by_batch else 0, h if by_head else 0, kv_idx]
    return read


def flashmask(lower_start: torch.Tensor, lower_end: torch.Tensor | None = None,
              upper_start: torch.Tensor | None = None, upper_end: torch.Tensor | None = None,
              causal: bool = True) -> Fn:
    """FlashMask's column-wise masks (Wang et al., ICLR 2025), O(N) memory: for key column j
    the rows [lower_start[j], lower_end[j]) are hidden (lower_end None: to the last row),
    and, bidirectional (``causal=False``), also the rows [upper_start[j], upper_end[j])
    (upper_start None: from row 0). Causal keeps only kv_idx <= q_idx besides. Each vector
    is (S,), (H, S) or (B, H, S) int: document, shared-question and prefix masks are
    instances."""
    lts = _column_reader("lower_start", lower_start)
    lte = _column_reader("lower_end", lower_end)
    uts = _column_reader("upper_start", upper_start)
    ute = _column_reader("upper_end", upper_end)
    if lts is None:
        raise InvalidInput("lower_start is required: per key column the first hidden row")
    if causal and (uts is not None or ute is not None):
        raise InvalidInput("upper_start / upper_end are FlashMask's bidirectional form; "
                           "pass causal=False with them")

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        hidden = q_idx >= lts(b, h, kv_idx)
        if lte is not None:
            hidden = hidden & (q_idx < lte(b, h, kv_idx))
        if ute is not None:
            upper = q_idx < ute(b, h, kv_idx)
            if uts is not None:
                upper = upper & (q_idx >= uts(b, h, kv_idx))
            hidden = hidden | upper
        return (~hidden & (q_idx >= kv_idx)) if causal else ~hidden
    return mask_mod


def both(first: Fn, second: Fn) -> Fn:
    """The mask that is True where both masks are."""
    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return first(b, h, q_idx, kv_idx) & second(b, h, q_idx, kv_idx)
    return mask_mod
