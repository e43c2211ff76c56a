"""The forward kernel's argument list: the contract with ``templates/flash_fwd.cu.jinja``.

    q, k, v (const T*), o (T*), lse (float*),
    seqlen_q, seqlen_k, heads_q, heads_kv (int32),
    q, k, v, o strides in elements: batch, row (sequence), head (int64 each, 12 in all),
    softmax_scale (float32)
    then the features' values, those of the Problem's switches only (``variant_args``):
      window: window_left, window_right (int32; -1 unbounded);
      softcap: softcap (float32, > 0);
      alibi: alibi_slopes (const float*), alibi_batch_stride (int64; 0 for (heads_q,) slopes);
      varlen: cu_seqlens_q, cu_seqlens_k (const int*), max_seqlen_q (int32); Q, K, V and O
        are then (1, total rows, heads, head_dim) (flash-attn's packed (total, heads, dim)
        with a batch dim of 1), seqlen_q and seqlen_k their total rows, the LSE
        (heads_q, total rows of Q), and the grid (ceil(max_seqlen_q / block_m), heads_q,
        number of sequences).

Q/O are (batch, seqlen_q, heads_q, head_dim), K/V are (batch, seqlen_k, heads_kv,
head_dim), each with a contiguous last dim and otherwise arbitrary strides; LSE is a
contiguous float32 (batch, heads_q, seqlen_q) tensor. The grid is (ceil(seqlen_q / block_m),
heads_q, batch); a persistent kernel's has fewer blocks in x (``persistent_grid``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashtune._lazy import lazy_module
from flashtune.codegen.abi import ArgType, PackedArgs
from flashtune.codegen.spec import Problem
from flashtune.errors import InvalidInput
from flashtune.families.base import DEFAULT_SM_COUNT

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


@dataclass(frozen=True)
class TensorView:
    """A pointer with its (batch, seq, head) element strides."""

    ptr: int
    batch_stride: int
    row_stride: int
    head_stride: int

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorView:
        s = t.stride()
        return cls(t.data_ptr(), s[0], s[1], s[2])


@dataclass(frozen=True)
class FwdArgs:
    """The forward kernel's arguments by name; ``packed()`` is the launch order."""

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

    def packed(self) -> PackedArgs:
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


# The kernel's parameter types, in order, taken from the argument contract itself.
_ZERO_VIEW = TensorView(0, 0, 0, 0)
FWD_ARG_TYPES: tuple[ArgType, ...] = tuple(
    kind for kind, _ in FwdArgs(_ZERO_VIEW, _ZERO_VIEW, _ZERO_VIEW, _ZERO_VIEW, 0, 0, 0, 0, 0,
                                0.0).packed()
)


def pack_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
              lse: torch.Tensor, softmax_scale: float) -> PackedArgs:
    """The kernel arguments, equal to ``FwdArgs(...).packed()`` for these tensors.

    Built directly because it runs on every call: this costs about a third of building the
    FwdArgs dataclasses; a test checks that the two agree.
    """
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), o.stride()
    _, seqlen_q, heads_q, _ = q.shape
    _, seqlen_k, heads_kv, _ = k.shape
    values = (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
              seqlen_q, seqlen_k, heads_q, heads_kv,
              qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
              os_[0], os_[1], os_[2], softmax_scale)
    return tuple(zip(FWD_ARG_TYPES, values, strict=False))  # lengths equal by construction


@dataclass(frozen=True)
class VarlenArgs:
    """The run-time values of a varlen launch: int32 cumulative lengths of the sequences
    (on the launch's device) and the longest query sequence."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int = 0  # the longest key sequence (chooses the tuning bucket)

    @property
    def batch(self) -> int:
        return int(self.cu_seqlens_q.shape[0]) - 1


def variant_args(problem: Problem, window: tuple[int, int], softcap: float,
                 alibi_slopes: torch.Tensor | None, varlen: VarlenArgs | None = None
                 ) -> PackedArgs:
    """The arguments after softmax_scale: the run-time values of ``problem``'s feature
    switches, in the template's order. ``alibi_slopes``: float32 (heads_q,) or
    (batch, heads_q) with a contiguous last dim (required when ``problem.alibi``);
    ``varlen`` is required when ``problem.varlen``."""
    out: list[tuple[ArgType, int | float]] = []
    if problem.window:
        out += [(ArgType.I32, window[0]), (ArgType.I32, window[1])]
    if problem.softcap:
        out.append((ArgType.F32, softcap))
    if problem.alibi:
        if alibi_slopes is None:
            raise InvalidInput(f"{problem.key()} needs alibi_slopes: a float32 tensor (heads_q,) "
                               "or (batch, heads_q)")
        stride = alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0
        out += [(ArgType.PTR, alibi_slopes.data_ptr()), (ArgType.I64, stride)]
    if problem.varlen:
        if varlen is None:
            raise InvalidInput(f"{problem.key()} needs cu_seqlens_q, cu_seqlens_k and "
                               "max_seqlen_q")
        out += [(ArgType.PTR, varlen.cu_seqlens_q.data_ptr()),
                (ArgType.PTR, varlen.cu_seqlens_k.data_ptr()), (ArgType.I32, varlen.max_seqlen_q)]
    return tuple(out)


def grid(seqlen_q: int, heads_q: int, batch: int, block_m: int) -> tuple[int, int, int]:
    """Launch grid: (query blocks, heads, batch)."""
    return ((seqlen_q + block_m - 1) // block_m, heads_q, batch)


#: A persistent launch fills each SM with at least this many blocks (the residency the
#: default tiles aim for), or with the config's ``minblocks`` where that is larger.
PERSISTENT_BLOCKS_PER_SM = 2


def persistent_grid(grid: tuple[int, int, int], sm_count: int | None,
                    blocks_per_sm: int) -> tuple[int, int, int]:
    """The grid of a persistent kernel: about ``sm_count`` x ``blocks_per_sm`` blocks over
    all (head, batch) pairs, each pair's query blocks shared round-robin by its blocks in
    x (the kernel's tile scheduler walks x, x + gridDim.x, ...). Never more blocks in x than
    query blocks, never fewer than one; an unknown SM count is DEFAULT_SM_COUNT (the
    emulator's virtual device, where most shapes then loop)."""
    m_blocks, heads, batch = grid
    slots = (sm_count or DEFAULT_SM_COUNT) * blocks_per_sm
    return (max(1, min(m_blocks, -(-slots // (heads * batch)))), heads, batch)
