"""mma.sync m16n8k32 with e4m3 (and e5m2) operands against float64, with fragments built in
Python from the PTX ISA's 8-bit layout (written out here, independently of the emulator), and the
ldmatrix recipe the FP8 forward uses: the 16-bit operand recipes applied to rows of bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashtune.errors import EmulatorError
from flashtune.runtime.backends.emulator import EmulatedModule, build_module, i32, ptr

pytestmark = pytest.mark.emulator

SOURCE = r"""
#include <cuda_fp16.h>

// regs: 32 lanes x (4 A + 2 B) uint32; c, d: 32 lanes x 4 floats; `chain` mmas accumulate;
// e5m2: the operands' format (0: e4m3).
extern "C" __global__ void mma_frag(const unsigned* regs, const float* c, float* d, int chain,
                                    int e5m2) {
  int lane = threadIdx.x;
  unsigned a[4] = {regs[lane * 6 + 0], regs[lane * 6 + 1], regs[lane * 6 + 2],
                   regs[lane * 6 + 3]};
  unsigned b[2] = {regs[lane * 6 + 4], regs[lane * 6 + 5]};
  float acc[4] = {c[lane * 4 + 0], c[lane * 4 + 1], c[lane * 4 + 2], c[lane * 4 + 3]};
  for (int i = 0; i < chain; ++i) {
    if (e5m2) ft::mma_m16n8k32_e5m2(acc, a, b, acc);
    else ft::mma_m16n8k32_e4m3(acc, a, b, acc);
  }
  for (int i = 0; i < 4; ++i) d[lane * 4 + i] = acc[i];
}

// A 16x32 [m][k] and K 8x32 [n][k] bytes in shared rows of 48 bytes: A with ldmatrix x4
// (row lane % 16, 16-byte half lane / 16), B with x2 (row lane % 8, half (lane / 8) % 2).
extern "C" __global__ void mma_recipe(const unsigned char* a, const unsigned char* kmat,
                                      float* d) {
  FT_DYNAMIC_SMEM(unsigned char, smem);
  unsigned char* sa = smem;
  unsigned char* sk = smem + 16 * 48;
  int lane = threadIdx.x;
  for (int i = lane; i < 16 * 32; i += 32) sa[(i / 32) * 48 + i % 32] = a[i];
  for (int i = lane; i < 8 * 32; i += 32) sk[(i / 32) * 48 + i % 32] = kmat[i];
  __syncthreads();
  unsigned ra[4], rk[2];
  ft::ldmatrix_x4(ra, sa + (lane % 16) * 48 + (lane / 16) * 16);
  ft::ldmatrix_x2(rk, sk + (lane % 8) * 48 + ((lane / 8) % 2) * 16);
  float z[4] = {0.f, 0.f, 0.f, 0.f}, o[4];
  ft::mma_m16n8k32_e4m3(o, ra, rk, z);
  int g = lane / 4, t = lane % 4;
  d[g * 8 + 2 * t] = o[0]; d[g * 8 + 2 * t + 1] = o[1];
  d[(g + 8) * 8 + 2 * t] = o[2]; d[(g + 8) * 8 + 2 * t + 1] = o[3];
}
"""


@pytest.fixture(scope="module")
def module() -> EmulatedModule:
    return build_module(SOURCE, ["mma_frag", "mma_recipe"])


def e4m3(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The e4m3 codes of float64 values (torch's round-to-nearest cast) and their values in
    float64 (torch's decoding), so that the reference never reads the emulator's tables."""
    t = torch.from_numpy(x).to(torch.float8_e4m3fn)
    return t.view(torch.uint8).numpy().copy(), t.to(torch.float64).numpy()


def e5m2(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The e5m2 codes of float64 values (torch's cast) and their float64 values."""
    t = torch.from_numpy(x).to(torch.float8_e5m2)
    return t.view(torch.uint8).numpy().copy(), t.to(torch.float64).numpy()


def a_coords(lane: int, reg: int, byte: int) -> tuple[int, int]:
    """(row, k) of byte `byte` of A register `reg` of `lane` (PTX ISA, m16n8k32, .e4m3)."""
    g, t = lane // 4, lane % 4
    return g + 8 * (reg % 2), 4 * t + 16 * (reg // 2) + byte


def b_coords(lane: int, reg: int, byte: int) -> tuple[int, int]:
    """(k, n) of byte `byte` of B register `reg` of `lane`."""
    g, t = lane // 4, lane % 4
    return 4 * t + 16 * reg + byte, g


def c_coords(lane: int, i: int) -> tuple[int, int]:
    g, t = lane // 4, lane % 4
    return g + 8 * (i // 2), 2 * t + i % 2


def fragments(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """32 lanes x (4 A + 2 B) registers of byte codes a (16 x 32) and b (32 x 8)."""
    regs = np.zeros((32, 6), dtype=np.uint32)
    for lane in range(32):
        for reg in range(4):
            regs[lane, reg] = sum(int(a[a_coords(lane, reg, j)]) << (8 * j) for j in range(4))
        for reg in range(2):
            regs[lane, 4 + reg] = sum(int(b[b_coords(lane, reg, j)]) << (8 * j)
                                      for j in range(4))
    return regs


def unfragment(d: np.ndarray) -> np.ndarray:
    out = np.full((16, 8), np.nan)
    for lane in range(32):
        for i in range(4):
            out[c_coords(lane, i)] = d[lane, i]
    return out


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("chain", [1, 3])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_mma_matches_float64(module: EmulatedModule, seed: int, chain: int,
                                 fmt: str) -> None:
    """Products of FP8 values are exact and the sum is rounded to float once per mma, so
    the result is within one float32 rounding (2^-24 relative) per mma of the float64
    product of the same values. Inputs span each format's range: e4m3's denormals (below
    2^-6) to values near its largest, 448; e5m2's (below 2^-14) to near 57344."""
    rng = np.random.default_rng(seed + 10 * (fmt == "e5m2"))
    cast = e4m3 if fmt == "e4m3" else e5m2
    low, high = (-9, 8) if fmt == "e4m3" else (-16, 14)
    scale = 2.0 ** rng.integers(low, high, size=(16, 32))
    a_codes, a_vals = cast(rng.standard_normal((16, 32)) * scale)
    b_codes, b_vals = cast(rng.standard_normal((32, 8)) * 4)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    cfrag = np.array([[c[c_coords(lane, i)] for i in range(4)] for lane in range(32)],
                     dtype=np.float32)
    d = np.full((32, 4), np.nan, dtype=np.float32)
    module["mma_frag"].launch(1, 32, [ptr(fragments(a_codes, b_codes)), ptr(cfrag), ptr(d),
                                      i32(chain), i32(fmt == "e5m2")])
    expected = chain * (a_vals @ b_vals) + c.astype(np.float64)
    got = unfragment(d)
    bound = chain * 2.0**-24 * (chain * np.abs(a_vals) @ np.abs(b_vals) + np.abs(c))
    assert np.all(np.abs(got - expected) <= bound), (seed, np.abs(got - expected).max())


def test_e4m3_mma_single_product_is_exact(module: EmulatedModule) -> None:
    """One nonzero product per output (the largest e4m3 value times the smallest denormal,
    448 * 2^-9) lands exactly."""
    a_codes = np.zeros((16, 32), dtype=np.uint8)
    b_codes = np.zeros((32, 8), dtype=np.uint8)
    a_codes[:, 5] = 0x7E   # 448
    b_codes[5, :] = 0x01   # 2^-9
    d = np.full((32, 4), np.nan, dtype=np.float32)
    module["mma_frag"].launch(1, 32, [ptr(fragments(a_codes, b_codes)),
                                      ptr(np.zeros((32, 4), dtype=np.float32)), ptr(d), i32(1),
                                      i32(0)])
    assert np.all(unfragment(d) == 448.0 * 2.0**-9)


def test_e4m3_nan_propagates(module: EmulatedModule) -> None:
    a_codes = np.full((16, 32), 0x38, dtype=np.uint8)  # 1.0
    b_codes = np.full((32, 8), 0x38, dtype=np.uint8)
    a_codes[3, 7] = 0x7F  # NaN in row 3
    d = np.full((32, 4), 0.0, dtype=np.float32)
    module["mma_frag"].launch(1, 32, [ptr(fragments(a_codes, b_codes)),
                                      ptr(np.zeros((32, 4), dtype=np.float32)), ptr(d), i32(1),
                                      i32(0)])
    got = unfragment(d)
    assert np.all(np.isnan(got[3])) and np.all(got[np.arange(16) != 3] == 32.0)


def test_ldmatrix_recipe_on_byte_rows_feeds_the_e4m3_mma(module: EmulatedModule) -> None:
    """The forward's Q K^T recipe: ldmatrix of 16-byte halves of byte rows gives the
    m16n8k32 A and B fragments."""
    rng = np.random.default_rng(7)
    a_codes, a_vals = e4m3(rng.standard_normal((16, 32)))
    k_codes, k_vals = e4m3(rng.standard_normal((8, 32)))
    d = np.full((16, 8), np.nan, dtype=np.float32)
    module["mma_recipe"].launch(1, 32, [ptr(a_codes), ptr(k_codes), ptr(d)],
                                smem_bytes=24 * 48)
    expected = a_vals @ k_vals.T
    bound = 2.0**-24 * (np.abs(a_vals) @ np.abs(k_vals).T)
    assert np.all(np.abs(d - expected) <= bound)


def test_poison_operand_is_reported(module: EmulatedModule) -> None:
    regs = np.full((32, 6), 0x38383838, dtype=np.uint32)  # e4m3 ones
    regs[9, 4] = 0xFFA53838  # the shared-memory poison in the high half of lane 9's b[0]
    d = np.full((32, 4), np.nan, dtype=np.float32)
    with pytest.raises(EmulatorError, match=r"mma_m16n8k32_e4m3 .* operand b\[0\] of lane 9"):
        module["mma_frag"].launch(1, 32, [ptr(regs), ptr(np.zeros((32, 4), dtype=np.float32)),
                                          ptr(d), i32(1), i32(0)])


def test_e5m2_infinity_and_nan(module: EmulatedModule) -> None:
    """e5m2 has infinities (S.11111.00): inf x 1 stays inf, inf x 0 and the NaN codes give
    NaN; the other rows see ones (0x3C)."""
    a_codes = np.full((16, 32), 0x3C, dtype=np.uint8)  # 1.0
    b_codes = np.full((32, 8), 0x3C, dtype=np.uint8)
    a_codes[2, 4] = 0x7C   # +inf
    a_codes[5, 0] = 0x7D   # NaN
    b_codes[:, 7] = 0x00   # column 7 sees zeros
    d = np.full((32, 4), 0.0, dtype=np.float32)
    module["mma_frag"].launch(1, 32, [ptr(fragments(a_codes, b_codes)),
                                      ptr(np.zeros((32, 4), dtype=np.float32)), ptr(d), i32(1),
                                      i32(1)])
    got = unfragment(d)
    assert np.all(got[2, :7] == np.inf) and np.isnan(got[2, 7]) and np.all(np.isnan(got[5]))
    others = np.setdiff1d(np.arange(16), [2, 5])
    assert np.all(got[others, :7] == 32.0) and np.all(got[others, 7] == 0.0)
