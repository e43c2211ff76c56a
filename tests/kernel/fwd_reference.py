"""Float64 reference of the forward pass and the checks the kernel tests apply.

Written from the definition, independently of the kernel's tiling: S = scale * Q K^T, masked
(causal: query row i sees key j iff j <= i + Nk - Nq), softmax over keys, O = P V,
LSE = log(sum(exp(S))) in natural log. Rows that see no key: O = 0 and LSE = +inf (the
kernel's contract, as flash-attn).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flashtune.codegen.spec import Problem
from flashtune.families.fwd.args import pack_args
from flashtune.families.launch_args import grid
from flashtune.runtime.backends.base import LoadedKernel

TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: Relative Frobenius error of O allowed per dtype (P and O are rounded to 16 bits).
O_TOLERANCE = {"fp16": 2e-3, "bf16": 1e-2}
#: Absolute LSE error allowed, plus a float32-resolution share for large-magnitude scores.
LSE_ATOL = 1e-3
LSE_RTOL = 2e-6


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, scale: float
              ) -> tuple[np.ndarray, np.ndarray]:
    """O (B, Nq, Hq, D) and LSE (B, Hq, Nq) in float64 from (B, N, H, D) arrays."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    nq, hq = q.shape[1], q.shape[2]
    nk, hkv = k.shape[1], k.shape[2]
    kv_head = np.arange(hq) // (hq // hkv)
    s = np.einsum("bqhd,bkhd->bhqk", q, k[:, :, kv_head]) * scale
    visible = np.ones((nq, nk), dtype=bool)
    if causal:
        visible = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)
    s = np.where(visible, s, -np.inf)
    seen = visible.any(axis=1)  # (Nq,): rows that see at least one key
    m = s.max(axis=-1, keepdims=True)  # -inf on rows that see no key (Nk >= 1)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)  # exp(-inf) = 0 on masked keys
    total = p.sum(axis=-1, keepdims=True)
    safe = np.where(total > 0, total, 1.0)
    o = np.einsum("bhqk,bkhd->bqhd", p / safe, v[:, :, kv_head])
    lse = np.where(seen, (m + np.log(safe))[..., 0], np.inf)
    return o, lse


@dataclass(frozen=True)
class Case:
    """One launch: shapes, head grouping, scale, and how the inputs are made."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    scale: float | None = None     # None: 1/sqrt(head_dim)
    packed_qkv: bool = False       # q, k, v sliced from one (B, N, 3, H, D) tensor
    magnitude: float = 1.0         # standard deviation of q and k

    def label(self) -> str:
        extra = "".join([f"-scale{self.scale}" if self.scale is not None else "",
                         "-packed" if self.packed_qkv else "",
                         f"-x{self.magnitude:g}" if self.magnitude != 1.0 else ""])
        return (f"b{self.batch}-q{self.seqlen_q}-k{self.seqlen_k}-h{self.heads_q}"
                f"kv{self.heads_kv}{extra}")


def run_and_check(kernel: LoadedKernel, problem: Problem, case: Case, seed: int) -> None:
    """Launch on fresh random inputs with NaN-poisoned outputs and check against reference."""
    gen = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPE[problem.dtype.value]
    b, nq, nk, hq, hkv, d = (case.batch, case.seqlen_q, case.seqlen_k, case.heads_q,
                             case.heads_kv, problem.head_dim)
    if case.packed_qkv:
        assert nq == nk and hq == hkv
        qkv = torch.randn(b, nq, 3, hq, d, generator=gen)
        qkv[:, :, :2] *= case.magnitude
        qkv = qkv.to(dtype)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        q = (torch.randn(b, nq, hq, d, generator=gen) * case.magnitude).to(dtype)
        k = (torch.randn(b, nk, hkv, d, generator=gen) * case.magnitude).to(dtype)
        v = torch.randn(b, nk, hkv, d, generator=gen).to(dtype)
    o = torch.full((b, nq, hq, d), float("nan"), dtype=dtype)
    lse = torch.full((b, hq, nq), float("nan"), dtype=torch.float32)
    scale = case.scale if case.scale is not None else d ** -0.5
    kernel.launch(grid(nq, hq, b, kernel.source.config.block_m),
                  pack_args(q, k, v, o, lse, scale))

    where = f"{kernel.source.entry} {case.label()} seed={seed}"
    ref_o, ref_lse = reference(q.double().numpy(), k.double().numpy(), v.double().numpy(),
                               problem.causal, scale)
    got_o = o.double().numpy()
    got_lse = lse.double().numpy()
    assert np.isfinite(got_o).all(), f"{where}: O has NaN/Inf (poison left or overflow)"
    empty = np.isinf(ref_lse)
    got_empty = np.isposinf(got_lse)
    assert np.array_equal(got_empty, empty), (
        f"{where}: LSE must be +inf exactly on the rows that see no key: the reference has "
        f"{int(empty.sum())} such rows, the kernel {int(got_empty.sum())} +inf rows, "
        f"{int((got_empty != empty).sum())} rows disagree")
    assert not np.isnan(got_lse).any(), f"{where}: LSE has NaN (rows never written?)"
    empty_rows = np.transpose(empty, (0, 2, 1))  # (B, Nq, Hq)
    assert (got_o[empty_rows] == 0).all(), f"{where}: rows that see no key must have O = 0"
    norm = np.linalg.norm(ref_o)
    rel = np.linalg.norm(got_o - ref_o) / norm if norm > 0 else np.abs(got_o).max()
    assert rel <= O_TOLERANCE[problem.dtype.value], (
        f"{where}: relative Frobenius error of O {rel:.3e} > "
        f"{O_TOLERANCE[problem.dtype.value]:.0e}")
    finite = ~empty
    if finite.any():
        err = np.abs(got_lse[finite] - ref_lse[finite])
        allowed = LSE_ATOL + LSE_RTOL * np.abs(ref_lse[finite])
        worst = int(np.argmax(err - allowed))
        assert (err <= allowed).all(), (
            f"{where}: LSE error {err[worst]:.3e} > {allowed[worst]:.3e} "
            f"(reference {ref_lse[finite][worst]:.6f})")
