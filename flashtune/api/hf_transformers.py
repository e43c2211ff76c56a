"""flashtune as an attention implementation of Hugging Face transformers (an optional extra:
transformers is imported only by ``register_transformers``).

After ``name = flashtune.register_transformers()``, ``AutoModelForCausalLM.from_config(cfg,
attn_implementation=name)`` runs its attention layers on ``flashtune.attention_varlen``:
a batch with padding is unpadded (each sequence's tokens packed, flash-attn's layout); a batch
without padding runs on ``flashtune.attention`` as it is. The layers' sliding windows
(``sliding_window``: the last W tokens including the current one, the window (W - 1, 0))
and logit softcaps (``softcap``) become the kernel's features, as do gpt-oss's attention
sinks (``s_aux``, one logit per query head, passed on as ``sinks`` in float32 with its
gradient); GQA is native. The padding
mask is transformers' flash-attention one (a 2-D mask, or None when nothing is padded).
Attention dropout (``dropout``: the config's ``attention_dropout`` in train mode, 0 in eval
mode, as transformers passes it) is the kernels' ``dropout_p``.
Packed sequences (padding-free training: one row of several sequences back to back, as
``DataCollatorWithFlattening`` makes) run on ``attention_varlen`` with each sequence on its
own: the sequences are those of transformers' flash-attention kwargs (``cu_seq_lens_q``,
``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``) when it passes them, else those of
``position_ids`` (a sequence starts wherever the position does not follow the previous one,
the rule of transformers' masks for eager attention).
Training: every path has gradients (windows, softcaps, sinks and dropout included), padded
and packed batches through the varlen backward.

The default name is ``"ftune"``, not ``"flashtune"``: transformers takes every implementation
name that contains "flash" for a FlashAttention kernel package and tries to load one
(``transformers.utils.generic.is_flash_attention_requested``).
"""

from __future__ import annotations

from typing import Any

import torch

from flashtune.api.ops import attention
from flashtune.api.variants import NO_WINDOW
from flashtune.api.varlen_ops import attention_varlen
from flashtune.errors import InvalidInput

#: The dtype a float32 model's attention runs in (the kernels take fp16 or bf16).
_HALF = torch.bfloat16


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


#: The packed batch of one call: cumulative lengths of the query and key sequences (int32,
#: on the tensors' device) and the longest of each.
Packing = tuple[torch.Tensor, torch.Tensor, int, int]


def packing(query: torch.Tensor, key: torch.Tensor, padding: torch.Tensor | None,
            kwargs: dict[str, Any]) -> Packing | None:
    """The sequences of a packed batch (one row of (1, H, N, D) query and key, no padding
    mask) from transformers' flash-attention kwargs or ``position_ids`` (see the module
    doc); None when the call is not packed."""
    if padding is not None or query.shape[0] != 1:
        return None
    cu_q, cu_k, max_q, max_k = (kwargs.get(n) for n in (
        "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"))
    if (isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor)
            and max_q is not None and max_k is not None):
        return (cu_q.to(device=query.device, dtype=torch.int32),
                cu_k.to(device=key.device, dtype=torch.int32), int(max_q), int(max_k))
    positions = kwargs.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.shape[-1] != query.shape[2]:
        return None
    positions = positions.reshape(-1)
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[1:] = positions[1:] != positions[:-1] + 1
    if query.shape[2] != key.shape[2] or int(starts.sum()) < 2:
        return None
    cu = torch.nn.functional.pad(starts.nonzero().squeeze(1).to(torch.int32), (0, 1),
                                 value=positions.numel())
    longest = int(cu.diff().max())
    return cu.to(query.device), cu.to(query.device), longest, longest


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     padding: torch.Tensor | None, *, causal: bool, scaling: float | None,
                     window: tuple[int, int], softcap: float | None,
                     backend: str | None, sinks: torch.Tensor | None = None,
                     dropout_p: float = 0.0, sequences: Packing | None = None
                     ) -> torch.Tensor:
    """(B, Nq, Hq, D) attention output of transformers' (B, H, N, D) query, key and value,
    with ``padding`` (B, Nk) True on real tokens (its last Nq columns are the queries'), or
    None; padded query rows get zeros. ``sinks``: float32 (Hq,) or None. ``sequences``: the
    sequences of a packed batch of one row (``packing``), attended each on its own."""
    batch, heads_q, seqlen_q, dim = query.shape
    seqlen_k = key.shape[2]
    if sequences is not None:
        out = attention_varlen(query[0].transpose(0, 1), key[0].transpose(0, 1),
                               value[0].transpose(0, 1), *sequences, causal=causal,
                               softmax_scale=scaling, window_size=window, softcap=softcap,
                               backend=backend, sinks=sinks, dropout_p=dropout_p)
        return out[None]
    if padding is None:  # every row is a whole sequence: the batched op
        out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                        causal=causal, softmax_scale=scaling, window_size=window,
                        softcap=softcap, backend=backend, sinks=sinks, dropout_p=dropout_p)
        assert isinstance(out, torch.Tensor)
        return out
    q = query.transpose(1, 2).reshape(batch * seqlen_q, heads_q, dim)
    k = key.transpose(1, 2).reshape(batch * seqlen_k, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(batch * seqlen_k, value.shape[1], value.shape[3])
    keep_k = padding.bool()
    keep_q = keep_k[:, -seqlen_q:]
    rows_q = keep_q.reshape(-1).nonzero().squeeze(1)
    rows_k = keep_k.reshape(-1).nonzero().squeeze(1)
    lens_q, lens_k = keep_q.sum(1, dtype=torch.int32), keep_k.sum(1, dtype=torch.int32)
    if not rows_q.numel():
        raise _all_padding(tuple(padding.shape), seqlen_q)
    packed = attention_varlen(q[rows_q].contiguous(), k[rows_k].contiguous(),
                              v[rows_k].contiguous(), _cumulative(lens_q), _cumulative(lens_k),
                              int(lens_q.max()), int(lens_k.max()), causal=causal,
                              softmax_scale=scaling, window_size=window, softcap=softcap,
                              backend=backend, sinks=sinks, dropout_p=dropout_p)
    out = packed.new_zeros(batch * seqlen_q, heads_q, packed.shape[-1])
    out[rows_q] = packed
    return out.reshape(batch, seqlen_q, heads_q, -1)


def _all_padding(shape: tuple[int, ...], seqlen_q: int) -> InvalidInput:
    """The error of a batch whose query tokens are all padding. Eager attention has no
    meaningful answer for it (every score masked to the dtype's minimum: a uniform average
    of the values), so it is refused rather than imitated."""
    return InvalidInput(
        f"every query token of the batch is padding: the attention_mask {shape} has no 1 in "
        f"its last {seqlen_q} columns (1 marks a real token, 0 padding), so no row has a "
        "token to attend from; expected at least one real token. Check the mask (not "
        "inverted, one row per sequence), or skip the call for an all-padding batch")


def make_attention_function(backend: str | None = None) -> Any:
    """The function transformers calls for each attention layer (its AttentionInterface
    signature), running on ``backend`` (None: as ``flashtune.attention``)."""

    def flashtune_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            dropout: float = 0.0, scaling: float | None = None,
                            sliding_window: int | None = None, softcap: float | None = None,
                            is_causal: bool | None = None, **kwargs: Any
                            ) -> tuple[torch.Tensor, None]:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        window = NO_WINDOW
        if sliding_window is not None and sliding_window > 0:
            window = (sliding_window - 1, 0 if causal else sliding_window - 1)
        dtype = query.dtype
        if dtype == torch.float32:
            query, key, value = (t.to(_HALF) for t in (query, key, value))
        s_aux = kwargs.get("s_aux")  # gpt-oss's sinks (the model's dtype; float32 here)
        sinks = s_aux.to(torch.float32) if isinstance(s_aux, torch.Tensor) else None
        out = varlen_attention(query, key, value, attention_mask, causal=causal,
                               scaling=scaling, window=window, softcap=softcap or None,
                               backend=backend, sinks=sinks, dropout_p=float(dropout),
                               sequences=packing(query, key, attention_mask, kwargs))
        return out.to(dtype), None

    return flashtune_attention


#: The implementation name ``register_transformers`` uses unless told otherwise.
DEFAULT_NAME = "ftune"


def register_transformers(name: str = DEFAULT_NAME, backend: str | None = None) -> str:
    """Register flashtune with transformers under ``name`` (its attention function and the
    flash-attention padding mask), so that models built with ``attn_implementation=name``
    run on it; returns ``name``. ``backend`` as in ``flashtune.attention`` (``"emulator"``
    for CPU tensors). Needs the transformers package (an optional extra)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as exc:
        raise ImportError("flashtune.register_transformers needs the transformers package "
                          "(pip install transformers); it is an optional extra") from exc
    if "flash" in name:
        raise InvalidInput(f"name={name!r} contains 'flash', which transformers reserves for "
                           "FlashAttention kernel packages (it would try to load one); choose "
                           f"another name, e.g. the default {DEFAULT_NAME!r}")
    AttentionInterface.register(name, make_attention_function(backend))
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
