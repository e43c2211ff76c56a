"""mma.sync m16n8k16 (f16 and bf16) against NumPy, with fragments built in Python from the
reference layout tables, and the ldmatrix operand recipes that feed it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from emu_helpers import mma_a_fragment, mma_b_fragment, mma_c_fragment

from flashtune.errors import EmulatorError
from flashtune.runtime.backends.emulator import EmulatedModule, build_module, i32, ptr

pytestmark = pytest.mark.emulator

SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// regs: 32 lanes x (4 A + 2 B) uint32; c, d: 32 lanes x 4 floats; `chain` mmas accumulate
// into d with the same operands (d = A*B + ... + A*B + C), computed in place.
extern "C" __global__ void mma_frag(const unsigned* regs, const float* c, float* d, int bf16,
                                    int chain) {
  int lane = threadIdx.x;
  unsigned a[4] = {regs[lane * 6 + 0], regs[lane * 6 + 1], regs[lane * 6 + 2],
                   regs[lane * 6 + 3]};
  unsigned b[2] = {regs[lane * 6 + 4], regs[lane * 6 + 5]};
  float acc[4] = {c[lane * 4 + 0], c[lane * 4 + 1], c[lane * 4 + 2], c[lane * 4 + 3]};
  for (int i = 0; i < chain; ++i) {
    if (bf16) ft::mma_m16n8k16_bf16(acc, a, b, acc);
    else ft::mma_m16n8k16_f16(acc, a, b, acc);
  }
  for (int i = 0; i < 4; ++i) d[lane * 4 + i] = acc[i];
}

// The operand recipes of the reference (section 2): A 16x16 row-major [m][k] with x4,
// B from K stored [n][k] with x2, B from V stored [k][n] with x2.trans. Computes
// D1 = A * K^T (16x8) and D2 = A * V (16x8) for 16-bit inputs.
extern "C" __global__ void mma_recipe(const unsigned short* a, const unsigned short* kmat,
                                      const unsigned short* vmat, float* d1, float* d2,
                                      int bf16) {
  FT_DYNAMIC_SMEM(unsigned char, smem);
  // Row pitch 24 elements (48 bytes, 16-byte aligned) so rows are not contiguous.
  unsigned short* sa = reinterpret_cast<unsigned short*>(smem);
  unsigned short* sk = sa + 16 * 24;
  unsigned short* sv = sk + 8 * 24;
  int lane = threadIdx.x;
  for (int i = lane; i < 16 * 16; i += 32) sa[(i / 16) * 24 + i % 16] = a[i];
  for (int i = lane; i < 8 * 16; i += 32) sk[(i / 16) * 24 + i % 16] = kmat[i];
  for (int i = lane; i < 16 * 8; i += 32) sv[(i / 8) * 24 + i % 8] = vmat[i];
  __syncthreads();
  unsigned ra[4], rk[2], rv[2];
  ft::ldmatrix_x4(ra, sa + (lane % 16) * 24 + (lane / 16) * 8);
  ft::ldmatrix_x2(rk, sk + (lane % 8) * 24 + ((lane / 8) % 2) * 8);
  ft::ldmatrix_x2_trans(rv, sv + (lane % 16) * 24);
  float z[4] = {0.f, 0.f, 0.f, 0.f}, o1[4], o2[4];
  if (bf16) {
    ft::mma_m16n8k16_bf16(o1, ra, rk, z);
    ft::mma_m16n8k16_bf16(o2, ra, rv, z);
  } else {
    ft::mma_m16n8k16_f16(o1, ra, rk, z);
    ft::mma_m16n8k16_f16(o2, ra, rv, z);
  }
  int g = lane / 4, t = lane % 4;
  d1[g * 8 + 2 * t] = o1[0]; d1[g * 8 + 2 * t + 1] = o1[1];
  d1[(g + 8) * 8 + 2 * t] = o1[2]; d1[(g + 8) * 8 + 2 * t + 1] = o1[3];
  d2[g * 8 + 2 * t] = o2[0]; d2[g * 8 + 2 * t + 1] = o2[1];
  d2[(g + 8) * 8 + 2 * t] = o2[2]; d2[(g + 8) * 8 + 2 * t + 1] = o2[3];
}
"""


@pytest.fixture(scope="module")
def module() -> EmulatedModule:
    return build_module(SOURCE, ["mma_frag", "mma_recipe"])


def _bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """16-bit patterns of float64 values rounded to fp16 / bf16, and the rounded values."""
    if dtype == "fp16":
        return x.astype(np.float16).view(np.uint16)
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _values(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "fp16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _pack(lo: int, hi: int) -> int:
    return int(lo) | (int(hi) << 16)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("chain", [1, 3])
def test_mma_matches_numpy(module: EmulatedModule, dtype: str, chain: int) -> None:
    rng = np.random.default_rng()
    a_bits = _bits(rng.standard_normal((16, 16)) * 2, dtype)
    b_bits = _bits(rng.standard_normal((16, 8)) * 2, dtype)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    regs = np.zeros((32, 6), dtype=np.uint32)
    cfrag = np.zeros((32, 4), dtype=np.float32)
    for lane in range(32):
        ae = [a_bits[r, k] for r, k in mma_a_fragment(a_bits, lane)]
        be = [b_bits[k, n] for k, n in mma_b_fragment(lane)]
        regs[lane, :4] = [_pack(ae[2 * i], ae[2 * i + 1]) for i in range(4)]
        regs[lane, 4:] = [_pack(be[0], be[1]), _pack(be[2], be[3])]
        cfrag[lane] = [c[r, n] for r, n in mma_c_fragment(lane)]
    d = np.full((32, 4), np.nan, dtype=np.float32)
    module["mma_frag"].launch(1, 32, [ptr(regs), ptr(cfrag), ptr(d), i32(dtype == "bf16"),
                                      i32(chain)])
    expected = chain * (_values(a_bits, dtype) @ _values(b_bits, dtype)) + c.astype(np.float64)
    got = np.zeros((16, 8))
    for lane in range(32):
        for i, (r, n) in enumerate(mma_c_fragment(lane)):
            got[r, n] = d[lane, i]
    # Products are exact; each mma rounds its f32 result once.
    np.testing.assert_allclose(got, expected, rtol=0, atol=chain * 4e-6 * np.abs(expected).max())


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_ldmatrix_recipes_feed_mma(module: EmulatedModule, dtype: str) -> None:
    rng = np.random.default_rng()
    a = _bits(rng.standard_normal((16, 16)), dtype)
    kmat = _bits(rng.standard_normal((8, 16)), dtype)   # [n][k]
    vmat = _bits(rng.standard_normal((16, 8)), dtype)   # [k][n]
    d1 = np.full((16, 8), np.nan, dtype=np.float32)
    d2 = np.full((16, 8), np.nan, dtype=np.float32)
    smem = (16 + 8 + 16) * 24 * 2
    module["mma_recipe"].launch(1, 32, [ptr(a), ptr(kmat), ptr(vmat), ptr(d1), ptr(d2),
                                        i32(dtype == "bf16")], smem_bytes=smem)
    av, kv, vv = (_values(x, dtype) for x in (a, kmat, vmat))
    np.testing.assert_allclose(d1, av @ kv.T, rtol=0, atol=1e-5 * np.abs(av @ kv.T).max())
    np.testing.assert_allclose(d2, av @ vv, rtol=0, atol=1e-5 * np.abs(av @ vv).max())


def test_poison_operand_is_reported(module: EmulatedModule) -> None:
    regs = np.full((32, 6), 0x3C003C00, dtype=np.uint32)  # fp16 ones
    regs[5, 2] = 0xFFA53C00  # the shared-memory poison in the high half of lane 5's a[2]
    c = np.zeros((32, 4), dtype=np.float32)
    d = np.full((32, 4), np.nan, dtype=np.float32)
    with pytest.raises(EmulatorError, match=r"operand a\[2\] of lane 5 .* poison 0xffa5"):
        module["mma_frag"].launch(1, 32, [ptr(regs), ptr(c), ptr(d), i32(0), i32(1)])
