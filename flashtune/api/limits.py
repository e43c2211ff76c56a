"""Size and value limits of the attention API, in one torch-free place.

The API's input validation (``validate.py``), the command line (``explain``, ``check``,
``precompile``) and the database use these, so every entry point refuses the same
lengths and scales with the same message.

Why the limits are what they are:

- Sequence lengths are int32 kernel arguments, and the kernel adds them up in 32-bit
  arithmetic (``m_end + seqlen_k - seqlen_q``, ``n_end + kBlockN - 1``): with both lengths
  at most ``MAX_SEQLEN`` = 2**30 - 512 every such sum of two lengths and a tile (at most 256
  rows) stays below 2**31.
- ``softmax_scale`` multiplies float32 scores: with |scale| <= ``MAX_SOFTMAX_SCALE`` no
  score of fp16 inputs (|q.k| <= 256 * 65504**2 ~ 1.1e12) can overflow float32 after
  scaling by scale * log2(e), so the online softmax never computes inf - inf. (bf16 inputs
  large enough to overflow q.k itself overflow in any float32 implementation.)
"""

from __future__ import annotations

import math
import numbers
import os

from flashtune.errors import InvalidInput

#: CUDA limits the y and z grid dimensions (heads and batch) to 65535.
MAX_GRID_YZ = 65535
MAX_INT32 = 2**31 - 1
#: Largest tile of any config (block_m and block_n are at most 256).
MAX_TILE = 256
#: Longest sequence (query or key) a call may have; see the module doc.
MAX_SEQLEN = 2**30 - 2 * MAX_TILE
#: Largest |softmax_scale|; see the module doc. float32 max / (log2(e) * 256 * 65504**2).
MAX_SOFTMAX_SCALE = 1e25


def seqlen_error(seqlen_q: int, seqlen_k: int) -> InvalidInput | None:
    """The error for sequence lengths outside [1, MAX_SEQLEN], or None when they fit."""
    for name, value in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int):
            return InvalidInput(f"{name}={value!r} must be an int")
        if value < 1:
            return InvalidInput(f"{name}={value} must be >= 1")
    if seqlen_q > MAX_SEQLEN or seqlen_k > MAX_SEQLEN:
        return InvalidInput(
            f"sequence lengths seqlen_q={seqlen_q}, seqlen_k={seqlen_k} exceed the limit "
            f"{MAX_SEQLEN} (2**30 - {2 * MAX_TILE}): the kernel's 32-bit index arithmetic "
            "adds two lengths and a tile. Split the call along the sequence")
    return None


def check_seqlens(seqlen_q: int, seqlen_k: int) -> None:
    """Raise InvalidInput unless both lengths are in [1, MAX_SEQLEN]."""
    error = seqlen_error(seqlen_q, seqlen_k)
    if error is not None:
        raise error


def check_softmax_scale(scale: object, head_dim: int) -> float:
    """The softmax scale to use: 1/sqrt(head_dim) for None, else ``scale`` as a positive
    float of at most MAX_SOFTMAX_SCALE (the kernel's exp2-based softmax assumes a positive
    scale; larger ones overflow float32)."""
    default = 1.0 / math.sqrt(head_dim)
    if scale is None:
        return default
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise InvalidInput(f"softmax_scale={scale!r} must be a float (or None for "
                           f"1/sqrt(head_dim) = {default:.6g})")
    try:
        value = float(scale)
    except (OverflowError, ValueError):
        value = math.inf
    if not math.isfinite(value) or value <= 0.0 or value > MAX_SOFTMAX_SCALE:
        if not math.isfinite(value):
            what = "is not finite (or too large for a float)"
        elif value <= 0.0:
            what = "is not positive"
        else:
            what = f"exceeds the limit {MAX_SOFTMAX_SCALE:g}"
        shown = repr(scale) if len(repr(scale)) <= 40 else repr(scale)[:37] + "..."
        raise InvalidInput(
            f"softmax_scale={shown} {what}; expected a finite float in (0, "
            f"{MAX_SOFTMAX_SCALE:g}] (beyond it float32 scores overflow), such as "
            f"1/sqrt(head_dim) = {default:.6g}")
    return value


def reference_bytes(batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int,
                    head_dim: int) -> int:
    """Host memory a verification of this shape needs: fp16 inputs and outputs, their
    float64 copies and the float64 scores and probabilities of the reference."""
    elements = batch * head_dim * (2 * seqlen_q * heads_q + 2 * seqlen_k * heads_kv)
    scores = batch * heads_q * seqlen_q * seqlen_k
    return elements * (2 + 8) + scores * 8 * 2


def host_memory_bytes() -> int:
    """Physical memory of this machine (a large default where it cannot be read)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def check_host_memory(batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int,
                      head_dim: int, what: str = "this check") -> None:
    """Raise InvalidInput when verifying this shape on the CPU would need more than half of
    the machine's memory (checked before anything is allocated)."""
    check_seqlens(seqlen_q, seqlen_k)
    need = reference_bytes(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim)
    have = host_memory_bytes()
    if need > have // 2:
        raise InvalidInput(
            f"{what} needs about {need / 2**30:.3g} GiB of host memory for batch {batch}, "
            f"heads {heads_q}/{heads_kv}, seqlen {seqlen_q}/{seqlen_k}, head_dim {head_dim} "
            f"(the float64 reference holds every score), more than half of this machine's "
            f"{have / 2**30:.3g} GiB; use smaller --seqlen-q/--seqlen-k/--batch/--heads")
