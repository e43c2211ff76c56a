"""``flashtune.flex_attention``: FlexAttention's entry point on flashtune's kernels, in its
(B, H, S, D) layout. A call with a ``score_mod`` or a block mask runs the traced
modification (``api.flex``, its gradients ``api.flex_grad``); one with neither is a plain
``flashtune.attention`` call.
"""

from __future__ import annotations

import torch

from flashtune.api import ops
from flashtune.api.block_mask import BlockMask
from flashtune.api.flex import ScoreModFn, check_bhsd, modified_forward
from flashtune.api.limits import check_softmax_scale
from flashtune.api.validate import check_attention_inputs
from flashtune.api.variants import Variant, pad_head_dim
from flashtune.errors import InvalidInput


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   score_mod: ScoreModFn | None = None, block_mask: BlockMask | None = None,
                   scale: float | None = None, enable_gqa: bool = False,
                   return_lse: bool = False, *, backend: str | None = None,
                   deterministic: bool | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``torch.nn.attention.flex_attention.flex_attention`` on flashtune's kernels.

    query (B, Hq, L, D), key and value (B, Hkv, S, D), fp16 or bf16 (Hq a multiple of Hkv
    with ``enable_gqa``); ``score_mod(score, b, h, q_idx, kv_idx)`` returns the new scaled
    score; ``block_mask`` (``create_block_mask``) hides the keys its ``mask_mod`` rejects
    and lets the kernel skip the key tiles it marks empty. ``scale`` defaults to
    1/sqrt(D). Returns O (B, Hq, L, D) (a transposed view), and with ``return_lse`` the
    natural-log LSE (B, Hq, L) float32; a row that sees no key has O = 0 and LSE = -inf, as
    in FlexAttention. ``backend``: as in ``flashtune.attention`` (``"emulator"`` runs CPU
    tensors). Gradients flow to query, key, value and the tensors the modifications
    capture that require grad (a learned bias), through the backward kernels (their block
    mask skipping included); ``deterministic`` as in ``flashtune.attention`` (None follows
    ``torch.use_deterministic_algorithms``): True makes every gradient, the captured ones
    included, bitwise reproducible.
    """
    check_bhsd(query, key, value, enable_gqa)
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise InvalidInput(f"block_mask is a {type(block_mask).__name__}; expected a "
                           "flashtune BlockMask from flashtune.create_block_mask")
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    dim = None
    if q.shape[-1] % 8:
        q, k, v, dim = pad_head_dim(q, k, v)
    check_attention_inputs(q, k, v)
    softmax_scale = check_softmax_scale(scale, dim or q.shape[3])
    name = "" if backend is None else backend
    variant = Variant(False)
    if block_mask is not None:
        block_mask.check_call(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    mask_mod = block_mask.mask_mod if block_mask is not None else None
    ordered = ops.deterministic_flag(deterministic)
    if score_mod is None and mask_mod is None:
        out, lse = ops.attention(q, k, v, softmax_scale=softmax_scale, return_lse=True,
                                 backend=backend, deterministic=ordered)
    else:
        out, lse = modified_forward(q, k, v, variant, softmax_scale, name, score_mod,
                                    mask_mod, block_mask, ordered)
    if dim is not None:
        out = out[..., :dim]
    out = out.transpose(1, 2)
    if not return_lse:
        return out
    return out, torch.where(lse == float("inf"), float("-inf"), lse)
