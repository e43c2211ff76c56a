"""FP8 attention for training: ``flashtune.attention_fp8`` quantises 16-bit q, k, v to FP8,
runs the FP8 forward (``fwd8``) and, for ``loss.backward()``, the FP8 backward (``bwd8``).

The quantisation is per (batch, KV head), FA3's descale shape: each slice's largest
magnitude maps to the format's largest finite value (448 for e4m3, 57344 for e5m2), the
values are divided by the descale ``amax / max`` and rounded to nearest even (torch's
conversion, saturating). Only the FP8 tensors and their descales are kept for the backward
(half the bytes of 16-bit copies). The forward is the attention of the dequantised inputs;
the backward returns the gradients of that attention with respect to the dequantised inputs
to q, k and v as they are (the quantiser passes gradients straight through, as FP8
training recipes do), in q's dtype. P and dS stay 16-bit in the backward (why:
``families/bwd8``).

Served: causal, GQA/MQA, ``window_size``, ``softcap``, ``alibi_slopes``; on sm_89 and
later (FP8 tensor cores), head dims that are multiples of 32.
"""

from __future__ import annotations

from typing import Any

import torch

from flashtune.api.backward import backward
from flashtune.api.fp8 import fp8_forward
from flashtune.api.limits import check_softmax_scale
from flashtune.api.ops import deterministic_flag
from flashtune.api.validate import check_attention_inputs
from flashtune.api.variants import Variant, resolve
from flashtune.errors import InvalidInput

#: The FP8 formats q, k, v may be quantised to.
FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantise(x: torch.Tensor, heads_kv: int, fmt: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (B, N, H, D) in ``fmt`` and its descale factors, float32 (B, heads_kv): one per
    batch entry and KV head (a query head takes its KV head's), ``amax / max`` of the slice
    (the range used fully; an all-zero slice gets the smallest normal float)."""
    batch, rows, heads, dim = x.shape
    group = heads // heads_kv
    amax = x.detach().abs().float().view(batch, rows, heads_kv, group, dim).amax(dim=(1, 3, 4))
    descale = (amax / torch.finfo(fmt).max).clamp_min(torch.finfo(torch.float32).tiny)
    per_head = descale.repeat_interleave(group, dim=1)[:, None, :, None]
    return (x.detach().float() / per_head).to(fmt), descale


class _Fp8Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                variant: Variant, scale: float, fmt: torch.dtype, backend: str,
                deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
        heads_kv = k.shape[2]
        (q8, qs), (k8, ks), (v8, vs) = (quantise(t, heads_kv, fmt) for t in (q, k, v))
        out, lse = fp8_forward(q8, k8, v8, variant, scale, backend, (qs, ks, vs), q.dtype)
        ctx.save_for_backward(q8, k8, v8, qs, ks, vs, out, lse)
        ctx.call = (variant, scale, backend, deterministic)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None
                 ) -> tuple[Any, ...]:
        q8, k8, v8, qs, ks, vs, out, lse = ctx.saved_tensors
        variant, scale, backend, deterministic = ctx.call
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, _ = backward(dout, q8, k8, v8, out, lse, dlse, variant.causal, scale,
                                 deterministic, backend, variant, descales=(qs, ks, vs))
        return dq, dk, dv, None, None, None, None, None


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  softmax_scale: float | None = None,
                  window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                  alibi_slopes: torch.Tensor | None = None,
                  fp8_dtype: torch.dtype = torch.float8_e4m3fn, return_lse: bool = False,
                  deterministic: bool | None = None, backend: str | None = None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of 16-bit q (B, Nq, Hq, D), k, v (B, Nk, Hkv, D) quantised to ``fp8_dtype``
    per (batch, KV head) (module doc), differentiable: O (and with ``return_lse`` the
    float32 LSE (B, Hq, Nq)) in q's dtype; ``loss.backward()`` runs the FP8 backward
    (``deterministic``: bitwise reproducible gradients, as ``flashtune.attention``'s). The
    masks and features as ``flashtune.attention``'s of the same names. InvalidInput naming
    the argument for a bad input; InvalidConfig on a GPU without FP8 tensor cores."""
    check_attention_inputs(q, k, v)
    if fp8_dtype not in FORMATS:
        raise InvalidInput(f"fp8_dtype={fp8_dtype!r}; expected torch.float8_e4m3fn (the "
                           "default) or torch.float8_e5m2")
    if not isinstance(causal, bool):
        raise InvalidInput(f"causal={causal!r} must be a bool (True or False)")
    if q.shape[3] % 32:
        raise InvalidInput(f"head dim {q.shape[3]}: the FP8 kernels take multiples of 32; pad "
                           f"q, k and v with zeros to {-(-q.shape[3] // 32) * 32}")
    scale = check_softmax_scale(softmax_scale, q.shape[3])
    variant = resolve(causal, window_size, softcap, alibi_slopes, q, q.shape[0],
                      (q.shape[1], k.shape[1]))
    ordered = deterministic_flag(deterministic)
    out, lse = _Fp8Attention.apply(q, k, v, variant, scale, fp8_dtype,  # type: ignore[no-untyped-call]
                                   backend or "", ordered)
    return (out, lse) if return_lse else out
