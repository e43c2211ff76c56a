"""The forward kernel's argument list, built once for every backend.

The order and types here are the contract with ``templates/flash_fwd.cu.jinja``:

    q, k, v (const T*), o (T*), lse (float*),
    seqlen_q, seqlen_k, heads_q, heads_kv (int32),
    q, k, v, o strides in elements: batch, row (sequence), head (int64 each, 12 in all),
    softmax_scale (float32)

Q/O are (batch, seqlen_q, heads_q, head_dim), K/V are (batch, seqlen_k, heads_kv,
head_dim), each with a contiguous last dim and otherwise arbitrary strides; LSE is a
contiguous float32 (batch, heads_q, seqlen_q) tensor. The grid is (ceil(seqlen_q / block_m),
heads_q, batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ArgType(str, Enum):
    PTR = "ptr"
    I32 = "i32"
    I64 = "i64"
    F32 = "f32"


@dataclass(frozen=True)
class TensorView:
    """A pointer with its (batch, seq, head) element strides."""

    ptr: int
    batch_stride: int
    row_stride: int
    head_stride: int


@dataclass(frozen=True)
class FwdArgs:
    q: TensorView
    k: TensorView
    v: TensorView
    o: TensorView
    lse_ptr: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    softmax_scale: float

    def packed(self) -> tuple[tuple[ArgType, int | float], ...]:
        """(type, value) pairs in the kernel's parameter order."""
        out: list[tuple[ArgType, int | float]] = [
            (ArgType.PTR, t.ptr) for t in (self.q, self.k, self.v, self.o)
        ]
        out.append((ArgType.PTR, self.lse_ptr))
        out += [(ArgType.I32, n) for n in (self.seqlen_q, self.seqlen_k, self.heads_q,
                                            self.heads_kv)]
        for t in (self.q, self.k, self.v, self.o):
            out += [(ArgType.I64, s) for s in (t.batch_stride, t.row_stride, t.head_stride)]
        out.append((ArgType.F32, self.softmax_scale))
        return tuple(out)
