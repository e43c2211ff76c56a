"""Gradients through traced score and mask modifications: the autograd of ``api.flex``'s
modified attention.

The forward is the modified forward kernel; the backward runs the backward kernels
(``api.backward``: ``bwd``, or ``bwddet`` when deterministic) with the same traced feature,
so they recompute P from the modified scores and multiply dS by the modification's slope
(``codegen.trace_grad``, rendered into the kernel). A block mask's key tile ranges are
given to the backward in their column form for its own tiles (``BlockMask.tiles(...,
columns=True)``), so it skips the empty query tiles of each key tile.

Captured float tensors that require grad (a learned bias, a float ``attn_mask``) get their
gradient from the backward kernel's ``dscore`` buffer, the gradient by the modified score
at each position (float32 (B, Hq, Nq, Nk), every element written by one block or left 0),
reduced on the tensors' device with torch: per load of the tensor, its derivative times
``dscore``, summed per element in a fixed order (``trace_grad.fixed_order_sum``: a stable
sort, a scan, one write per element; no atomics). So with ``deterministic=True`` the
captured gradients are bitwise the same on every run, like dQ, dK and dV. The buffer costs
4 B Hq Nq Nk bytes, and is made only when a captured tensor requires grad.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from flashtune import settings
from flashtune.api import forward as _fwd
from flashtune.api.backward import backward
from flashtune.api.block_mask import BlockMask, with_tile_ranges
from flashtune.api.variants import Variant, kernel_features
from flashtune.codegen.trace import TracedMod
from flashtune.codegen.trace_grad import (
    captured_grads,
    derivative,
    float_loads,
    reads_score,
)
from flashtune.families.fwd.reference import scaled_scores
from flashtune.runtime import plans


@dataclass(frozen=True)
class ModifiedCall:
    """What the backward of one modified call needs besides its tensors: the traced
    modification, the call's features with the modification's values (``variant``), the
    block mask (None: none) and the call's settings."""

    traced: TracedMod
    variant: Variant
    block_mask: BlockMask | None
    causal: bool
    scale: float
    backend: str
    deterministic: bool


def needs_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, traced: TracedMod) -> bool:
    """Whether autograd must record the call: grad mode on and q, k, v or a captured float
    tensor requires grad."""
    return torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or bool(traced.grad_slots()))


def attend(call: ModifiedCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """O and LSE of the modified call, recorded for autograd: gradients flow to q, k, v and
    the captured float tensors that require grad. NotDifferentiable (naming the operation
    and the line) for a modification the backward cannot differentiate."""
    call.traced.score_slope()  # refuse before running anything
    captured = [call.traced.captured[i] for i in call.traced.grad_slots()]
    out, lse = _ModifiedAttention.apply(call, q, k, v, *captured)  # type: ignore[no-untyped-call]
    return out, lse


class _ModifiedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: ModifiedCall, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, *captured: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _fwd.forward(q, k, v, call.causal, call.scale, call.backend, call.variant)
        ctx.call = call
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None
                 ) -> tuple[Any, ...]:
        call: ModifiedCall = ctx.call
        q, k, v, out, lse = ctx.saved_tensors
        slots = call.traced.grad_slots()
        if dout is None:
            dout = torch.zeros_like(out)
        variant = call.variant
        if call.block_mask is not None:
            variant = _with_columns(call, q, k, variant)
        dscore = None
        if slots:  # dense (B, Hq, Nq, Nk); varlen: (sequences, Hq, longest Nq, longest Nk)
            batch, rows, keys = _score_grid(q, k, variant)
            dscore = torch.zeros(batch, q.shape[2], rows, keys, dtype=torch.float32,
                                 device=q.device)
        dq, dk, dv, _ = backward(dout, q, k, v, out, lse, dlse, call.causal, call.scale,
                                 call.deterministic, call.backend, variant, dscore)
        grads: tuple[Any, ...] = ()
        if dscore is not None:
            found = captured_grads(_part(call.traced), call.traced.captured, slots, dscore,
                                   _scores_if_read(call, q, k))
            grads = tuple(found[s].to(call.traced.captured[s].dtype) for s in slots)
        return (None, dq, dk, dv, *grads)


def _part(traced: TracedMod) -> Any:
    """The score part of the expression (a mask passes no gradient: P is 0 where it hides)."""
    return traced.modified if traced.modified is not None else traced.expression


def _with_columns(call: ModifiedCall, q: torch.Tensor, k: torch.Tensor, variant: Variant
                  ) -> Variant:
    """``variant`` with the block mask's column ranges for the backward kernel's tiles."""
    assert call.block_mask is not None
    op = "bwddet" if call.deterministic else "bwd"
    name = call.backend or settings.BACKEND.get()
    plan = plans.plan_for(q, call.causal, name, op, kernel_features(op, variant.features),
                          max(q.shape[1], k.shape[1]))
    config = plan.source.config
    ranges = call.block_mask.tiles(config.block_m, config.block_n, q.device, columns=True)
    return replace(variant, mods=with_tile_ranges(call.traced, dict(variant.mods), ranges))


def _score_grid(q: torch.Tensor, k: torch.Tensor, variant: Variant) -> tuple[int, int, int]:
    """(batch, rows, keys) of the score grid the captured tensors' gradients are reduced
    over: the call's (B, Nq, Nk), or a varlen call's (sequences, longest Nq, longest Nk),
    each sequence's positions at the top left (the kernel's dscore layout)."""
    varlen = variant.varlen
    if varlen is None:
        return q.shape[0], q.shape[1], k.shape[1]

    def longest(cu: torch.Tensor) -> int:
        return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return varlen.batch, longest(varlen.cu_seqlens_q), longest(varlen.cu_seqlens_k)


def _scores_if_read(call: ModifiedCall, q: torch.Tensor, k: torch.Tensor
                    ) -> torch.Tensor | None:
    """The unmodified scaled scores (B, Hq, Nq, Nk) float32, after softcap and ALiBi, when
    a captured tensor's derivative reads the score (e.g. a learned per-head scale); else
    None (an additive bias needs none). Varlen: each sequence's scores at the top left of
    its (longest Nq, longest Nk) slice (``_score_grid``), zeros elsewhere."""
    part = _part(call.traced)
    slots = frozenset(call.traced.grad_slots())
    reads = any(reads_score(derivative(part, load)) for load in float_loads(part, slots))
    if not reads:
        return None
    group = q.shape[2] // k.shape[2]
    ke = k.float().repeat_interleave(group, dim=2)
    v = call.variant
    if v.varlen is None:
        return scaled_scores(q.float(), ke, call.scale, False, softcap=v.softcap or None,
                             alibi_slopes=v.alibi_slopes)
    batch, rows, keys = _score_grid(q, k, v)
    out = torch.zeros(batch, q.shape[2], rows, keys, dtype=torch.float32, device=q.device)
    cu_q, cu_k = v.varlen.cu_seqlens_q.tolist(), v.varlen.cu_seqlens_k.tolist()
    for b in range(batch):
        qb, kb = q[:, cu_q[b]:cu_q[b + 1]].float(), ke[:, cu_k[b]:cu_k[b + 1]]
        slopes = v.alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b:b + 1]
        out[b, :, :qb.shape[1], :kb.shape[1]] = scaled_scores(
            qb, kb, call.scale, False, softcap=v.softcap or None, alibi_slopes=slopes)[0]
    return out
