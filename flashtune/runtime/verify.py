"""Verification of one kernel variant: fresh random inputs, poisoned outputs, float64 reference.

Shared by ``flashtune check`` (emulator), the tuner's GPU backend (inputs on the device) and
its dry runs. Each launch draws new inputs from a fresh seed (or a given one, to replay),
fills O and LSE with NaN before the launch (so an element the kernel never writes is caught)
and compares against attention computed independently in float64 from the same (rounded)
inputs. Rows that see no key must have O = 0 and LSE = +inf exactly.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from flashtune.codegen.spec import DType, Problem
from flashtune.perf.workload import Shape
from flashtune.runtime.backends.base import LoadedKernel
from flashtune.runtime.forward import pack_fwd_args

_TORCH_DTYPES = {DType.FP16: torch.float16, DType.BF16: torch.bfloat16}


@dataclass(frozen=True)
class Tolerance:
    """|out - ref| <= atol + rtol * |ref| per element of O; |lse - ref| <= lse_atol."""

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
    """float64 O (B, Nq, Hq, D) and LSE (B, Hq, Nq); causal masks are bottom-right aligned;
    a row that sees no key has O = 0 and LSE = +inf."""
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
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vd)
    return out, lse.masked_fill(empty, float("inf"))


@dataclass(frozen=True)
class Verdict:
    """How one launch's O and LSE compare with the reference."""

    ok: bool
    max_abs: float           # max |O - ref| (inf where NaN was left)
    rel_frobenius: float     # ||O - ref||_F / ||ref||_F
    lse_err: float           # max |LSE - ref| over rows that see keys
    message: str             # what was wrong, or "" when ok


def compare(problem: Problem, out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor,
            ref_lse: torch.Tensor, shape: Shape) -> Verdict:
    tol = TOLERANCES[problem.dtype]
    out64, lse64 = out.to(torch.float64), lse.to(torch.float64)
    unwritten = int(torch.isnan(out64).sum()) + int(torch.isnan(lse64).sum())
    err = (out64 - ref_out).abs().nan_to_num(float("inf"))
    max_err = float(err.max()) if err.numel() else 0.0
    norm = float(torch.linalg.vector_norm(ref_out))
    rel = float(torch.linalg.vector_norm(err)) / max(norm, 1e-30)
    bad = int((~(err <= tol.atol + tol.rtol * ref_out.abs())).sum())
    seen = torch.isfinite(ref_lse)
    lse_diff = (lse64[seen] - ref_lse[seen]).abs().nan_to_num(float("inf"))
    lse_err = float(lse_diff.max()) if lse_diff.numel() else 0.0
    empty_wrong = int((lse64[~seen] != ref_lse[~seen]).sum())
    if unwritten or bad or empty_wrong or lse_err > tol.lse_atol:
        return Verdict(False, max_err, rel, lse_err, (
            f"wrong result on {shape.key()} ({problem.key()}): {unwritten} output elements "
            f"left unwritten (NaN), {bad} outside |err| <= {tol.atol} + {tol.rtol}*|ref| "
            f"(max |err| {max_err:.3g}), max LSE error {lse_err:.3g} (limit {tol.lse_atol}), "
            f"{empty_wrong} rows that see no key without LSE = +inf"))
    return Verdict(True, max_err, rel, lse_err, "")


def verify(kernel: LoadedKernel, problem: Problem, block_m: int, shape: Shape,
           device: torch.device | str, *, seed: int | None = None, stream: int = 0) -> Verdict:
    """Launch ``kernel`` once on fresh inputs (NaN-poisoned outputs) and compare."""
    q, k, v = random_inputs(problem, shape, device, seed)
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
