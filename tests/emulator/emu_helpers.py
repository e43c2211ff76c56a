"""Independent Python models of the warp-level semantics (reference/ptx-warp-semantics.md),
used to check the emulator's C++ implementation lane by lane."""

from __future__ import annotations

import hashlib

import numpy as np

from flashtune.codegen.render import included_headers
from flashtune.codegen.spec import DType, KernelConfig, KernelSource, Problem


def mma_a_fragment(a: np.ndarray, lane: int) -> list[tuple[int, int]]:
    """(row, col) of the 8 A elements lane holds: reg0 lo, reg0 hi, reg1 lo, ..., reg3 hi."""
    g, t = lane >> 2, lane & 3
    out = []
    for row, col in ((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)):
        out += [(row, col), (row, col + 1)]
    return out


def mma_b_fragment(lane: int) -> list[tuple[int, int]]:
    """(k, n) of the 4 B elements lane holds: reg0 lo, reg0 hi, reg1 lo, reg1 hi."""
    g, t = lane >> 2, lane & 3
    return [(2 * t, g), (2 * t + 1, g), (2 * t + 8, g), (2 * t + 9, g)]


def mma_c_fragment(lane: int) -> list[tuple[int, int]]:
    """(row, col) of c0..c3."""
    g, t = lane >> 2, lane & 3
    return [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]


def ldmatrix_expected(mats: np.ndarray, trans: bool) -> np.ndarray:
    """Registers (lanes x count) of uint32 from matrices (count x 8 x 8) of uint16."""
    count = mats.shape[0]
    out = np.zeros((32, count), dtype=np.uint64)
    for lane in range(32):
        for j in range(count):
            if trans:
                lo, hi = mats[j, 2 * (lane % 4), lane // 4], mats[j, 2 * (lane % 4) + 1, lane // 4]
            else:
                lo, hi = mats[j, lane // 4, 2 * (lane % 4)], mats[j, lane // 4, 2 * (lane % 4) + 1]
            out[lane, j] = int(lo) | (int(hi) << 16)
    return out.astype(np.uint32)


def shfl_expected(mode: str, values: list[int], args: list[int], width: int,
                  active: set[int]) -> dict[int, int]:
    """What each active lane receives, per the PTX shfl.sync definition.

    CUDA sets the clamp value to width - 1 within each segment (0 for `up`); `xor` only
    treats sources beyond the caller's segment as out of range (earlier segments are read).
    """
    out = {}
    for lane in sorted(active):
        b = args[lane] & 31
        first = lane & ~(width - 1)
        last = first + width - 1
        if mode == "idx":
            src, ok = first | (b & (width - 1)), True
        elif mode == "up":
            src = lane - b
            ok = src >= first
        elif mode == "down":
            src = lane + b
            ok = src <= last
        else:
            src = lane ^ b
            ok = src <= last
        out[lane] = values[src] if ok else values[lane]
    return out


def attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool,
                        scale: float) -> tuple[np.ndarray, np.ndarray]:
    """float64 attention of (batch, seq, heads, dim) tensors, GQA by head groups.

    The causal diagonal is aligned to the bottom-right corner: row i sees key j iff
    j <= i + seqlen_k - seqlen_q. Rows that see no key have output 0 and LSE +inf (the
    kernel contract: exp(s - LSE) is then 0 in a backward pass).
    Returns O (batch, seq_q, heads_q, dim) and LSE (batch, heads_q, seq_q).
    """
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    batch, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = hq // hk
    k = np.repeat(k, group, axis=2)
    v = np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        visible = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq
        s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe)
    total = p.sum(axis=-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p / np.where(total > 0, total, 1.0), v)
    with np.errstate(divide="ignore"):
        lse = (np.log(total) + m_safe)[..., 0]
    lse = np.where(total[..., 0] > 0, lse, np.inf)
    return o, lse


def sm90a_source(code: str, entry: str) -> KernelSource:
    """A hand-written test module as a KernelSource for NVRTC's sm_90a build (the wgmma
    tests' SASS checks): its headers inlined, 128 threads, no dynamic shared memory."""
    headers = included_headers(code)
    digest = hashlib.sha256(code.encode() + repr(sorted(headers.items())).encode()).hexdigest()
    return KernelSource(problem=Problem(head_dim=64, dtype=DType.FP16),
                        config=KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=1),
                        code=code, entry=entry, headers=headers, options=("-std=c++17",),
                        digest=digest, smem_bytes=0, threads=128, target="sm_90a")
