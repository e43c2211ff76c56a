"""Inputs and the float64 reference of the backward main kernel, and its tolerances.

The main kernel's contract, written from the definition and independently of its tiling:
with S = scale Q K^T (masked as in the forward: causal rows see keys j <= i + Nk - Nq),
P = exp(S - LSE) (0 where masked), dP = dO V^T and dS = P (dP - D),

    dV = P^T dO,   dK = scale dS^T Q,   dQ accumulator += dS K  (scaled by the convert),

with GQA's query heads summed into their kv head. LSE and D are inputs here (the forward's
LSE and the preprocess's D = rowsum(dO O)), so the reference uses the very same values.

Features (the forward's: ``fwd.reference.scaled_scores``): S is then the forward's scores
(softcapped, ALiBi-biased, masked by the window), and with softcap dS carries the tanh's
derivative: dS = P (dP - D) (1 - tanh^2(scale q.k / cap)), the gradient with respect to
scale Q K^T (the bias has derivative 1). Dropout (the forward's mask M drawn again,
``fwd.reference.dropped``): dV = (P M / (1 - p))^T dO and dS = P (dP M / (1 - p) - D).
Varlen (``varlen_stats``, ``varlen_backward_reference``): each sequence of the pack on its
own, with its number in the pack as its batch index (ALiBi's slopes, dropout's mask), its
results placed in the packed layout; rows of a sequence with no keys and keys of one with
no queries get zero gradients.
Declared score modifications (``mods``, applied to the scaled scores after softcap and
ALiBi): P is the modified scores' and dS = P (dP - D) m'(x), m' the modifications' slope at
the unmodified score x, taken by torch autograd of their float64 reference (independent of
the derivative trees the kernels are rendered from); ``dscore`` is P (dP - D), the
gradient by the modified score.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from flashtune._lazy import lazy_module
from flashtune.codegen.score_mods import ScoreMod
from flashtune.families.fwd.reference import dropped, scaled_scores
from flashtune.families.fwd.variants import VariantValues

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

#: Error allowed per element, in unit roundoffs u of the input type (``unit_roundoff`` of
#: its element: fp16 2^-11, bf16 2^-8) times the same sums over absolute values (``*_bound``
#: of the reference): P and dS are rounded to the input type before their products (as in
#: FlashAttention-2), which costs at most one u per term; four leave room for the float32
#: sums and the approximate exp2 (measured worst cases: about 1.6 u). dK and dV are also
#: rounded to the input type once when stored: u times |reference| more.
BOUND_ULPS = 4
#: Absolute error of one slope of dS the kernel computes in float32 (softcap's
#: 1 - tanh^2, a modification's derivative): a few float32 roundings (2^-24 each) of terms
#: of order one.
SLOPE_ERROR = 2.0 ** -21


#: No features.
NO_VALUES = VariantValues()


def _expand(t: torch.Tensor, group: int) -> torch.Tensor:
    return t.repeat_interleave(group, dim=2) if group > 1 else t


def softmax_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                  causal: bool, scale: float, *, values: VariantValues = NO_VALUES,
                  budget_bytes: int = 1 << 28, first_batch: int = 0,
                  mods: Sequence[ScoreMod] = ()
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's LSE and D = rowsum(dO O), float32 (B, Hq, Nq), computed in float32 on
    the inputs' device a block of query rows at a time (no more than ``budget_bytes`` of
    scores at once), for inputs of any size, with the features' ``values`` (the dropout's
    batches from ``first_batch``). Rows that see no key: LSE = +inf, D = 0."""
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    kf = _expand(k.float(), heads_q // heads_kv)
    vf = _expand(v.float(), heads_q // heads_kv)
    rows = max(1, budget_bytes // (4 * batch * heads_q * seqlen_k))
    lse = torch.empty(batch, heads_q, seqlen_q, dtype=torch.float32, device=q.device)
    dsum = torch.empty_like(lse)
    for r0 in range(0, seqlen_q, rows):
        r1 = min(seqlen_q, r0 + rows)
        scores = scaled_scores(q[:, r0:r1].float(), kf, scale, causal, **_keywords(values),
                               mods=mods, mod_values=values.mods, row0=r0,
                               seqlen_q=seqlen_q)
        part = torch.logsumexp(scores, dim=-1)
        empty = torch.isneginf(part)
        probs = torch.exp(scores - part.masked_fill(empty, 0.0)[..., None])
        if values.dropout is not None:
            probs = dropped(probs, values.dropout, first_batch, row0=r0, seqlen_q=seqlen_q)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
        lse[:, :, r0:r1] = part.masked_fill(empty, float("inf"))
        dsum[:, :, r0:r1] = (out * dout[:, r0:r1].float()).sum(-1).transpose(1, 2)
    return lse, dsum


def _keywords(values: VariantValues) -> dict[str, Any]:
    return {"window": values.window, "softcap": values.softcap or None,
            "alibi_slopes": values.alibi_slopes}


def mod_slope(unmodified: torch.Tensor, mods: Sequence[ScoreMod],
              mod_values: dict[str, object]) -> torch.Tensor:
    """d(mods applied in order) / d(score) at the float64 scores ``unmodified`` (B, Hq, Nq,
    Nk), by torch autograd of the modifications' references (0 where a mask hides)."""
    b, h, nq, nk = unmodified.shape
    device = unmodified.device
    batch, head, row, key = (
        torch.arange(n, device=device).view([-1 if i == d else 1 for i in range(4)])
        for d, n in enumerate((b, h, nq, nk)))
    x = unmodified.detach().requires_grad_(True)
    with torch.enable_grad():
        out = x
        for mod in mods:
            out = mod.apply(out, batch, head, row, key, mod_values)
        (slope,) = torch.autograd.grad(out, x, torch.ones_like(out), allow_unused=True)
    return torch.zeros_like(x) if slope is None else slope.detach()


def backward_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       dout: torch.Tensor, lse: torch.Tensor, dsum: torch.Tensor,
                       causal: bool, scale: float, values: VariantValues = NO_VALUES,
                       first_batch: int = 0, mods: Sequence[ScoreMod] = ()
                       ) -> dict[str, torch.Tensor]:
    """float64 dK, dV (B, Nk, Hkv, D) and the unscaled dQ sum dS K (B, Hq, Nq, D) (the
    dropout's batches from ``first_batch``), and
    for each the absolute allowance of subnormal roundings (``dk_floor``, ...) and the same
    sums over absolute values (``dk_bound``, ...): P |dO| for dV, and for
    dK and dQ the products with |dS|'s own bound P (|dO| |V|^T + |D|), which also covers
    the cancellation in dP - D (when it is exact, as with a single visible key, dK and dQ
    are rounding noise and only the bound gives them a scale)."""
    qd, kd, vd, dod = (t.to(torch.float64) for t in (q, k, v, dout))
    batch, seqlen_q, heads_q, dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    ke, ve = _expand(kd, group), _expand(vd, group)
    scores = scaled_scores(qd, ke, scale, causal, **_keywords(values), mods=mods,
                           mod_values=values.mods)
    lse64 = lse.to(torch.float64)[..., None]
    probs = torch.exp(scores - lse64.masked_fill(torch.isinf(lse64), 0.0))
    visible = torch.isfinite(lse64).expand_as(probs) & torch.isfinite(scores)
    probs = probs.masked_fill(~visible, 0.0)
    dprobs = torch.einsum("bqhd,bkhd->bhqk", dod, ve)
    undropped = probs
    if values.dropout is not None:  # P M / (1 - p) in dV and in dP's place in dS
        probs = dropped(probs, values.dropout, first_batch)
        dprobs = dropped(dprobs, values.dropout, first_batch)
    dscores = undropped * (dprobs - dsum.to(torch.float64)[..., None])
    dmodified = dscores
    mod_slope_abs: torch.Tensor | float = 1.0
    slope_terms: list[torch.Tensor] = []  # |each slope|, for the float32 error floor
    if mods:
        slope = mod_slope(scaled_scores(qd, ke, scale, False, **_keywords(values)), mods,
                          dict(values.mods))
        slope = torch.where(undropped == 0, 0.0, slope)
        dscores = dscores * slope
        mod_slope_abs = slope.abs()
        slope_terms.append(mod_slope_abs)
    if values.softcap:
        slope = 1.0 - torch.tanh(torch.einsum("bqhd,bkhd->bhqk", qd, ke) * scale
                                 / values.softcap) ** 2
        dscores = dscores * slope
        probs_bound = undropped * slope * mod_slope_abs
        slope_terms.append(slope.abs())
    else:
        probs_bound = undropped * mod_slope_abs

    def per_kv_head(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch, seqlen_k, heads_kv, group, t.shape[-1]).sum(3)

    # P and dS are rounded to the 16-bit type of dO (the inputs' type, or O's for FP8 inputs,
    # whose reference gets them dequantised in float64): below its smallest normal, by up to
    # half the subnormal spacing (fp16: 2^-25) absolutely, which no relative bound covers
    # (ALiBi, windows and FP8 descales make such P common). ``*_floor``: that spacing summed
    # over the visible terms.
    info = torch.finfo(dout.dtype) if dout.dtype.is_floating_point else torch.finfo(torch.float32)
    tiny = info.smallest_normal * info.eps / 2
    seen = visible.to(torch.float64)
    kept_scale = 1.0 / (1.0 - values.dropout.p) if values.dropout is not None else 1.0
    dp_terms = (torch.einsum("bqhd,bkhd->bhqk", dod.abs(), ve.abs()) * kept_scale
                + dsum.to(torch.float64).abs()[..., None])
    ds_bound = probs_bound * dp_terms
    # A slope the kernel computes in float32 from terms of order one (softcap's 1 - tanh^2,
    # a modification's derivative) is off by up to SLOPE_ERROR absolutely, however small the
    # slope: far out on tanh's tail that is most of it, which no bound relative to the
    # slope covers. The product of the slopes with that error on each, less the exact one:
    widened = torch.ones_like(probs)
    exact = torch.ones_like(probs)
    for term in slope_terms:
        widened, exact = widened * (term + SLOPE_ERROR), exact * term
    ds_slope_floor = undropped * dp_terms * (widened - exact)
    out = {} if not mods else {
        "dscore": dmodified, "dscore_floor": seen * tiny,
        "dscore_bound": undropped * (torch.einsum("bqhd,bkhd->bhqk", dod.abs(), ve.abs())
                                     * kept_scale + dsum.to(torch.float64).abs()[..., None])}
    return out | {
        "dk": per_kv_head(torch.einsum("bhqk,bqhd->bkhd", dscores, qd)) * scale,
        "dv": per_kv_head(torch.einsum("bhqk,bqhd->bkhd", probs, dod)),
        "dq_accum": torch.einsum("bhqk,bkhd->bhqd", dscores, ke),
        "dk_bound": per_kv_head(torch.einsum("bhqk,bqhd->bkhd", ds_bound, qd.abs())) * scale,
        "dv_bound": per_kv_head(torch.einsum("bhqk,bqhd->bkhd", probs, dod.abs())),
        "dq_accum_bound": torch.einsum("bhqk,bkhd->bhqd", ds_bound, ke.abs()),
        "dk_floor": per_kv_head(torch.einsum("bhqk,bqhd->bkhd", seen * tiny + ds_slope_floor,
                                             qd.abs())) * scale,
        "dv_floor": per_kv_head(torch.einsum("bhqk,bqhd->bkhd", seen, dod.abs())) * tiny,
        "dq_accum_floor": torch.einsum("bhqk,bkhd->bhqd", seen * tiny + ds_slope_floor,
                                       ke.abs()),
    }


def _sequences(values: VariantValues) -> Iterator[tuple[int, slice, slice, VariantValues]]:
    """(number, query rows, key rows, its values) of each sequence of a varlen pack: the
    values with the sequence's row of (batch, Hq) ALiBi slopes and no varlen."""
    assert values.varlen is not None, "a varlen reference needs the cumulative lengths"
    cq = values.varlen.cu_seqlens_q.tolist()
    ck = values.varlen.cu_seqlens_k.tolist()
    slopes = values.alibi_slopes
    for b in range(len(cq) - 1):
        own = slopes[b:b + 1] if slopes is not None and slopes.dim() == 2 else slopes
        yield (b, slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1]),
               dataclasses.replace(values, alibi_slopes=own, varlen=None))


def varlen_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                 causal: bool, scale: float, values: VariantValues
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax_stats`` of a packed batch (q, dO (1, total_q, Hq, D), k, v (1, total_k,
    Hkv, D)): LSE and D float32 (1, Hq, total_q), each sequence on its own (rows of a
    sequence with no keys: LSE = +inf, D = 0)."""
    lse = torch.full((1, q.shape[2], q.shape[1]), float("inf"), dtype=torch.float32,
                     device=q.device)
    dsum = torch.zeros_like(lse)
    for b, rows, keys, own in _sequences(values):
        if rows.start == rows.stop or keys.start == keys.stop:
            continue
        lse[:, :, rows], dsum[:, :, rows] = softmax_stats(
            q[:, rows], k[:, keys], v[:, keys], dout[:, rows], causal, scale, values=own,
            first_batch=b)
    return lse, dsum


def varlen_backward_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              dout: torch.Tensor, lse: torch.Tensor, dsum: torch.Tensor,
                              causal: bool, scale: float, values: VariantValues
                              ) -> dict[str, torch.Tensor]:
    """``backward_reference`` of a packed batch (layouts of ``varlen_stats``; dK, dV (1,
    total_k, Hkv, D), the dQ sum (1, Hq, total_q, D) and their bounds and floors alike):
    each sequence on its own, zeros where a sequence has no queries or no keys."""
    heads_q, dim = q.shape[2], q.shape[3]
    out = {}
    for name, like in (("dk", k), ("dv", v)):
        for suffix in ("", "_bound", "_floor"):
            out[name + suffix] = torch.zeros(like.shape, dtype=torch.float64, device=q.device)
    for suffix in ("", "_bound", "_floor"):
        out["dq_accum" + suffix] = torch.zeros(1, heads_q, q.shape[1], dim,
                                               dtype=torch.float64, device=q.device)
    for b, rows, keys, own in _sequences(values):
        if rows.start == rows.stop or keys.start == keys.stop:
            continue
        part = backward_reference(q[:, rows], k[:, keys], v[:, keys], dout[:, rows],
                                  lse[:, :, rows], dsum[:, :, rows], causal, scale, own,
                                  first_batch=b)
        for name, value in part.items():
            if name.startswith("dq_accum"):
                out[name][:, :, rows] = value
            else:
                out[name][:, keys] = value
    return out
