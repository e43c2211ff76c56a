"""Test helpers of the runtime: a float64 attention reference, and a reference backend.

``PyRefBackend`` implements the Backend interface on CPU tensors by reading the kernel
argument list exactly as the CUDA kernel does (pointers, element strides, sizes, scale, the
grid) and writing O and LSE through the pointers. It checks how the runtime plumbs
arguments (layouts, GQA, strides, grid) without a GPU or the emulator; the numerics of the
generated kernel itself are checked against the same reference by the emulator and GPU
tests.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from flashtune.codegen.abi import ArgType
from flashtune.codegen.spec import KernelSource
from flashtune.db.records import BestEntry, Keyed, TrialRecord, TrialStatus
from flashtune.families.base import torch_dtype
from flashtune.runtime.installed import installed_digest


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 O (B, Nq, Hq, D) and LSE (B, Hq, Nq) of (B, N, H, D) inputs.

    Causal: query i sees key j iff j <= i + Nk - Nq; a row that sees no key has O = 0 and
    LSE = +inf.
    """
    qd, kd, vd = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    heads_q, heads_kv = qd.shape[2], kd.shape[2]
    group = heads_q // heads_kv
    kd = kd.repeat_interleave(group, dim=2)
    vd = vd.repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", qd, kd) * scale
    nq, nk = qd.shape[1], kd.shape[1]
    if causal:
        i = torch.arange(nq).unsqueeze(1)
        j = torch.arange(nk).unsqueeze(0)
        scores = scores.masked_fill(j > i + nk - nq, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    probs = torch.nan_to_num(probs, nan=0.0)  # rows without keys: exp(-inf - -inf)
    out = torch.einsum("bhij,bjhd->bihd", probs, vd)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)
    return out, lse


#: Relative Frobenius error allowed for O, by dtype; LSE is held to LSE_TOL (absolute).
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
LSE_TOL = 1e-3


def check_outputs(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, causal: bool, scale: float | None = None) -> None:
    """Assert O and LSE of attention(q, k, v) against the float64 reference."""
    ref_o, ref_lse = reference_attention(q, k, v, causal=causal,
                                         scale=scale or q.shape[-1] ** -0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    error = rel_fro(out, ref_o)
    assert error <= TOL[q.dtype], f"relative error of O {error:.3g} > {TOL[q.dtype]}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    if finite.any():
        lse_error = (lse.cpu().double() - ref_lse)[finite].abs().max().item()
        assert lse_error <= LSE_TOL, f"LSE error {lse_error:.3g} > {LSE_TOL}"


def check_varlen_outputs(out: torch.Tensor, lse: torch.Tensor, ref_o: torch.Tensor,
                         ref_lse: torch.Tensor, tol: float, where: str) -> None:
    """Packed O and LSE against float64 ``ref_o``/``ref_lse``: written everywhere, O within
    ``tol``, LSE infinite exactly where the reference's is (rows without keys), close
    elsewhere."""
    assert not out.isnan().any() and not lse.isnan().any(), where
    assert float((out.double() - ref_o).abs().max()) <= tol, where
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), where
    assert float((lse[finite].double() - ref_lse[finite]).abs().max()) < 2e-3, where


def rel_fro(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative Frobenius error ||a - e|| / ||e||, computed in float64 on the CPU whatever
    device either tensor is on (a GPU output against a GPU reference, or a CPU one)."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    return float(torch.linalg.vector_norm(a - e) / torch.linalg.vector_norm(e).clamp_min(1e-30))


def _view(ptr: int, dtype: torch.dtype, shape: Sequence[int], strides: Sequence[int]
          ) -> torch.Tensor:
    """A tensor over memory at ``ptr`` with the given element shape and strides."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    buffer = (ctypes.c_byte * (extent * itemsize)).from_address(ptr)
    flat = torch.frombuffer(buffer, dtype=dtype, count=extent)
    return torch.as_strided(flat, tuple(shape), tuple(strides))


@dataclass
class PyRefKernel:
    """Reads the packed arguments like the CUDA kernel and computes with the reference."""

    source: KernelSource
    launches: list[tuple[tuple[int, int, int], int]] = field(default_factory=list)

    def launch(self, grid: tuple[int, int, int], args: Sequence[tuple[ArgType, int | float]],
               *, stream: int = 0) -> None:
        kinds = [kind for kind, _ in args]
        assert kinds == [ArgType.PTR] * 5 + [ArgType.I32] * 4 + [ArgType.I64] * 12 \
            + [ArgType.F32], kinds
        vals = [value for _, value in args]
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr = (int(x) for x in vals[:5])
        seqlen_q, seqlen_k, heads_q, heads_kv = (int(x) for x in vals[5:9])
        strides = [int(x) for x in vals[9:21]]
        scale = float(vals[21])
        problem = self.source.problem
        block_m = self.source.config.block_m
        batch = grid[2]
        assert grid == (-(-seqlen_q // block_m), heads_q, batch), grid
        for ptr in (q_ptr, k_ptr, v_ptr, o_ptr):
            assert ptr % 16 == 0, "the kernel needs 16-byte aligned base pointers"
        dtype = torch_dtype(problem.dtype)
        d = problem.head_dim

        def view(ptr: int, n: int, h: int, st: Sequence[int]) -> torch.Tensor:
            return _view(ptr, dtype, (batch, n, h, d), (*st, 1))

        q = view(q_ptr, seqlen_q, heads_q, strides[0:3])
        k = view(k_ptr, seqlen_k, heads_kv, strides[3:6])
        v = view(v_ptr, seqlen_k, heads_kv, strides[6:9])
        o = view(o_ptr, seqlen_q, heads_q, strides[9:12])
        lse = _view(lse_ptr, torch.float32, (batch, heads_q, seqlen_q),
                    (heads_q * seqlen_q, seqlen_q, 1))
        out, lse_ref = reference_attention(q, k, v, causal=problem.causal, scale=scale)
        o.copy_(out.to(dtype))
        lse.copy_(lse_ref.to(torch.float32))
        self.launches.append((grid, stream))


@dataclass
class PyRefBackend:
    """A CPU backend that counts loads; every kernel it loads is a PyRefKernel."""

    name: str = "pyref"
    loads: list[str] = field(default_factory=list)
    kernels: dict[str, PyRefKernel] = field(default_factory=dict)

    def load(self, source: KernelSource) -> PyRefKernel:
        self.loads.append(source.entry)
        kernel = PyRefKernel(source)
        self.kernels[source.entry] = kernel
        return kernel


def qkv(batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_kv: int, head_dim: int,
        dtype: torch.dtype = torch.float16, device: str = "cpu", seed: int | None = None
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh random q (B, Nq, Hq, D), k, v (B, Nk, Hkv, D)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, generator=gen)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=gen)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, generator=gen)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def best_entry(device: str, arch: str, problem: str, seqlen: int, config: str,
               median_ms: float = 1.0) -> BestEntry:
    """A best-of-bucket entry as the tuning database returns it (keys are not checked
    against Problem/KernelConfig here: the dispatcher must cope with bad ones), measured on
    the installed kernel sources where the keys are legal."""
    trial = TrialRecord(
        device=device, problem=Keyed(problem, ()), seqlen=seqlen, config=Keyed(config, ()),
        status=TrialStatus.OK,
        template_digest=installed_digest(problem, config) or "0123456789abcdef",
        median_ms=median_ms, min_ms=median_ms, max_ms=median_ms, count=1, tflops=100.0,
    )
    return BestEntry(trial, arch)


class ListSource:
    """A tuned source over a fixed list of entries that counts how often it is read."""

    def __init__(self, entries: Iterable[BestEntry] = ()) -> None:
        self.entries = list(entries)
        self.reads = 0

    def all_best(self) -> list[BestEntry]:
        self.reads += 1
        return list(self.entries)
