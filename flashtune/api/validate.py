"""Validation of the tensors handed to the public attention API.

``check_attention_inputs`` runs on every call, so the success path is a handful of attribute
reads and comparisons; the detailed messages are only built once something is wrong. It uses
nothing but tensor metadata (no data pointers), so torch.compile traces it without a graph
break. Every error is an InvalidInput that says what was wrong, what was expected and how to
fix it.
"""

from __future__ import annotations

import math

import torch

from flashtune.api.limits import MAX_GRID_YZ, MAX_SEQLEN, seqlen_error
from flashtune.api.limits import check_softmax_scale as check_softmax_scale
from flashtune.codegen.spec import MAX_HEAD_DIM, WIDE_HEAD_DIMS
from flashtune.errors import InvalidInput

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
_DTYPES = frozenset(SUPPORTED_DTYPES)
_STRIDED = torch.strided
#: Device types whose tensors reach a kernel (cuda, cpu for the emulator) or only the fake
#: implementation (meta, for shape inference and tracing).
SUPPORTED_DEVICES = ("cuda", "cpu", "meta")

_LAYOUT = "(batch, seqlen, heads, head_dim)"


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check_types(q: object, k: object, v: object) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InvalidInput(f"{name} must be a torch.Tensor {_LAYOUT}, got "
                               f"{type(t).__name__}; convert it with torch.as_tensor")


def _check_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.is_nested:
            raise InvalidInput(
                f"{name} is a nested tensor; expected a dense (strided) tensor {_LAYOUT}. Pad "
                "the sequences to one length (torch.nested.to_padded_tensor) or make one call "
                "per sequence")
        if t.layout != torch.strided:
            raise InvalidInput(
                f"{name} has layout {t.layout}; expected a dense (strided) tensor {_LAYOUT}. "
                f"Convert it with {name}.to_dense()")


def _check_rank(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise InvalidInput(
                f"{name} has {t.dim()} dims (shape {_shape(t)}); expected 4 dims {_LAYOUT}. "
                "For torch's (batch, heads, seqlen, head_dim) layout use "
                "flashtune.scaled_dot_product_attention; add a batch dim with unsqueeze(0)"
            )


def _check_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dtype not in SUPPORTED_DTYPES:
        raise InvalidInput(f"q has dtype {q.dtype}; expected torch.float16 or torch.bfloat16. "
                           "Convert with q.half() or q.bfloat16()")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise InvalidInput(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k and v "
                               f"must share one dtype. Convert with {name}.to(q.dtype)")


def _check_devices(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise InvalidInput(f"{name} is on {t.device} but q is on {q.device}; q, k and v "
                               f"must be on one device. Move it with {name}.to(q.device)")
    if q.device.type not in SUPPORTED_DEVICES:
        raise InvalidInput(f"tensors are on {q.device}; expected CUDA tensors (or CPU tensors "
                           "with backend='emulator'). Move them with .cuda()")


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  split_v: bool = False) -> None:
    split = tuple(k.shape[:3]) == tuple(v.shape[:3]) and k.shape[3] != v.shape[3]
    # Q/K of one of WIDE_HEAD_DIMS (the forward): V's head dim up to theirs, run in column
    # chunks of at most MAX_HEAD_DIM (api.forward).
    wide = split_v and k.dim() == 4 and k.shape[3] in WIDE_HEAD_DIMS
    if split and not split_v:
        raise InvalidInput(
            f"v has head dim {v.shape[3]} but q and k have {k.shape[3]}: this call takes one "
            "head dim for Q, K and V (flashtune.attention's forward takes a V head dim of its "
            "own). Pad the smaller one with zeros to the larger (v padded: slice the output's "
            "last dim back; q and k padded: keep softmax_scale at 1/sqrt of their original "
            "head dim)")
    if split:
        dim_v = v.shape[3]
        if dim_v > (k.shape[3] if wide else MAX_HEAD_DIM):
            raise InvalidInput(f"v has head dim {dim_v}; the limit is {MAX_HEAD_DIM} (the O "
                               f"accumulators of one block), or q's and k's head dim where "
                               f"that is one of {WIDE_HEAD_DIMS} (run in column chunks). Use "
                               "another implementation for larger heads")
        if dim_v % 8:
            raise InvalidInput(
                f"v has head dim {dim_v}; expected a multiple of 8 for a V head dim other "
                f"than q's and k's ({k.shape[3]}). Pad v with zeros to {8 * math.ceil(dim_v / 8)}"
                " and slice the output's last dim back")
    elif tuple(k.shape) != tuple(v.shape):
        same = ("batch, seqlen and heads (v's head dim may differ)" if split_v
                else f"shapes {_LAYOUT} (one value per key, same head dim)")
        raise InvalidInput(f"k has shape {_shape(k)} but v has {_shape(v)}; expected equal "
                           f"{same}")
    batch, seqlen_q, heads_q, head_dim = q.shape
    batch_k, seqlen_k, heads_kv, head_dim_k = k.shape
    if batch_k != batch:
        raise InvalidInput(f"q has batch {batch} but k and v have {batch_k} (q {_shape(q)}, "
                           f"k {_shape(k)}); expected equal batch sizes {_LAYOUT}")
    if head_dim_k != head_dim:
        raise InvalidInput(f"q has head_dim {head_dim} but k and v have {head_dim_k}; "
                           f"expected equal head dims (last dim of {_LAYOUT})")
    for name, t in (("q", q), ("k", k)):
        if t.numel() == 0:
            raise InvalidInput(f"{name} is empty (shape {_shape(t)}); expected every dim of "
                               f"{_LAYOUT} >= 1. Skip the call for empty inputs")
    if head_dim > MAX_HEAD_DIM and not wide:
        also = (f"; flashtune.attention's forward also takes {WIDE_HEAD_DIMS}" if not split_v
                else f", or one of {WIDE_HEAD_DIMS}")
        raise InvalidInput(f"head_dim={head_dim} is not supported; the limit is {MAX_HEAD_DIM} "
                           "(the largest head dim whose O accumulators and K/V tiles fit the "
                           f"registers and shared memory of one block){also}. Use another "
                           "implementation for larger heads")
    if head_dim % 8:
        hint = 8 * math.ceil(head_dim / 8)
        raise InvalidInput(f"head_dim={head_dim} is not supported here; expected a multiple of "
                           f"8: pad q, k and v with zeros to head_dim {hint} (set "
                           f"softmax_scale to 1/sqrt({head_dim}) to keep the original "
                           "scaling); flashtune.attention does this itself")
    if heads_q % heads_kv:
        raise InvalidInput(f"q has {heads_q} heads but k and v have {heads_kv}; expected the "
                           "number of q heads to be a multiple of the k/v heads (grouped-query "
                           "attention). Repeat k and v along the heads dim to match")
    if batch > MAX_GRID_YZ or heads_q > MAX_GRID_YZ:
        raise InvalidInput(f"batch={batch}, heads={heads_q}; expected both <= {MAX_GRID_YZ} "
                           "(CUDA grid limit). Split the call along batch or heads")
    error = seqlen_error(seqlen_q, seqlen_k)
    if error is not None:
        raise error


def _check_strides(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise InvalidInput(
                f"{name} has stride {t.stride(-1)} in its last (head_dim) dim; expected 1 "
                f"(strides {tuple(t.stride())}). Call {name}.contiguous() first"
            )
        for dim, what in enumerate(("batch", "seqlen", "heads")):
            if t.shape[dim] > 1 and t.stride(dim) % 8:
                raise InvalidInput(
                    f"{name} has stride {t.stride(dim)} in its {what} dim (strides "
                    f"{tuple(t.stride())}); expected multiples of 8 elements (the kernel "
                    f"loads 16-byte chunks). Call {name}.contiguous() first"
                )


def _valid(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split_v: bool = False) -> bool:
    """Every check at once, reading each tensor attribute once (the hot path)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor)):
        return False
    if q.layout != _STRIDED or k.layout != _STRIDED or v.layout != _STRIDED:
        return False
    dtype = q.dtype
    if dtype not in _DTYPES or k.dtype != dtype or v.dtype != dtype:
        return False
    qs, ks = q.shape, k.shape
    wide = split_v and len(ks) == 4 and ks[3] in WIDE_HEAD_DIMS
    if len(qs) != 4 or len(ks) != 4 or (v.shape != ks and not (
            split_v and len(v.shape) == 4 and v.shape[:3] == ks[:3]
            and v.shape[3] % 8 == 0 and v.shape[3] <= (ks[3] if wide else MAX_HEAD_DIM))):
        return False
    b, nq, hq, d = qs
    _, nk, hkv, _ = ks
    if (ks[0] != b or ks[3] != d or d % 8 or (d > MAX_HEAD_DIM and not wide) or b < 1
            or nq < 1 or hq < 1
            or d < 1 or nk < 1 or hkv < 1 or hq % hkv or b > MAX_GRID_YZ or hq > MAX_GRID_YZ
            or nq > MAX_SEQLEN or nk > MAX_SEQLEN):
        return False
    # Strides: unit in the last dim, multiples of 8 elsewhere (size-1 dims are never
    # stepped over, so their strides do not matter).
    for st, n, h in ((q.stride(), nq, hq), (k.stride(), nk, hkv), (v.stride(), nk, hkv)):
        if st[3] != 1 or (b > 1 and st[0] % 8) or (n > 1 and st[1] % 8) or (
                h > 1 and st[2] % 8):
            return False
    device = q.device
    return k.device == device and v.device == device and device.type in SUPPORTED_DEVICES


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                           split_v: bool = False) -> None:
    """Raise InvalidInput unless q (B, Nq, Hq, D) and k, v (B, Nk, Hkv, D) can be served
    (``split_v``: v may be (B, Nk, Hkv, Dv) with its own head dim Dv, a multiple of 8 up to
    256: the forward's split head dims).

    Checks, in order: types, layout (dense, not nested), rank, dtype (fp16/bf16, all
    equal), devices (one device, of a supported type), shapes (batch, head dim and k/v
    agreement, no empty tensor, head dim a multiple of 8 up to 256, Hq a multiple of Hkv,
    grid limits, lengths up to ``limits.MAX_SEQLEN``) and strides (the last dim contiguous,
    the others multiples of 8 elements). Base-pointer alignment (16 bytes) is
    checked at launch, where data pointers are available. Whether the device suits the
    chosen backend is checked when the backend is resolved.
    """
    try:
        if _valid(q, k, v, split_v):
            return
    except (RuntimeError, TypeError, ValueError, AttributeError):
        pass  # e.g. sparse or nested tensors, which have no strides: explained below
    _check_types(q, k, v)
    _check_layout(q, k, v)
    _check_rank(q, k, v)
    _check_dtypes(q, k, v)
    _check_devices(q, k, v)
    _check_shapes(q, k, v, split_v)
    _check_strides(q, k, v)
    raise AssertionError("check_attention_inputs: fast and detailed checks disagree")


#: The FP8 inputs the FP8 forward takes (``families/fwd8``).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: The FP8 forward's head dims are multiples of one mma k step.
FP8_HEAD_DIM_STEP = 32


def check_fp8_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise InvalidInput unless FP8 q (B, Nq, Hq, D) and k, v (B, Nk, Hkv, D) can be
    served by the FP8 forward: ``check_attention_inputs``' checks with one FP8 format (e4m3
    or e5m2) for the dtype, a head dim that is a multiple of 32 and strides that are
    multiples of 16 elements (16 bytes)."""
    _check_types(q, k, v)
    _check_layout(q, k, v)
    _check_rank(q, k, v)
    fmt = q.dtype if q.dtype in FP8_DTYPES else torch.float8_e4m3fn
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in FP8_DTYPES:
            raise InvalidInput(
                f"{name} has dtype {t.dtype} but the FP8 forward takes torch.float8_e4m3fn (or "
                f"torch.float8_e5m2) q, k and v; convert it with {name}.to({fmt}) (and pass "
                f"its {name}_descale), or pass 16-bit q, k and v without descale factors")
        if t.dtype != q.dtype:
            raise InvalidInput(
                f"{name} has dtype {t.dtype} but q has {q.dtype}: the FP8 forward takes q, k "
                f"and v of one FP8 format; convert {name} with {name}.to({q.dtype})")
    _check_devices(q, k, v)
    _check_shapes(q, k, v)
    head_dim = q.shape[3]
    if head_dim % FP8_HEAD_DIM_STEP:
        hint = FP8_HEAD_DIM_STEP * math.ceil(head_dim / FP8_HEAD_DIM_STEP)
        raise InvalidInput(f"head_dim={head_dim} is not supported by the FP8 forward; expected "
                           f"a multiple of {FP8_HEAD_DIM_STEP}: pad q, k and v with zeros to "
                           f"{hint} (softmax_scale=1/sqrt({head_dim}) keeps the scaling)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        bad = t.stride(-1) != 1 or any(
            t.shape[dim] > 1 and t.stride(dim) % 16 for dim in range(3))
        if bad:
            raise InvalidInput(
                f"{name} has strides {tuple(t.stride())}; expected 1 in the last dim and "
                "multiples of 16 elements in the others (the kernel loads 16-byte chunks of "
                f"FP8 values). Call {name}.contiguous() first")
