"""FlexAttention's programming model on flashtune's kernels: the traced modifications
behind ``attention``'s ``score_mod`` and ``mask_mod``, ``flex_attention``'s
(``api.flex_call``) and SDPA's ``attn_mask``.

A call traces its ``score_mod`` and ``mask_mod`` (``codegen.trace``) into one score
modification, registers it once per process as a feature named by its digest (so its
kernels are keyed, cached and tuned like a built-in feature's) and runs the mma.sync forward
with it; captured tensors are passed as kernel arguments on every call (their values may
change between calls; their number, dims and kinds are part of the key). Gradients flow to
q, k, v and the captured float tensors that require grad (``api.flex_grad``); varlen calls
with a modification give q, k and v their gradients, not captured tensors
(BackwardNotAvailable); decoding is forward only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from flashtune import settings
from flashtune.api import forward as _fwd
from flashtune.api.block_mask import BlockMask, with_tile_ranges
from flashtune.api.flex_grad import ModifiedCall, attend, needs_grad
from flashtune.api.variants import Variant
from flashtune.codegen.features import Feature, feature, register_feature
from flashtune.codegen.trace import TracedMod, trace
from flashtune.errors import BackwardNotAvailable, InvalidInput, InvalidProblem

ScoreModFn = Callable[..., Any]
MaskModFn = Callable[..., Any]

_register_lock = threading.Lock()


def traced_feature(traced: TracedMod) -> str:
    """The name of ``traced``'s feature, registered on first use (the same expression
    always gives the same name and the same declaration)."""
    with _register_lock:
        try:
            feature(traced.name)
        except InvalidProblem:
            register_feature(Feature(traced.name, traced.name,
                                     f"a traced score modification ({traced.name})",
                                     score=traced.score_mod()))
    return traced.name


def refuse_grad(*tensors: torch.Tensor, what: str = "this modified call") -> None:
    """BackwardNotAvailable when grad mode is on and one of ``tensors`` requires grad: for
    the modified calls that have a forward pass only (``what``)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise BackwardNotAvailable(
            f"{what} has a forward pass only in flashtune so far; expected inputs that do "
            "not require grad. Call it under torch.no_grad() or pass detached tensors")


def modified_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: Variant,
                     scale: float, backend: str, score_mod: ScoreModFn | None,
                     mask_mod: MaskModFn | None, block_mask: BlockMask | None = None,
                     deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """O and LSE of validated flash-attn-layout inputs with ``variant``'s features and the
    traced ``score_mod`` / ``mask_mod``; ``block_mask``: the kernels walk only the tiles it
    marks non-empty (its ``mask_mod`` is then the one traced). Recorded for autograd when
    q, k, v or a captured float tensor requires grad (``api.flex_grad``; the backward is
    deterministic with ``deterministic``; varlen calls included, b being the sequence)."""
    traced = trace(score_mod, mask_mod, tiles=block_mask is not None)
    name = traced_feature(traced)
    values = traced.values(q.device)
    with_mod = replace(variant, traced=(name,), mods=values)
    if block_mask is not None:
        plan = _fwd.plan_for(q, k, variant.causal, backend or settings.BACKEND.get(), "fwd",
                             with_mod.features)
        config = plan.decision.config
        ranges = block_mask.tiles(config.block_m, config.block_n, q.device)
        with_mod = replace(with_mod, mods=with_tile_ranges(traced, values, ranges))
    if needs_grad(q, k, v, traced):
        return attend(ModifiedCall(traced, with_mod, block_mask, variant.causal, scale,
                                   backend, deterministic), q, k, v)
    return _fwd.forward(q, k, v, variant.causal, scale, backend, with_mod)


def check_bhsd(query: object, key: object, value: object, enable_gqa: bool) -> None:
    """InvalidInput unless query, key and value are 4-D (B, H, S, D) tensors (torch's
    layout) with equal head counts or ``enable_gqa``."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidInput(f"{name} is {shape}; expected a 4-D tensor (batch, heads, "
                               "seqlen, head_dim). Add a batch dim with unsqueeze(0)")
    assert isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise InvalidInput(f"query has {query.shape[1]} heads but key/value have "
                           f"{key.shape[1]}; expected equal head counts, or enable_gqa=True "
                           "for grouped-query attention")


def attn_mask_mods(attn_mask: torch.Tensor, shape: tuple[int, int, int, int]
                   ) -> tuple[ScoreModFn | None, MaskModFn | None]:
    """SDPA's ``attn_mask`` as a traced modification of a call of ``shape`` (B, H, L, S):
    a bool mask (True: visible) as a mask_mod, a float mask as an additive score_mod, read
    from the captured mask at each position (a broadcast dim is read at index 0).
    InvalidInput unless bool or floating and broadcastable to ``shape``."""
    if not isinstance(attn_mask, torch.Tensor):
        raise InvalidInput(f"attn_mask is a {type(attn_mask).__name__}; expected a bool or "
                           "float tensor broadcastable to (B, H, L, S)")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise InvalidInput(f"attn_mask has dtype {attn_mask.dtype}; expected torch.bool (True: "
                           "attend) or a floating type (added to the scores)")
    dims = attn_mask.dim()
    if dims > 4 or any(n not in (1, want) for n, want in
                       zip(reversed(attn_mask.shape), reversed(shape[4 - dims:]),
                           strict=True)):
        raise InvalidInput(f"attn_mask has shape {tuple(attn_mask.shape)}; expected one "
                           f"broadcastable to (B, H, L, S) = {shape}")
    mask = attn_mask.reshape((1,) * (4 - dims) + tuple(attn_mask.shape))
    vary = tuple(n > 1 for n in mask.shape)

    def at(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        i = [x if on else 0 for x, on in zip((b, h, q_idx, kv_idx), vary, strict=True)]
        return mask[i[0], i[1], i[2], i[3]]

    if attn_mask.dtype == torch.bool:
        return None, at

    def additive(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + at(b, h, q_idx, kv_idx)
    return additive, None

