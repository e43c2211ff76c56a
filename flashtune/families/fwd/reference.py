"""The float64 reference of attention: the one reference that verification, tests and
benchmarks compare against (its tolerances, shared with every family that writes O and LSE,
are in families/checks.py).

Written from the definition, independently of any kernel's tiling: S = scale * Q K^T,
masked (causal: query row i sees key j iff j <= i + Nk - Nq, bottom-right aligned), softmax
over keys, O = P V, LSE = log(sum(exp(S))) in natural log. GQA: query head h reads key/value
head h // (Hq / Hkv). A row that sees no key has O = 0 and LSE = +inf.

Features: a sliding window (left, right) hides key j from row i unless
i + Nk - Nq - left <= j <= i + Nk - Nq + right (-1: that side unbounded); softcap replaces
S by cap * tanh(S / cap); ALiBi adds -slope[b, h] * |i + Nk - Nq - j| (after the softcap).
Declared score modifications (``codegen.score_mods``) then apply in key order to the scaled
(capped, biased) scores, with the batch, query head, row and key of each score. Varlen
(``varlen_reference``): each sequence of a packed batch on its own (its batch index: its
number in the pack). Sinks (gpt-oss): a logit per query head, not scaled, joins each row's
softmax denominator and contributes no value: LSE = log(exp(sink) + sum exp(S)), O = P V
with P = exp(S - LSE); a row that sees no key then has O = 0 and LSE = sink. Dropout
(``dropout``): P becomes P M / (1 - p) before P V, M the kept mask of
``fwd.dropout.kept_mask``; the LSE is the undropped softmax's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from flashtune._lazy import lazy_module
from flashtune.codegen.score_mods import ScoreMod
from flashtune.families.checks import causal_visible
from flashtune.families.fwd.args import DropoutArgs
from flashtune.families.fwd.dropout import kept_tensor

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


def window_visible(seqlen_q: int, seqlen_k: int, left: int, right: int,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """(Nq, Nk) bool: query row i sees key j iff i + Nk - Nq - left <= j <= i + Nk - Nq +
    right, a bound of -1 being absent (flash-attn's sliding window)."""
    rel = (torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
           - torch.arange(seqlen_k, device=device)[None, :])  # i + Nk - Nq - j
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= rel <= left
    if right >= 0:
        visible &= rel >= -right
    return visible


def alibi_bias(slopes: torch.Tensor, batch: int, seqlen_q: int, seqlen_k: int
               ) -> torch.Tensor:
    """float64 (B, H, Nq, Nk) bias -slope * |i + Nk - Nq - j| of slopes (H,) or (B, H)."""
    rel = (torch.arange(seqlen_q, device=slopes.device)[:, None] + (seqlen_k - seqlen_q)
           - torch.arange(seqlen_k, device=slopes.device)[None, :])
    per_head = slopes.to(torch.float64).expand(batch, slopes.shape[-1])
    return -per_head[:, :, None, None] * rel.abs().to(torch.float64)


def scaled_scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, *,
                  window: tuple[int, int] = (-1, -1), softcap: float | None = None,
                  alibi_slopes: torch.Tensor | None = None, mods: Sequence[ScoreMod] = (),
                  mod_values: Mapping[str, object] = {}, first_batch: int = 0,
                  row0: int = 0, seqlen_q: int | None = None,
                  mod_row0: int | None = None) -> torch.Tensor:
    """The scores softmax reads, (B, Hq, rows, Nk) in q's float type: S = scale q k^T with
    the features of the module doc, -inf where masked. q (B, rows, Hq, D) holds rows
    ``row0`` on of a query sequence of ``seqlen_q`` rows (default: all of them); k
    (B, Nk, Hq, D) is already expanded to the query heads. ``mods`` take their params
    from ``mod_values`` and see batch indices from ``first_batch`` and the first row as
    q_idx ``mod_row0`` (default ``row0``; decoding: the new rows' absolute position)."""
    rows, seqlen_k = q.shape[1], k.shape[1]
    seqlen_q = rows if seqlen_q is None else seqlen_q
    part = slice(row0, row0 + rows)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        bias = alibi_bias(alibi_slopes.to(q.device), q.shape[0], seqlen_q, seqlen_k)
        scores = scores + bias[:, :, part].to(scores.dtype)
    if mods:
        b, h, nq, nk = scores.shape

        def index(n: int, dim: int, start: int = 0) -> torch.Tensor:
            shape = [1, 1, 1, 1]
            shape[dim] = n
            return torch.arange(start, start + n, device=q.device).view(shape)
        where = (index(b, 0, first_batch), index(h, 1),
                 index(nq, 2, row0 if mod_row0 is None else mod_row0), index(nk, 3))
        for mod in mods:
            scores = mod.apply(scores, *where, dict(mod_values)).to(scores.dtype)
    if causal:
        visible = causal_visible(seqlen_q, seqlen_k, q.device)[part]
        scores = scores.masked_fill(~visible, float("-inf"))
    if window != (-1, -1):
        visible = window_visible(seqlen_q, seqlen_k, *window, device=q.device)[part]
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def dropped(probs: torch.Tensor, dropout: DropoutArgs, first_batch: int = 0, row0: int = 0,
            seqlen_q: int | None = None) -> torch.Tensor:
    """float64 P M / (1 - p) of probabilities (B, Hq, rows, Nk) holding rows ``row0`` on of
    a query sequence of ``seqlen_q`` rows (default: all), batches from ``first_batch``."""
    batch, heads, rows, seqlen_k = probs.shape
    kept = kept_tensor(dropout.seed, dropout.offset, dropout.p, heads,
                       rows if seqlen_q is None else seqlen_q, seqlen_k,
                       range(first_batch, first_batch + batch), probs.device)
    scale = 1.0 / (1.0 - float(torch.tensor(dropout.p, dtype=torch.float32)))
    return probs * kept[:, :, row0:row0 + rows].to(probs.dtype) * scale


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float, *, window: tuple[int, int] = (-1, -1),
                        softcap: float | None = None,
                        alibi_slopes: torch.Tensor | None = None,
                        mods: Sequence[ScoreMod] = (), mod_values: Mapping[str, object] = {},
                        first_batch: int = 0, sinks: torch.Tensor | None = None,
                        dropout: DropoutArgs | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 O (B, Nq, Hq, Dv) and LSE (B, Hq, Nq) from (B, N, H, D) tensors (V's head
    dim Dv may differ from Q/K's D), with the
    features of the module doc (causal and a window combine: both masks apply); ``mods``
    take their params from ``mod_values`` and see batch indices from ``first_batch``;
    ``sinks``: (Hq,) logits joined to each row's denominator."""
    qd, kd, vd = (t.to(torch.float64) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kd = kd.repeat_interleave(group, dim=2)
    vd = vd.repeat_interleave(group, dim=2)
    scores = scaled_scores(qd, kd, scale, causal, window=window, softcap=softcap,
                           alibi_slopes=alibi_slopes, mods=mods, mod_values=mod_values,
                           first_batch=first_batch)
    lse = torch.logsumexp(scores, dim=-1)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(device=lse.device, dtype=lse.dtype)[:, None])
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0)[..., None])
    if dropout is not None:
        probs = dropped(probs, dropout, first_batch)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vd)
    return out, lse.masked_fill(empty, float("inf"))


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, causal: bool,
                     scale: float, *, window: tuple[int, int] = (-1, -1),
                     softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                     mods: Sequence[ScoreMod] = (), mod_values: Mapping[str, object] = {},
                     sinks: torch.Tensor | None = None, dropout: DropoutArgs | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 O (total_q, Hq, D) and LSE (Hq, total_q) of packed (total, H, D) tensors:
    sequence b is rows cu_seqlens[b] to cu_seqlens[b + 1] - 1, attended on its own (a
    sequence with no keys has O = 0 and LSE = +inf, or the sink with ``sinks``; one with
    no queries has no rows)."""
    total_q, heads_q = q.shape[:2]
    out = torch.zeros(total_q, heads_q, v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full((heads_q, total_q), float("inf"), dtype=torch.float64, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            if sinks is not None:
                lse[:, q0:q1] = sinks.to(torch.float64)[:, None]
            continue
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes
        o_b, lse_b = attention_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal,
                                         scale, window=window, softcap=softcap,
                                         alibi_slopes=slopes, mods=mods,
                                         mod_values=mod_values, first_batch=b, sinks=sinks,
                                         dropout=dropout)
        out[q0:q1] = o_b[0]
        lse[:, q0:q1] = lse_b[0]
    return out, lse
