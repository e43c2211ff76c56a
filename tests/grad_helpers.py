"""Test helpers of the backward pass: a differentiable attention written in plain PyTorch
(float64 reference, or the input dtype for flash-attn's error rule), gradients of a
function, seeded inputs (dense and packed), a packed attention made of a dense one per
sequence, and the error-ratio check."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch

import flashtune

Grads = dict[str, torch.Tensor]
#: (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
ShapeTuple = tuple[int, int, int, int, int]


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """O and LSE of (B, N, H, D) tensors in their own dtype, differentiable. Causal rows see
    keys j <= i + Nk - Nq; a row that sees no key has O = 0 (and a finite gradient)."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    nq, nk = q.shape[1], k.shape[1]
    visible = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if causal:
        rows = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
        visible = torch.arange(nk, device=q.device)[None, :] <= rows
    seen = visible.any(-1)[:, None]
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~seen, 0.0)
    probs = torch.softmax(scores, dim=-1).masked_fill(~seen, 0.0)
    lse = torch.logsumexp(scores, dim=-1).masked_fill(~seen[:, 0], float("inf"))
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def feature_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   window: tuple[int, int], softcap: float | None, slopes: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash-attn's scores of (B, N, H, D) tensors in plain, differentiable PyTorch, in the
    inputs' dtype: scaled, softcapped, then biased (ALiBi), not masked; with the keys each
    row sees (Nq, Nk) (the causal mask is the window (left, 0)) and V repeated over each
    GQA group: (scores (B, Hq, Nq, Nk), visible, v)."""
    from flashtune.families.fwd.reference import alibi_bias, window_visible

    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    nq, nk = q.shape[1], k.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if slopes is not None:
        scores = scores + alibi_bias(slopes, q.shape[0], nq, nk).to(scores.dtype)
    visible = window_visible(nq, nk, *((window[0], 0) if causal else window))
    return scores, visible, v


def feature_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      window: tuple[int, int], softcap: float | None,
                      slopes: torch.Tensor | None) -> torch.Tensor:
    """The attention of flash-attn's definition in plain, differentiable PyTorch, in the
    inputs' dtype: scores softcapped, then biased, then masked (a row that sees no key
    gives 0); (B, N, H, D) tensors."""
    scores, visible, v = feature_scores(q, k, v, causal, window, softcap, slopes)
    seen = visible.any(-1)[:, None]
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~seen, 0.0)
    probs = torch.softmax(scores, dim=-1).masked_fill(~seen, 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)

def gradients(fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
              dout: torch.Tensor, names: tuple[str, ...] = ("dq", "dk", "dv")) -> Grads:
    """Output and the gradients (``names``, one per input: dq, dk, dv) of ``fn`` on fresh
    leaf copies of ``inputs`` for ``dout``."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))  # type: ignore[no-untyped-call]  # unannotated in torch
    grads: Grads = {"out": out.detach()}
    for name, leaf in zip(names, leaves, strict=True):
        assert leaf.grad is not None, name
        grads[name] = leaf.grad
    return grads


def within_rule(got: Grads, low: Grads, exact: Grads, where: str) -> dict[str, float]:
    """flash-attn's rule on every entry of ``got``: max|got - exact| at most 3x max|low -
    exact| (``low``: plain PyTorch in the low precision, ``exact``: float64); asserts each
    entry is finite and within the rule, and returns the ratios.

    Plain PyTorch's error counts as at least one unit roundoff of the low precision (the
    least precise dtype in ``low``) times the entry's largest exact magnitude. Why: the rule
    compares maxima, which are stable over a large tensor but not over a few elements (a
    learned slope or sink per head): there plain PyTorch's rounding errors can cancel by
    chance to well below the precision it computes in (a 3x ratio then fails about 3 % of
    draws even when both are equally accurate). A wrong gradient is off by its own order of
    magnitude, far above the floor."""
    unit = max(torch.finfo(t.dtype).eps for t in low.values()) / 2
    ratios = {}
    for name in got:
        assert torch.isfinite(got[name]).all(), f"{where}: {name} is not finite"
        ours_err = float((got[name].double() - exact[name]).abs().max())
        plain_err = max(float((low[name].double() - exact[name]).abs().max()),
                        unit * float(exact[name].abs().max()))
        ratios[name] = (ours_err / plain_err if plain_err > 0
                        else 0.0 if ours_err == 0 else math.inf)
    print(f"{where}: error / plain-PyTorch error", {n: round(r, 3) for n, r in ratios.items()})
    for name, ratio in ratios.items():
        assert ratio <= 3.0, f"{where}: {name} error is {ratio:.2f}x plain PyTorch's (> 3x)"
    return ratios


def make_inputs(shape: ShapeTuple, head_dim: int, dtype: torch.dtype, seed: int,
                device: str = "cpu") -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Seeded standard-normal (q, k, v) and dO."""
    batch, nq, nk, hq, hkv = shape
    gen = torch.Generator().manual_seed(seed)

    def draw(n: int, h: int) -> torch.Tensor:
        return torch.randn(batch, n, h, head_dim, generator=gen).to(dtype).to(device)

    q, k, v = draw(nq, hq), draw(nk, hkv), draw(nk, hkv)
    return (q, k, v), draw(nq, hq)


def error_ratios(shape: ShapeTuple, head_dim: int, dtype: torch.dtype, causal: bool,
                 seed: int, *, backend: str = "emulator", device: str = "cpu",
                 deterministic: bool | None = None,
                 attend: Callable[..., torch.Tensor] | None = None) -> dict[str, float]:
    """flash-attn's rule: per output (O, dQ, dK, dV), max|flashtune - float64| over
    max|the same attention in plain PyTorch in ``dtype`` - float64|; asserts each <= 3.
    ``attend(q, k, v)`` replaces the call of flashtune.attention (another way in)."""
    inputs, dout = make_inputs(shape, head_dim, dtype, seed, device)
    scale = head_dim ** -0.5

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if attend is not None:
            return attend(q, k, v)
        out = flashtune.attention(q, k, v, causal=causal, backend=backend,
                                  deterministic=deterministic)
        assert isinstance(out, torch.Tensor)
        return out

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention_reference(q, k, v, causal, scale)[0]

    got = gradients(ours, inputs, dout)
    low = gradients(plain, inputs, dout)
    exact = gradients(plain, tuple(t.double() for t in inputs), dout)
    return within_rule(got, low, exact,
                       f"shape {shape} d{head_dim} {dtype} causal={causal} seed={seed}")


def packed_inputs(lens_q: list[int], lens_k: list[int], heads_q: int, heads_kv: int,
                  head_dim: int, dtype: torch.dtype, seed: int
                  ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded standard-normal packed (q, k, v) ((total, H, D), flash-attn's varlen layout),
    dO, and the int32 cumulative lengths of ``lens_q`` and ``lens_k``."""
    (q, k, v), dout = make_inputs((1, sum(lens_q), sum(lens_k), heads_q, heads_kv), head_dim,
                                  dtype, seed)

    def cumulative(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)

    return (q[0], k[0], v[0]), dout[0], cumulative(lens_q), cumulative(lens_k)


def per_sequence(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int],
                                  torch.Tensor],
                 cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor
                 ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """A packed attention (total, H, D) -> (total_q, Hq, V's D) made of a dense one:
    ``attend(q, k, v, b)`` on sequence b's (1, N, H, D) rows, the outputs concatenated
    (zeros for a sequence with no keys, none for one with no queries)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()

    def packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        parts = []
        for b in range(len(cq) - 1):
            rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            if rows.start == rows.stop:
                continue
            if keys.start == keys.stop:
                parts.append(q.new_zeros(rows.stop - rows.start, q.shape[1], v.shape[2]))
            else:
                parts.append(attend(q[None, rows], k[None, keys], v[None, keys], b)[0])
        return torch.cat(parts)
    return packed
