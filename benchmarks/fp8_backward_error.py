"""Which operands of the attention backward can be FP8? Measured in float64 math, no kernel.

The backward of O = softmax(s Q K^T) V computes, per tile, S = Q K^T, P = exp(s S - LSE),
dV = P^T dO, dP = dO V^T, dS = P (dP - D), dQ = s dS K, dK = s dS^T Q. Its inputs Q, K, V and
dO can arrive in e4m3 with descale factors per (batch, KV head) (FA3's FP8 convention; dO
with its own per (batch, query head)); P and dS are made in the kernel, and each could be
rounded to e4m3 before its product (as an FP8 tensor-core product needs) or kept 16-bit.

For each choice this script rounds exactly where such a kernel would (float32 accumulation
modelled in float64: its error is far below the roundings'), and measures each gradient's
largest error against float64 autograd of the inputs the kernel was given (the FP8 inputs
dequantised). flash-attn's rule divides that by plain PyTorch's error in bf16 against
float64 of its bf16 inputs; a ratio above 3 fails the rule the 16-bit backward is held to.

    python benchmarks/fp8_backward_error.py [--seqlen 512] [--head-dim 128] [--seed 0]

Every number here is CPU math, not a GPU measurement.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
GRADS = ("dq", "dk", "dv")
Grads = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Choice:
    """One backward: which of P and dS are rounded to e4m3 (each with a scale of its
    own largest magnitude per row, the most favourable FP8 can be), the rest 16-bit."""

    name: str
    fp8_p: bool = False
    fp8_ds: bool = False


CHOICES = (Choice("FP8 Q K V dO, 16-bit P and dS"), Choice("... and FP8 P", fp8_p=True),
           Choice("... and FP8 dS", fp8_ds=True),
           Choice("... and FP8 P and dS", fp8_p=True, fp8_ds=True))


def quantise(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``x`` rounded to e4m3 with a descale per slice over ``dims`` (amax / 448: the range
    used fully), dequantised back to float64."""
    amax = x.abs().amax(dim=dims, keepdim=True).clamp_min(1e-30)
    scale = amax / E4M3_MAX
    return (x / scale).to(E4M3).to(torch.float64) * scale


def _round16(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).to(torch.float64)


def exact_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                causal: bool, dtype: torch.dtype = torch.float64) -> Grads:
    """dQ, dK, dV of plain PyTorch attention (B, H, N, D) computed in ``dtype`` (float64:
    the reference; bf16: flash-attn's low-precision baseline), returned as float64."""
    leaves = [t.to(dtype).detach().requires_grad_(True) for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(leaves[0], leaves[1], leaves[2],
                                                           is_causal=causal)
    out.backward(do.to(dtype))  # type: ignore[no-untyped-call]
    return {n: t.grad.to(torch.float64) for n, t in zip(GRADS, leaves, strict=True)
            if t.grad is not None}


def modelled_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                   causal: bool, choice: Choice, p_dtype: torch.dtype) -> Grads:
    """The gradients a flash backward computes from these (already rounded) inputs: P and
    dS rounded to ``p_dtype`` (16-bit) or to e4m3 as ``choice`` says, products exact."""
    scale = q.shape[-1] ** -0.5
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse)
    out = torch.einsum("bhqk,bhkd->bhqd", p, v)
    dd = (do * out).sum(-1, keepdim=True)  # D = rowsum(dO * O), from the forward's O
    p_used = quantise(p, (-1,)) if choice.fp8_p else _round16(p, p_dtype)
    dv = torch.einsum("bhqk,bhqd->bhkd", p_used, do)
    dp = torch.einsum("bhqd,bhkd->bhqk", do, v)
    ds = p * (dp - dd)
    ds = quantise(ds, (-1,)) if choice.fp8_ds else _round16(ds, p_dtype)
    dq = torch.einsum("bhqk,bhkd->bhqd", ds, k) * scale
    dk = torch.einsum("bhqk,bhqd->bhkd", ds, q) * scale
    return {"dq": dq, "dk": dk, "dv": dv}


def _max_err(got: Grads, want: Grads) -> dict[str, float]:
    return {n: float((got[n] - want[n]).abs().max()) for n in GRADS}


@dataclass(frozen=True)
class Row:
    """One choice's largest errors per gradient and their ratios to PyTorch bf16's."""

    choice: str
    errors: dict[str, float]
    ratios: dict[str, float]


def measure(seqlen: int = 512, head_dim: int = 128, causal: bool = True, seed: int = 0,
            batch: int = 2, heads: int = 4) -> tuple[dict[str, float], list[Row]]:
    """PyTorch bf16's errors (the rule's denominators) and a Row per choice of ``CHOICES``,
    plus the 16-bit backward itself (bf16 inputs, P and dS in bf16) as the first row."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(batch, heads, seqlen, head_dim, generator=gen,
                               dtype=torch.float64) for _ in range(4))
    q16, k16, v16, do16 = (_round16(t, torch.bfloat16) for t in (q, k, v, do))
    exact16 = exact_grads(q16, k16, v16, do16, causal)
    torch_err = _max_err(exact_grads(q16, k16, v16, do16, causal, torch.bfloat16), exact16)

    def row(name: str, got: Grads, want: Grads) -> Row:
        errors = _max_err(got, want)
        return Row(name, errors, {n: errors[n] / torch_err[n] for n in GRADS})

    rows = [row("bf16 Q K V dO, bf16 P and dS (the 16-bit backward)",
                modelled_grads(q16, k16, v16, do16, causal, Choice(""), torch.bfloat16),
                exact16)]
    # Per (batch, head) descales: with heads_kv = heads these are FA3's (batch, heads_kv).
    q8, k8, v8, do8 = (quantise(t, (-2, -1)) for t in (q, k, v, do))
    exact8 = exact_grads(q8, k8, v8, do8, causal)
    rows += [row(c.name, modelled_grads(q8, k8, v8, do8, causal, c, torch.bfloat16), exact8)
             for c in CHOICES]
    return torch_err, rows


def _table(torch_err: dict[str, float], rows: list[Row]) -> str:
    lines = ["| backward | dQ | dK | dV |", "|---|---|---|---|",
             "| PyTorch bf16 (max abs error) | " + " | ".join(
                 f"{torch_err[n]:.2e}" for n in GRADS) + " |"]

    def cell(r: Row, n: str) -> str:
        return f"{r.errors[n]:.2e} ({r.ratios[n]:.2f}x)"

    lines += [f"| {r.choice} | " + " | ".join(cell(r, n) for n in GRADS) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-causal", action="store_true")
    args = parser.parse_args()
    torch_err, rows = measure(args.seqlen, args.head_dim, not args.no_causal, args.seed)
    print(f"seqlen {args.seqlen}, head dim {args.head_dim}, "
          f"{'non-causal' if args.no_causal else 'causal'}, seed {args.seed}: max abs error "
          "against float64 autograd of the inputs given (ratio to PyTorch bf16's)")
    print(_table(torch_err, rows))


if __name__ == "__main__":
    main()
