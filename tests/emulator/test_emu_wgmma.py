"""wgmma.mma_async (sm_90a) in the emulator: one warpgroup computes D = A B (64 x N, K = 64;
N 64, 128, 256 and the non-powers of two 80 and 176) from 128-byte-swizzled shared memory
through matrix descriptors (B K-major as K is, or MN-major as V is) and with A from
registers, against float64 in both thread orders; planted bugs (a wrong descriptor bit, a
missing or late wgmma wait, accumulators tied before their wait, a missing wgmma fence) are
caught. The same source compiles
with NVRTC for sm_90a into HGMMA."""

from __future__ import annotations

import collections
import hashlib
import re

import numpy as np
import pytest
import torch
from emu_helpers import sm90a_source

from flashtune.codegen.render import templates_dir
from flashtune.errors import EmulatorError, InvalidConfig
from flashtune.runtime.backends.emulator import (
    EmulatedModule,
    LaunchOptions,
    build_module,
    i32,
    ptr,
)
from flashtune.runtime.backends.emulator.kernel import Schedule
from flashtune.toolchain.compiler import compile_source
from flashtune.toolchain.cuda import find_toolchain
from flashtune.toolchain.disasm import disassemble

SOURCE = r"""
#include "wgmma.cuh"

// a: (64 x 64) [m][k]; b: (N x 64) [n][k] when b_mn_major == 0 (as K), else (64 x N) [k][n]
// (as V); d: (64 x N) f32. mode 0: A from shared memory, 1: A from registers.
// bug: 0 none, 1 B descriptor with the 64B instead of the 128B swizzle, 2 a reserved
// descriptor bit, 3 accumulators read before the wait, 4 no wait at all, 5 no fence, 6 the
// accumulators tied (wgmma_fence_operands) before the wait.
template <int N, bool BF16, bool B_MN>
__device__ void gemm(const unsigned short* a, const unsigned short* b, float* d, int mode,
                     int bug) {
  FT_DYNAMIC_SMEM(unsigned char, raw);
  const unsigned window = ft::smem_address(raw);
  const unsigned pad = (1024u - (window & 1023u)) & 1023u;  // 128B swizzle: 1024-B aligned
  unsigned char* smem = raw + pad;
  const unsigned a_addr = window + pad, b_addr = a_addr + 64 * 128;
  const int tid = threadIdx.x;
  // A and a K-major B: 128-byte rows of 64 elements, chunk c of row r at c ^ (r % 8).
  for (int i = tid; i < 64 * 8; i += 128) {
    int r = i / 8, c = i % 8;
    *reinterpret_cast<uint4*>(smem + r * 128 + ((c ^ (r % 8)) * 16)) =
        *reinterpret_cast<const uint4*>(a + r * 64 + c * 8);
  }
  unsigned char* bs = smem + 64 * 128;
  if (!B_MN) {
    for (int i = tid; i < N * 8; i += 128) {
      int r = i / 8, c = i % 8;
      *reinterpret_cast<uint4*>(bs + r * 128 + ((c ^ (r % 8)) * 16)) =
          *reinterpret_cast<const uint4*>(b + r * 64 + c * 8);
    }
  } else {  // panels of 64 columns: rows of k, 128 bytes each, panel p at p * 64 * 128
    for (int i = tid; i < 64 * (N / 8); i += 128) {
      int k = i / (N / 8), cn = i % (N / 8), p = cn / 8, c = cn % 8;
      *reinterpret_cast<uint4*>(bs + p * 64 * 128 + k * 128 + ((c ^ (k % 8)) * 16)) =
          *reinterpret_cast<const uint4*>(b + k * N + cn * 8);
    }
  }
  ft::fence_proxy_async();
  __syncthreads();
  const int warp = tid / 32, lane = tid % 32;
  float acc[N / 2];
  if (bug != 5) ft::wgmma_fence();
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const int swizzle = bug == 1 ? ft::kSwizzle64B : ft::kSwizzle128B;
    unsigned long long bd = B_MN ? ft::wgmma_desc(b_addr + s * 2048, 64 * 128, 1024, swizzle)
                                 : ft::wgmma_desc(b_addr + s * 32, 16, 1024, swizzle);
    if (bug == 2) bd |= 1ull << 15;
    if (mode == 0) {
      ft::wgmma_ss<N, BF16, false, B_MN>(acc, ft::wgmma_desc(a_addr + s * 32, 16, 1024,
                                                              ft::kSwizzle128B), bd, s > 0);
    } else {
      unsigned ar[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = 16 * warp + lane / 4 + 8 * (r & 1);
        const int col = 16 * s + 8 * (r >> 1) + 2 * (lane % 4);
        ar[r] = static_cast<unsigned>(a[row * 64 + col]) |
                static_cast<unsigned>(a[row * 64 + col + 1]) << 16;
      }
      ft::wgmma_rs<N, BF16, B_MN>(acc, ar, bd, s > 0);
    }
  }
  ft::wgmma_commit();
  if (bug != 3 && bug != 4 && bug != 6) ft::wgmma_wait<0>();
  if (bug != 3 && bug != 4) ft::wgmma_fence_operands(acc);
#pragma unroll
  for (int v = 0; v < N / 2; ++v) {
    const int row = 16 * warp + lane / 4 + 8 * ((v >> 1) & 1);
    const int col = 8 * (v >> 2) + 2 * (lane % 4) + (v & 1);
    d[row * N + col] = acc[v];
  }
  if (bug == 3 || bug == 6) ft::wgmma_wait<0>();
}

#define GEMM_ENTRY(name, N, BF16, B_MN)                                                 \
  extern "C" __global__ void name(const unsigned short* a, const unsigned short* b, float* d, \
                                  int mode, int bug) {                                       \
    gemm<N, BF16, B_MN>(a, b, d, mode, bug);                                                 \
  }
GEMM_ENTRY(gemm_n64_f16_k, 64, false, false)
GEMM_ENTRY(gemm_n64_bf16_v, 64, true, true)
GEMM_ENTRY(gemm_n128_bf16_k, 128, true, false)
GEMM_ENTRY(gemm_n128_f16_v, 128, false, true)
GEMM_ENTRY(gemm_n256_f16_v, 256, false, true)
GEMM_ENTRY(gemm_n176_bf16_k, 176, true, false)
GEMM_ENTRY(gemm_n80_f16_k, 80, false, false)
"""

ENTRIES = {"gemm_n64_f16_k": (64, "fp16", False), "gemm_n64_bf16_v": (64, "bf16", True),
           "gemm_n128_bf16_k": (128, "bf16", False), "gemm_n128_f16_v": (128, "fp16", True),
           "gemm_n256_f16_v": (256, "fp16", True),
           # key tiles that are not powers of two (FA3's 176 at head dim 128, 80 at 256)
           "gemm_n176_bf16_k": (176, "bf16", False), "gemm_n80_f16_k": (80, "fp16", False)}


@pytest.fixture(scope="module")
def module() -> EmulatedModule:
    return build_module(SOURCE, list(ENTRIES), include_dirs=[templates_dir()])


def _bits(x: np.ndarray, dtype: str) -> np.ndarray:
    t = torch.from_numpy(x).to(torch.float16 if dtype == "fp16" else torch.bfloat16)
    bits: np.ndarray = t.view(torch.int16).numpy().view(np.uint16).copy()
    return bits


def _values(bits: np.ndarray, dtype: str) -> np.ndarray:
    t = torch.from_numpy(bits.view(np.int16)).view(
        torch.float16 if dtype == "fp16" else torch.bfloat16)
    return t.to(torch.float64).numpy()


def _run(module: EmulatedModule, entry: str, mode: int, bug: int, seed: int,
         schedule: Schedule = Schedule.FORWARD) -> tuple[np.ndarray, np.ndarray]:
    n, dtype, b_mn = ENTRIES[entry]
    rng = np.random.default_rng(seed)
    a = _bits(rng.standard_normal((64, 64)), dtype)
    b = _bits(rng.standard_normal((64, n) if b_mn else (n, 64)), dtype)
    d = np.full((64, n), np.nan, dtype=np.float32)
    smem = 1024 + 64 * 128 + n * 128
    module[entry].launch(1, 128, [ptr(a), ptr(b), ptr(d), i32(mode), i32(bug)],
                         smem_bytes=smem, options=LaunchOptions(schedule=schedule))
    bv = _values(b, dtype)
    expected = _values(a, dtype) @ (bv if b_mn else bv.T)
    return d, expected


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize("mode", [0, 1], ids=["ss", "rs"])
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_wgmma_matches_float64(module: EmulatedModule, entry: str, mode: int,
                               schedule: Schedule) -> None:
    seed = int.from_bytes(hashlib.sha256(f"{entry}{mode}{schedule}".encode()).digest()[:4],
                          "big")
    d, expected = _run(module, entry, mode, 0, seed, schedule)
    # Products of 16-bit floats are exact; each k16 step rounds the f32 sum once (4 steps).
    err = np.abs(d.astype(np.float64) - expected)
    assert np.isfinite(d).all(), f"seed {seed}: unwritten or poisoned accumulators"
    assert err.max() <= 4 * 2.0 ** -23 * np.abs(expected).max() * 8, f"seed {seed}: {err.max()}"


def test_wrong_swizzle_bits_are_caught(module: EmulatedModule) -> None:
    d, expected = _run(module, "gemm_n64_f16_k", 0, 1, seed=11)
    assert np.abs(d - expected).max() > 1.0  # the 64B pattern reads other chunks
    # MN-major with 64-byte rows: the panels (LBO) lie beyond the tile
    with pytest.raises(EmulatorError, match="B descriptor addresses shared-window byte"):
        _run(module, "gemm_n64_bf16_v", 0, 1, seed=11)


def test_reserved_descriptor_bit_is_an_error(module: EmulatedModule) -> None:
    with pytest.raises(EmulatorError, match="reserved bits 0x0000000000008000"):
        _run(module, "gemm_n64_f16_k", 0, 2, seed=12)


def test_accumulators_read_before_the_wait_are_poison(module: EmulatedModule) -> None:
    d, _ = _run(module, "gemm_n64_f16_k", 0, 3, seed=13)
    assert np.isnan(d).all()


def test_accumulators_tied_before_the_wait_are_an_error(module: EmulatedModule) -> None:
    # wgmma_fence_operands (where the kernel ties its reads) before the wait that covers them
    with pytest.raises(EmulatorError, match=r"wgmma_fence_operands at .*: thread \d+ reads "
                       r"accumulators that the wgmma at .* still writes \(its group has 0 "
                       r"committed after it; 1 committed groups pending\)"):
        _run(module, "gemm_n64_f16_k", 0, 6, seed=16)


def test_missing_wait_is_an_error(module: EmulatedModule) -> None:
    with pytest.raises(EmulatorError, match="wgmma results never waited for"):
        _run(module, "gemm_n64_f16_k", 1, 4, seed=14)


def test_missing_fence_is_an_error(module: EmulatedModule) -> None:
    with pytest.raises(EmulatorError, match="without a wgmma_fence"):
        _run(module, "gemm_n128_bf16_k", 0, 5, seed=15)


def test_nvrtc_compiles_it_for_sm90a_into_hgmma() -> None:
    source = sm90a_source(SOURCE, "gemm_n128_f16_v")
    kernel = compile_source(source, "sm_90")
    assert kernel.arch == "sm_90a" and kernel.resources.spill_bytes == 0
    with pytest.raises(InvalidConfig, match="sm_90a"):
        compile_source(source, "sm_80")
    if find_toolchain().nvdisasm is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    sass = disassemble(kernel.cubin)  # the whole module: all seven kernels
    found = collections.Counter(re.findall(r"\bHGMMA\.(64x\d+x16\.F32(?:\.BF16)?)\b", sass))
    # each kernel: 4 k-steps from shared memory and 4 with A from registers
    assert found == {"64x64x16.F32": 8, "64x64x16.F32.BF16": 8, "64x128x16.F32": 8,
                     "64x128x16.F32.BF16": 8, "64x256x16.F32": 8, "64x176x16.F32.BF16": 8,
                     "64x80x16.F32": 8}, found
