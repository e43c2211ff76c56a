"""FP8 attention through ``flashtune.attention``: e4m3 (or e5m2) q, k, v with
FlashAttention-3's descale factors, served by the FP8 forward (``families/fwd8``; sm_89 and later).

``q_descale``, ``k_descale``, ``v_descale``: float32 ``(batch, heads_kv)`` tensors on q's
device (None: 1.0), positive and finite: the attention is that of the dequantised inputs
``q_descale[b, h // group] * q`` etc. ``out_dtype``: O's type, torch.bfloat16 (the
default, as FA3) or torch.float16. The LSE is float32 (batch, heads_q, seqlen_q) as for
16-bit inputs. Causal, GQA/MQA, ``window_size``, ``softcap``, ``alibi_slopes`` and ``sinks`` are
served (softcap and ALiBi act on the scores of the dequantised inputs); the other features
are refused by name.
Forward only (FP8 tensors carry no gradient).
"""

from __future__ import annotations

import torch

from flashtune import settings
from flashtune.api.limits import check_softmax_scale
from flashtune.api.validate import FP8_DTYPES, check_fp8_attention_inputs
from flashtune.api.variants import Variant
from flashtune.errors import FeatureNotSupported, FlashtuneError, InvalidInput
from flashtune.families.fwd8 import DESCALES
from flashtune.runtime import plans

#: The output types of the FP8 forward, the default first.
OUT_DTYPES = (torch.bfloat16, torch.float16)


def is_fp8(q: object) -> bool:
    """Whether ``q`` is an FP8 tensor (the call goes to the FP8 forward)."""
    return isinstance(q, torch.Tensor) and q.dtype in FP8_DTYPES


def refuse_fp8_arguments(q: torch.Tensor, descales: tuple[torch.Tensor | None, ...],
                         out_dtype: torch.dtype | None) -> None:
    """InvalidInput for FP8-only arguments on a call with 16-bit q (an ``out_dtype`` equal
    to q's dtype is accepted: it is what the call returns)."""
    for name, value in zip(DESCALES, descales, strict=True):
        if value is not None:
            raise InvalidInput(f"{name} is given but q has dtype {q.dtype}: descale factors "
                               "are for FP8 q, k and v (torch.float8_e4m3fn or float8_e5m2); "
                               "drop it, or pass FP8 inputs")
    if out_dtype is not None and out_dtype != q.dtype:
        raise InvalidInput(f"out_dtype={out_dtype} with {q.dtype} inputs: O has the inputs' "
                           f"dtype; expected out_dtype=None or {q.dtype} (a different O type "
                           "is for FP8 inputs)")


def check_out_dtype(out_dtype: object) -> torch.dtype:
    """O's type of an FP8 call (torch.bfloat16 for None); InvalidInput naming the legal
    ones otherwise."""
    if out_dtype is None:
        return OUT_DTYPES[0]
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in OUT_DTYPES:
        raise InvalidInput(f"out_dtype={out_dtype!r} is not an output type of the FP8 "
                           "forward; expected torch.bfloat16 (the default) or torch.float16")
    return out_dtype


def check_descale(name: str, value: object, q: torch.Tensor, k: torch.Tensor,
                  sequences: int | None = None) -> torch.Tensor:
    """The descale factor ``name`` of a call: float32 (batch, heads_kv), contiguous, on q's
    device (ones for None); InvalidInput naming what is wrong and what is expected.
    ``sequences``: a packed (varlen) call's number of sequences, each of which has its
    factors (then q is (1, total_q, Hq, D))."""
    batch, heads_kv = (q.shape[0] if sequences is None else sequences), k.shape[2]
    rows = "batch" if sequences is None else "num_sequences"
    expected = f"a float32 tensor of shape ({rows}, heads_kv) = ({batch}, {heads_kv})"
    if value is None:
        return torch.ones(batch, heads_kv, dtype=torch.float32, device=q.device)
    if not isinstance(value, torch.Tensor):
        raise InvalidInput(f"{name} is a {type(value).__name__}; expected {expected}")
    if value.dtype != torch.float32:
        raise InvalidInput(f"{name} has dtype {value.dtype}; expected {expected}. Convert "
                           f"it with {name}.float()")
    if tuple(value.shape) != (batch, heads_kv):
        raise InvalidInput(f"{name} has shape {tuple(value.shape)}; expected {expected} "
                           f"(one factor per {'batch entry' if sequences is None else 'sequence'}"
                           " and KV head, as FlashAttention-3's)")
    if value.device != q.device:
        raise InvalidInput(f"{name} is on {value.device} but q is on {q.device}; move it with "
                           f"{name}.to(q.device)")
    if not value.is_contiguous():
        raise InvalidInput(f"{name} has strides {tuple(value.stride())}; expected a "
                           f"contiguous tensor. Call {name}.contiguous() first")
    return value


def refuse_features(**given: bool) -> None:
    """FeatureNotSupported naming the features a call asks of the FP8 forward."""
    asked = [name for name, on in given.items() if on]
    if asked:
        raise FeatureNotSupported(
            f"the FP8 forward (torch.float8_e4m3fn or float8_e5m2 inputs) implements causal "
            f"masks, GQA/MQA, window_size, softcap, alibi_slopes and sinks, not "
            f"{', '.join(asked)}; pass 16-bit q, k and v for those")


def fp8_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: Variant,
                softmax_scale: float | None, backend: str,
                descales: tuple[object, object, object], out_dtype: object
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """O (B, Nq, Hq, D) of ``out_dtype`` and the float32 LSE (B, Hq, Nq) of FP8 inputs,
    launched on the current stream. ``variant``: the call's validated mask and features
    (``api.variants.resolve``; with ``varlen`` q, k and v are packed as (1, total, H, D) and
    the descales are per sequence); ``softmax_scale`` None: 1/sqrt(D); ``backend`` "" means
    the FLASHTUNE_BACKEND setting."""
    check_fp8_attention_inputs(q, k, v)
    scale = check_softmax_scale(softmax_scale, q.shape[3])
    out_type = check_out_dtype(out_dtype)
    varlen = variant.varlen
    scales = tuple(check_descale(name, value, q, k, None if varlen is None else varlen.batch)
                   for name, value in zip(DESCALES, descales, strict=True))
    name = backend or settings.BACKEND.get()
    longest = (max(q.shape[1], k.shape[1]) if varlen is None
               else max(varlen.max_seqlen_q, varlen.max_seqlen_k))
    plan = plans.plan_for(q, variant.causal, name, "fwd8", variant.features, longest,
                          operands=plans.Operands(o_dtype=out_type))
    batch, seqlen_q, heads_q, head_dim = q.shape
    out = torch.empty(batch, seqlen_q, heads_q, head_dim, dtype=out_type, device=q.device)
    lse = torch.empty(batch, heads_q, seqlen_q, dtype=torch.float32, device=q.device)
    if plan.pack is None:
        raise FlashtuneError(f"the {plan.decision.problem.op!r} kernel family supplies no "
                             "hot-path packer")
    grid, args = plan.pack(q, k, v, out, lse, scale, variant, descales=scales)
    bad = [n for n, t in (("q", q), ("k", k), ("v", v)) if t.data_ptr() % 16]
    if bad:
        raise InvalidInput(f"{', '.join(bad)} start(s) at an address that is not 16-byte "
                           "aligned; the kernel loads 16-byte chunks. Pass a copy made with "
                           ".clone() or .contiguous()")
    plan.kernel.launch(grid, args, stream=plan.stream())
    return out, lse
