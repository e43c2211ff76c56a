"""Verification of one kernel variant: fresh random inputs, poisoned outputs, float64 reference.

Used by the GPU backend (inputs on the device) and by dry runs (CPU tensors, emulator).
Each call draws new inputs from a fresh seed, fills O and LSE with NaN before the launch
(so an output element the kernel never writes is caught), and compares against attention
computed independently in float64 from the same (rounded) inputs.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from flashtune.codegen.spec import DType, Problem
from flashtune.db.records import TrialStatus
from flashtune.perf.workload import Shape
from flashtune.runtime.backends.base import LoadedKernel
from flashtune.runtime.forward import pack_fwd_args
from flashtune.tuner.measure import VerifyOutcome

_TORCH_DTYPES = {DType.FP16: torch.float16, DType.BF16: torch.bfloat16}


@dataclass(frozen=True)
class Tolerance:
    """|out - ref| <= atol + rtol * |ref| for O; |lse - ref| <= lse_atol for the LSE."""

    atol: float
    rtol: float
    lse_atol: float = 1e-3


#: O is rounded to the output type and P to the input type before P @ V: a few ulps.
TOLERANCES = {DType.FP16: Tolerance(4e-3, 4e-3), DType.BF16: Tolerance(2.5e-2, 2.5e-2)}


def torch_dtype(dtype: DType) -> torch.dtype:
    return _TORCH_DTYPES[dtype]


def random_inputs(problem: Problem, shape: Shape, device: torch.device | str,
                  seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q (B, Nq, Hq, D), K and V (B, Nk, Hkv, D), standard normal, from a fresh seed."""
    gen = torch.Generator(device=device)
    gen.manual_seed(secrets.randbits(63) if seed is None else seed)
    dt = torch_dtype(problem.dtype)

    def draw(seqlen: int, heads: int) -> torch.Tensor:
        data = torch.randn(shape.batch, seqlen, heads, problem.head_dim, generator=gen,
                           device=device)
        return data.to(dt)

    return (draw(shape.seqlen_q, shape.heads_q), draw(shape.seqlen_k, shape.heads_kv),
            draw(shape.seqlen_k, shape.heads_kv))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 O (B, Nq, Hq, D) and LSE (B, Hq, Nq); causal masks are bottom-right aligned."""
    qd, kd, vd = (t.to(torch.float64) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kd = kd.repeat_interleave(group, dim=2)
    vd = vd.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        rows = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
        cols = torch.arange(nk, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vd)
    return out, lse


def check_kernel(kernel: LoadedKernel, problem: Problem, block_m: int, shape: Shape,
                 device: torch.device | str, *, stream: int = 0) -> VerifyOutcome:
    """Launch ``kernel`` once on fresh inputs and compare O and LSE with the reference."""
    q, k, v = random_inputs(problem, shape, device)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((shape.batch, shape.heads_q, shape.seqlen_q), float("nan"),
                     dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(problem.head_dim)
    grid = (-(-shape.seqlen_q // block_m), shape.heads_q, shape.batch)
    kernel.launch(grid, pack_fwd_args(q, k, v, out, lse, scale), stream=stream)
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
    ref_out, ref_lse = reference(q, k, v, problem.causal, scale)
    return compare(problem, out, lse, ref_out, ref_lse, shape)


def compare(problem: Problem, out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor,
            ref_lse: torch.Tensor, shape: Shape) -> VerifyOutcome:
    tol = TOLERANCES[problem.dtype]
    out64, lse64 = out.to(torch.float64), lse.to(torch.float64)
    unwritten = int(torch.isnan(out64).sum()) + int(torch.isnan(lse64).sum())
    err = (out64 - ref_out).abs()
    max_err = float(err.nan_to_num(float("inf")).max())
    bound = tol.atol + tol.rtol * ref_out.abs()
    bad = int((~(err <= bound)).sum())
    lse_err = float((lse64 - ref_lse).abs().nan_to_num(float("inf")).max())
    if unwritten or bad or lse_err > tol.lse_atol:
        return VerifyOutcome(
            TrialStatus.WRONG_RESULT, max_abs_error=max_err if math.isfinite(max_err) else None,
            error=(f"wrong result on {shape.key()} ({problem.key()}): {unwritten} output "
                   f"elements left unwritten (NaN), {bad} outside |err| <= {tol.atol} + "
                   f"{tol.rtol}*|ref| (max |err| {max_err:.3g}), max LSE error {lse_err:.3g} "
                   f"(limit {tol.lse_atol})"))
    return VerifyOutcome(TrialStatus.OK, max_abs_error=max_err)
