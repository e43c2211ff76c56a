"""Launch counters (LaunchOptions(counters=True)): exact figures for micro-kernels with known
access patterns, results identical with counters on and off, and the forward kernel's
default configs (global bytes near the algorithm's minimum, conflict-free shared memory)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from emu_helpers import attention_reference, ldmatrix_expected

from flashtune.codegen.spec import DType, Problem
from flashtune.families import render
from flashtune.families.fwd.args import pack_args
from flashtune.families.fwd.defaults import default_config
from flashtune.families.launch_args import grid
from flashtune.runtime.backends.emulator import (
    EmulatedModule,
    EmulatorBackend,
    EmulatorCounters,
    LaunchOptions,
    build_module,
    i32,
    ptr,
)

pytestmark = pytest.mark.emulator

SMEM = 4096
ON = LaunchOptions(counters=True)

SOURCE = r"""
// Thread t copies 16 bytes from src + src_off[t] to shared memory at dst_off[t] (cp.async,
// src_bytes of them read, the rest zero-filled), then writes the shared bytes back to out.
extern "C" __global__ void copy(const unsigned char* src, const int* src_off,
                                const int* dst_off, unsigned char* out, int src_bytes) {
  FT_DYNAMIC_SMEM(unsigned char, smem);
  int t = threadIdx.x;
  ft::cp_async<16>(smem + dst_off[t], src + src_off[t], src_bytes);
  ft::cp_async_wait_all();
  __syncthreads();
  for (int i = 0; i < 16; ++i) out[t * 16 + i] = smem[dst_off[t] + i];
}

// Shared memory holds halves 0, 1, 2, ...; lane l passes row address smem + row_off[l] to an
// ldmatrix x4 and writes its registers to out[l][0..3].
extern "C" __global__ void ldm(const int* row_off, unsigned* out) {
  FT_DYNAMIC_SMEM(unsigned char, smem);
  unsigned short* s = reinterpret_cast<unsigned short*>(smem);
  for (int i = threadIdx.x; i < SMEM / 2; i += 32) s[i] = static_cast<unsigned short>(i);
  __syncthreads();
  unsigned r[4];
  ft::ldmatrix_x4(r, smem + row_off[threadIdx.x]);
  for (int j = 0; j < 4; ++j) out[threadIdx.x * 4 + j] = r[j];
}

// Block b: every warp issues b + 1 mma and one shuffle; two barriers per block.
extern "C" __global__ void work(float* out) {
  unsigned a[4] = {0u, 0u, 0u, 0u};
  unsigned b[2] = {0u, 0u};
  float c[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  float d[4];
  for (unsigned i = 0; i <= blockIdx.x; ++i) ft::mma_m16n8k16_f16(d, a, b, c);
  float v = ft::shfl_xor(static_cast<float>(threadIdx.x), 1);
  __syncthreads();
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = d[0] + v;
}
"""


@pytest.fixture(scope="module")
def module() -> EmulatedModule:
    return build_module(SOURCE, ["copy", "ldm", "work"], defines=[f"SMEM={SMEM}"])


def wavefronts(word_addrs: list[int]) -> int:
    """Model: a phase takes max over the 32 banks of the distinct words in that bank."""
    per_bank: dict[int, set[int]] = {}
    for w in word_addrs:
        per_bank.setdefault(w % 32, set()).add(w)
    return max((len(v) for v in per_bank.values()), default=0)


def expected_copy(src_off: np.ndarray, dst_off: np.ndarray, src_bytes: int,
                  base: int) -> dict[str, int]:
    """Per-warp requests of 16-byte copies: sectors, and shared phases of 8 lanes."""
    out = {"requests": 0, "bytes": 0, "sectors": 0, "min_sectors": 0, "phases": 0,
           "waves": 0}
    for w in range(len(src_off) // 32):
        lanes = range(32 * w, 32 * w + 32)
        sectors = {(base + int(src_off[t]) + b) // 32 for t in lanes for b in range(src_bytes)}
        out["requests"] += 1
        out["bytes"] += 32 * src_bytes
        out["sectors"] += len(sectors)
        out["min_sectors"] += math.ceil(32 * src_bytes / 32)
        for p in range(4):
            words = [int(dst_off[t]) // 4 + k for t in lanes[8 * p: 8 * p + 8] for k in range(4)]
            out["phases"] += 1
            out["waves"] += wavefronts(words)
    return out


def run_copy(module: EmulatedModule, src_off: np.ndarray, dst_off: np.ndarray,
             src_bytes: int) -> EmulatorCounters:
    rng = np.random.default_rng()
    raw = rng.integers(0, 256, 8192 + 128, dtype=np.uint8)
    skip = -raw.__array_interface__["data"][0] % 128
    src = raw[skip: skip + 8192]  # 128-byte aligned, as cudaMalloc'd buffers are
    results = []
    counters = None
    for options in (LaunchOptions(), ON):
        out = np.full(16 * len(src_off), 0xEE, np.uint8)
        args = [ptr(src), ptr(src_off), ptr(dst_off), ptr(out), i32(src_bytes)]
        counters = module["copy"].launch(1, len(src_off), args, smem_bytes=SMEM,
                                         options=options)
        results.append(out)
    expect = np.zeros((len(src_off), 16), np.uint8)
    for t, off in enumerate(src_off):
        expect[t, :src_bytes] = src[off: off + src_bytes]
    np.testing.assert_array_equal(results[0].reshape(-1, 16), expect)
    np.testing.assert_array_equal(results[1], results[0])  # counting changes nothing
    assert counters is not None
    exp = expected_copy(src_off, dst_off, src_bytes, src.__array_interface__["data"][0])
    assert counters.cp_async_copies == len(src_off)
    assert counters.cp_async_requests == exp["requests"]
    assert counters.cp_async_bytes == exp["bytes"]
    assert counters.cp_async_fill_bytes == len(src_off) * (16 - src_bytes)
    assert counters.cp_async_sectors == exp["sectors"]
    assert counters.cp_async_min_sectors == exp["min_sectors"]
    assert counters.cp_async_smem_phases == exp["phases"]
    assert counters.cp_async_smem_wavefronts == exp["waves"]
    assert counters.barrier_count == 1 and counters.mma_count == 0
    (site,) = counters.sites
    assert site.kind == "cp_async" and site.requests == exp["requests"]
    return counters


@pytest.mark.parametrize("src_stride", [16, 32, 48, 64, 128])
def test_cp_async_sectors_per_warp_request(module: EmulatedModule, src_stride: int) -> None:
    """Two warps; lane t reads 16 bytes at t * stride of a 128-byte aligned buffer."""
    src_off = (np.arange(64) * src_stride % 4096).astype(np.int32)
    dst_off = (np.arange(64) * 16).astype(np.int32)
    counters = run_copy(module, src_off, dst_off, 16)
    per_request = counters.cp_async_sectors / counters.cp_async_requests
    if src_stride == 16:
        assert per_request == 16 and counters.coalescing_efficiency == 1.0  # 512 B / 32 B
    if src_stride >= 32:
        assert per_request == 32  # every lane in its own sector
    assert counters.cp_async_smem_conflicts == 0  # contiguous 16-byte destinations


@pytest.mark.parametrize("dst_stride", [32, 128, 144])
def test_cp_async_shared_write_conflicts(module: EmulatedModule, dst_stride: int) -> None:
    src_off = (np.arange(32) * 16).astype(np.int32)
    dst_off = (np.arange(32) * dst_stride % SMEM // 16 * 16).astype(np.int32)
    counters = run_copy(module, src_off, dst_off, 16)
    # 8 lanes of 16 bytes per phase: stride 32 is 2-way, 128 is 8-way, 144 conflict-free.
    assert counters.cp_async_smem_wavefronts // 4 == {32: 2, 128: 8, 144: 1}[dst_stride]


def test_cp_async_zero_fill_reads_no_global_memory(module: EmulatedModule) -> None:
    off = (np.arange(32) * 16).astype(np.int32)
    counters = run_copy(module, off, off, 0)
    assert counters.cp_async_bytes == 0 and counters.cp_async_sectors == 0


@pytest.mark.parametrize(("row_stride", "ways"), [(16, 1), (144, 1), (128, 8), (64, 4)])
def test_ldmatrix_bank_conflicts(module: EmulatedModule, row_stride: int, ways: int) -> None:
    rows = (np.arange(32) * row_stride % SMEM).astype(np.int32)
    outs = []
    counters = None
    for options in (LaunchOptions(), ON):
        out = np.full((32, 4), 0xDEADBEEF, np.uint32)
        counters = module["ldm"].launch(1, 32, [ptr(rows), ptr(out)], smem_bytes=SMEM,
                                        options=options)
        outs.append(out)
    halves = np.arange(SMEM // 2, dtype=np.uint16)
    mats = np.stack([halves[rows[8 * j: 8 * j + 8, None] // 2 + np.arange(8)]
                     for j in range(4)])
    np.testing.assert_array_equal(outs[0], ldmatrix_expected(mats, trans=False))
    np.testing.assert_array_equal(outs[1], outs[0])
    assert counters is not None
    model = sum(wavefronts([int(r) // 4 + k for r in rows[8 * j: 8 * j + 8] for k in range(4)])
                for j in range(4))
    assert counters.ldmatrix_count == 1 and counters.ldmatrix_phases == 4
    assert counters.ldmatrix_wavefronts == model == 4 * ways
    assert counters.ldmatrix_conflicts == 4 * (ways - 1)
    assert len(counters.conflicting_sites()) == (ways > 1)


def test_mma_shuffle_barrier_and_per_block_counts(module: EmulatedModule) -> None:
    grid, threads = 3, 64
    outs = []
    counters = None
    for options in (LaunchOptions(), ON):
        out = np.full(grid * threads, np.nan, np.float32)
        counters = module["work"].launch(grid, threads, [ptr(out)], options=options)
        outs.append(out)
    lanes = np.arange(grid * threads) % threads
    np.testing.assert_array_equal(outs[0], 1.0 + (lanes ^ 1))
    np.testing.assert_array_equal(outs[1], outs[0])
    assert counters is not None
    assert counters.block_mma == (2, 4, 6)  # 2 warps x (b + 1)
    assert counters.mma_count == 12
    assert counters.shfl_count == grid * 2
    assert counters.barrier_count == grid * 2
    assert counters.cp_async_requests == 0 and counters.ldmatrix_count == 0


@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward_default_configs(head_dim: int) -> None:
    """B=1, H=2, N=256 non-causal: cp.async reads Q once and K, V once per query block."""
    problem = Problem(head_dim, DType.FP16)
    config = default_config(problem, "sm_90")
    source = render(problem, config)
    kernel = EmulatorBackend(options=ON).load(source)
    b, h, n = 1, 2, 256
    q, k, v = (torch.randn(b, n, h, head_dim).half() for _ in range(3))
    o = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, n), float("nan"))
    scale = head_dim ** -0.5
    args = pack_args(q, k, v, o, lse, scale)
    launch_grid = grid(n, h, b, source.config.block_m)
    kernel.launch(launch_grid, args)
    ref_o, ref_lse = attention_reference(q.float().numpy(), k.float().numpy(),
                                         v.float().numpy(), False, scale)
    np.testing.assert_allclose(o.float().numpy(), ref_o, rtol=0,
                               atol=2e-3 * float(v.abs().max()))
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=0, atol=1e-4)
    c = kernel.last_counters
    assert c is not None
    row = head_dim * 2
    query_blocks = math.ceil(n / config.block_m)
    minimum = b * h * (n * row + 2 * query_blocks * n * row)
    assert minimum <= c.cp_async_bytes <= 1.03 * minimum, (c.cp_async_bytes, minimum)
    assert c.coalescing_efficiency == 1.0
    assert c.ldmatrix_conflicts == 0, c.conflicting_sites()
    assert c.cp_async_smem_conflicts == 0, c.conflicting_sites()
    tiles = math.ceil(n / config.block_n)
    # QK^T and PV: (block_m / 16) x (block_n / 8) x (d / 16) + (block_m / 16) x (d / 8) x
    # (block_n / 16) mma per tile, per block.
    per_tile = (config.block_m // 16) * (config.block_n // 8) * (head_dim // 16) * 2
    assert c.block_mma == (per_tile * tiles,) * (b * h * query_blocks)
    print(f"\nd{head_dim} {config.key()}: {c.to_dict()}")
