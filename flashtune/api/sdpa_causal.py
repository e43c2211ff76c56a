"""SDPA's ``is_causal`` when L != S: torch's top-left mask, from flashtune's kernels.

torch.nn.functional.scaled_dot_product_attention aligns its causal mask to the top-left
corner (``torch.ones(L, S).tril()``: query row i sees key j iff j <= i), while flashtune's
``causal`` follows flash-attn >= 2.1 and aligns it to the bottom-right (j <= i + S - L). The
two agree when L == S. For L != S the top-left mask is two calls of the kernels flashtune
has, forward and backward (no window feature, so gradients work), both exact:

- L < S: no row sees a key j >= L, so it is the square causal attention of q over the
  first L keys (their gradients; the other keys get zero gradients);
- L > S: rows i < S see keys j <= i (the square causal attention of those rows over all
  keys) and rows i >= S see every key (plain attention): two calls, concatenated by rows
  (their key gradients summed).

Every row sees key 0, so no row is empty (O and LSE are torch's). Tensors are in
flash-attn's layout (B, N, H, D), the LSE (B, H, N).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: ``attend(q, k, v, causal)``: O and LSE of flashtune attention with a bottom-right mask.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool],
                  tuple[torch.Tensor, torch.Tensor]]
#: ``grads(dout, q, k, v, out, lse, causal)``: dQ, dK, dV of such a call.
Grads = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                  torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def top_left_forward(attend: Attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """O and LSE of attention with torch's top-left causal mask (any L, S)."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if seqlen_q <= seqlen_k:
        return attend(q, k[:, :seqlen_q], v[:, :seqlen_q], True)
    head_out, head_lse = attend(q[:, :seqlen_k], k, v, True)
    tail_out, tail_lse = attend(q[:, seqlen_k:], k, v, False)
    return torch.cat((head_out, tail_out), 1), torch.cat((head_lse, tail_lse), -1)


def top_left_backward(grads: Grads, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of ``top_left_forward`` (which produced ``out`` and ``lse``)."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if seqlen_q <= seqlen_k:
        dq, dk_seen, dv_seen = grads(dout, q, k[:, :seqlen_q], v[:, :seqlen_q], out, lse, True)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dk[:, :seqlen_q] = dk_seen
        dv[:, :seqlen_q] = dv_seen
        return dq, dk, dv
    rows = (slice(None, seqlen_k), slice(seqlen_k, None))
    parts = [grads(dout[:, r], q[:, r], k, v, out[:, r], lse[..., r].contiguous(), causal)
             for r, causal in zip(rows, (True, False), strict=True)]
    (dq_head, dk_head, dv_head), (dq_tail, dk_tail, dv_tail) = parts
    return (torch.cat((dq_head, dq_tail), 1), _sum(dk_head, dk_tail), _sum(dv_head, dv_tail))


def _sum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b rounded once (the halves of one gradient, each already rounded to its dtype)."""
    return (a.float() + b.float()).to(a.dtype)
