"""The CUDA language on the host: built-in variables over 3-D grids and blocks, static and
dynamic __shared__ memory (poisoned at every block start), __cvta_generic_to_shared, atomics
and the 16-bit conversions (round to nearest even) against NumPy and torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashtune.errors import InvalidInput
from flashtune.runtime.backends.emulator import (
    EmulatedModule,
    build_module,
    f32,
    i32,
    i64,
    ptr,
)

pytestmark = pytest.mark.emulator

SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

extern "C" __global__ void ids(unsigned* out) {
  unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  unsigned thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  unsigned* o = out + (block * blockDim.x * blockDim.y * blockDim.z + thread) * 6;
  o[0] = threadIdx.x; o[1] = threadIdx.y; o[2] = threadIdx.z;
  o[3] = blockIdx.x; o[4] = blockIdx.y; o[5] = blockIdx.z;
}

// Per block: reads static and dynamic shared memory before writing it (poison), then fills a
// static __shared__ tile and loads it with ldmatrix; counts blocks with atomicAdd.
extern "C" __global__ void shared_mem(float* before, unsigned* regs, unsigned* offsets,
                                      float* counter) {
  __shared__ __align__(16) unsigned short tile[8 * 8];
  __shared__ float scratch[4];
  FT_DYNAMIC_SMEM(float, dyn);
  int t = threadIdx.x, b = blockIdx.x;
  if (t == 0) {
    before[b * 2 + 0] = scratch[1];
    before[b * 2 + 1] = dyn[3];
    offsets[0] = static_cast<unsigned>(__cvta_generic_to_shared(tile));
    offsets[1] = static_cast<unsigned>(__cvta_generic_to_shared(dyn));
    atomicAdd(counter, 1.0f);
  }
  __syncthreads();
  for (int i = t; i < 64; i += 32) tile[i] = static_cast<unsigned short>(i + 100 * b);
  scratch[t % 4] = 1.0f;
  dyn[t] = 2.0f;
  __syncthreads();
  unsigned r[1];
  ft::ldmatrix_x1(r, tile + (t % 8) * 8);
  regs[b * 32 + t] = r[0];
}

// 16-bit conversions of every input value.
extern "C" __global__ void convert(const float* x, unsigned short* h, unsigned short* bf,
                                   unsigned* h2, unsigned* bf2, float* back, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    __half hv = __float2half_rn(x[i]);
    __nv_bfloat16 bv = __float2bfloat16_rn(x[i]);
    std::memcpy(&h[i], &hv, 2);
    std::memcpy(&bf[i], &bv, 2);
    h2[i] = ft::pack_half2(x[i], -x[i]);
    bf2[i] = ft::pack_bf162(x[i], -x[i]);
    back[2 * i] = __half2float(hv);
    back[2 * i + 1] = __bfloat162float(bv);
  }
}

// Argument types: int64, float, int32 and pointers arrive intact.
extern "C" __global__ void args(long long a, float b, int c, double* out) {
  if (threadIdx.x == 0) { out[0] = static_cast<double>(a); out[1] = b; out[2] = c; }
}
"""


@pytest.fixture(scope="module")
def module() -> EmulatedModule:
    return build_module(SOURCE, ["ids", "shared_mem", "convert", "args"])


def test_builtin_variables_over_3d_launches(module: EmulatedModule) -> None:
    grid, block = (3, 2, 2), (4, 3, 2)
    nblocks, nthreads = int(np.prod(grid)), int(np.prod(block))
    out = np.full((nblocks, nthreads, 6), 999, dtype=np.uint32)
    module["ids"].launch(grid, block, [ptr(out)])
    for b in range(nblocks):
        bx, by, bz = b % 3, b // 3 % 2, b // 6
        for t in range(nthreads):
            tx, ty, tz = t % 4, t // 4 % 3, t // 12
            assert list(out[b, t]) == [tx, ty, tz, bx, by, bz]


def test_static_and_dynamic_shared_memory(module: EmulatedModule) -> None:
    blocks = 3
    before = np.zeros(blocks * 2, dtype=np.float32)
    regs = np.zeros(blocks * 32, dtype=np.uint32)
    offsets = np.zeros(2, dtype=np.uint32)
    counter = np.zeros(1, dtype=np.float32)
    module["shared_mem"].launch(blocks, 32, [ptr(before), ptr(regs), ptr(offsets),
                                             ptr(counter)], smem_bytes=128)
    # Every block starts with poisoned shared memory (a NaN), also after the first block
    # wrote it.
    assert np.isnan(before).all()
    assert before.view(np.uint32)[0] == 0xFFA5FFA5
    assert counter[0] == blocks
    # The shared window holds static variables first, dynamic memory after them.
    assert offsets[1] >= 128 + 16 and offsets[1] % 128 == 0
    for b in range(blocks):
        tile = np.arange(64, dtype=np.uint32).reshape(8, 8) + 100 * b
        lane = np.arange(32)
        want = tile[lane // 4, 2 * (lane % 4)] | (tile[lane // 4, 2 * (lane % 4) + 1] << 16)
        np.testing.assert_array_equal(regs[b * 32:(b + 1) * 32], want)


def _conversion_inputs() -> np.ndarray:
    rng = np.random.default_rng()
    f16 = np.arange(0, 1 << 16, 7, dtype=np.uint16).view(np.float16).astype(np.float32)
    bf = (np.arange(0, 1 << 16, 7, dtype=np.uint32) << 16).view(np.float32)
    # Ties (exactly half-way between two 16-bit values), values near overflow and underflow.
    ties_h = (f16[np.isfinite(f16)].astype(np.float64)
              + np.spacing(f16[np.isfinite(f16)].astype(np.float16)).astype(np.float64) / 2)
    ties_b = (bf.view(np.uint32) | 0x8000).view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 65519.99,
                        6e-8, 2.98e-8, 3e-8, 1e-45, -1e-45, 3.4e38, -3.4e38], np.float32)
    rand = (rng.standard_normal(4000) * 10.0 ** rng.integers(-9, 9, 4000)).astype(np.float32)
    return np.concatenate([f16, bf, ties_h.astype(np.float32), ties_b, special, rand])


def test_16_bit_conversions_round_to_nearest_even(module: EmulatedModule) -> None:
    x = _conversion_inputs()
    n = x.size
    h = np.zeros(n, np.uint16)
    bf = np.zeros(n, np.uint16)
    h2 = np.zeros(n, np.uint32)
    bf2 = np.zeros(n, np.uint32)
    back = np.zeros((n, 2), np.float32)
    module["convert"].launch(1, 64, [ptr(x), ptr(h), ptr(bf), ptr(h2), ptr(bf2), ptr(back),
                                     i32(n)])
    with np.errstate(over="ignore"):
        want_h = x.astype(np.float16)
        neg_h = (-x).astype(np.float16).view(np.uint16)
    want_bf = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(h[~nan], want_h.view(np.uint16)[~nan])
    np.testing.assert_array_equal(bf[~nan], want_bf[~nan])
    assert np.isnan(h[nan].view(np.float16)).all()
    assert np.isnan((bf[nan].astype(np.uint32) << 16).view(np.float32)).all()
    neg_bf = torch.from_numpy(-x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal((h2 & 0xFFFF)[~nan], want_h.view(np.uint16)[~nan])
    np.testing.assert_array_equal((h2 >> 16)[~nan], neg_h[~nan])
    np.testing.assert_array_equal((bf2 & 0xFFFF)[~nan], want_bf[~nan])
    np.testing.assert_array_equal((bf2 >> 16)[~nan], neg_bf[~nan])
    np.testing.assert_array_equal(back[~nan, 0], want_h[~nan].astype(np.float32))
    np.testing.assert_array_equal(
        back[~nan, 1], (want_bf[~nan].astype(np.uint32) << 16).view(np.float32))


def test_arguments_are_unpacked_by_parameter_type(module: EmulatedModule) -> None:
    out = np.zeros(3)
    module["args"].launch(1, 32, [i64(-(1 << 40) - 3), f32(1.5), i32(-7), ptr(out)])
    np.testing.assert_array_equal(out, [-(1 << 40) - 3, 1.5, -7])
    kernel = module["args"]
    assert kernel.signature == "lfip"
    with pytest.raises(InvalidInput, match=r"argument 0: the kernel parameter is int64 but a "
                                           r"i32 was passed"):
        kernel.launch(1, 32, [i32(1), f32(1.5), i32(-7), ptr(out)])
    with pytest.raises(InvalidInput, match=r"args takes 4 arguments \(lfip\), got 3"):
        kernel.launch(1, 32, [i64(1), f32(1.5), i32(-7)])
    with pytest.raises(InvalidInput, match=r"argument 2: 4294967296 does not fit a int32"):
        kernel.launch(1, 32, [i64(1), f32(1.5), i32(1 << 32), ptr(out)])
