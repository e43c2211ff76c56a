"""SASS statistics of NVRTC-compiled kernels: micro-kernels with known instruction
patterns, and the real forward kernel against the algorithm's per-tile counts."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.families import render
from flashtune.families.registers import mma_head_dim
from flashtune.perf.model.algorithm import analytic_tile_mix
from flashtune.perf.sass.loops import main_loop, main_loops
from flashtune.perf.sass.parse import SassListing

CompileSass = Callable[..., SassListing]

ARCHS = ("sm_80", "sm_90")

LOADS = r"""
extern "C" __global__ void load128(const float4* __restrict__ a, float4* __restrict__ b) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  b[i] = a[i];
}
extern "C" __global__ void load32(const float* __restrict__ a, float* __restrict__ b) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  b[i] = a[i];
}
"""

# Dynamic writes into a per-thread array cannot be turned into register selects: the
# array lives in local memory.
LOCAL = r"""
extern "C" __global__ void local_array(const int* __restrict__ idx, const float* __restrict__ in,
                                       float* __restrict__ out, int n) {
  float buf[64];
#pragma unroll
  for (int j = 0; j < 64; ++j) buf[j] = in[threadIdx.x + j * 32];
  for (int j = 0; j < n; ++j) buf[idx[j] & 63] += 1.0f;
  out[threadIdx.x] = buf[idx[threadIdx.x] & 63];
}
"""

# A runtime loop around one bf16 mma.sync, an exp2 and a barrier; ldmatrix and cp.async
# once outside it.
TENSOR = r"""
#include <cuda_bf16.h>
extern "C" __global__ void tensor_loop(const unsigned* __restrict__ a, float* __restrict__ c,
                                       int n) {
  __shared__ __align__(16) unsigned short tile[16 * 16];
  const unsigned addr = static_cast<unsigned>(
      __cvta_generic_to_shared(tile + (threadIdx.x % 16) * 16));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(addr),
               "l"(a + threadIdx.x * 4));
  asm volatile("cp.async.wait_all;");
  __syncthreads();
  unsigned f0, f1, f2, f3;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(f0), "=r"(f1), "=r"(f2), "=r"(f3) : "r"(addr));
  float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
  for (int it = 0; it < n; ++it) {
    const unsigned r = a[it * 32 + threadIdx.x];
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(f0 ^ r), "r"(f1), "r"(f2), "r"(f3), "r"(r), "r"(f0));
    d[0] = exp2f(d[0]);
    __syncthreads();
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) c[threadIdx.x * 4 + j] = d[j];
}
"""


@pytest.mark.parametrize("arch", ARCHS)
def test_load_width_is_seen(compile_sass: CompileSass, arch: str) -> None:
    listing = compile_sass(LOADS, arch)
    wide = listing.function("load128").mix()
    narrow = listing.function("load32").mix()
    assert dict(wide.load_widths) == {128: 1} and dict(wide.store_widths) == {128: 1}
    assert dict(narrow.load_widths) == {32: 1} and dict(narrow.store_widths) == {32: 1}
    assert wide.wide_load_share == 1.0 and narrow.wide_load_share == 0.0
    assert wide.local_memory == 0 and narrow.local_memory == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_indexed_local_array_shows_as_local_memory(compile_sass: CompileSass,
                                                   arch: str) -> None:
    mix = compile_sass(LOCAL, arch).function().mix()
    assert mix["stl"] > 0 and mix["ldl"] > 0
    assert mix["mma"] == 0 and mix["bar"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_core_loop(compile_sass: CompileSass, arch: str) -> None:
    listing = compile_sass(TENSOR, arch)
    assert listing.arch == arch
    fn = listing.function("tensor_loop")
    whole = fn.mix()
    assert whole.by_opcode.get("HMMA.16816.F32.BF16") == 1
    assert whole["ldsm"] == 1 and whole.by_opcode.get("LDSM.16.M88.4") == 1
    assert whole["ldgsts"] == 1 and any(op.startswith("LDGSTS") and op.endswith(".128")
                                        for op in whole.by_opcode)
    hot = main_loop(fn)
    assert hot is not None
    body = fn.mix(hot)
    # One iteration per pass (unroll 1): the MMA, the exp2 and the barrier are inside.
    assert body["mma"] == 1 and body["mufu"] >= 1 and body["bar"] == 1
    assert "MUFU.EX2" in body.by_opcode
    assert body["ldsm"] == 0 and body["ldgsts"] == 0  # both are before the loop


def _forward_sass(compile_sass: CompileSass, problem: Problem, config: KernelConfig,
                  arch: str) -> SassListing:
    source = render(problem, config)
    # flashtune's own headers go to NVRTC in memory, as the compiler passes them.
    return compile_sass(source.code, arch, source.headers, source.options)


def _copies_per_thread(rows: int, chunks: int, threads: int) -> int:
    """cp.async instructions one thread issues for a tile, by the copy plan of tile_io.cuh
    (RowCopy): t threads share a row, t the power of two in [2, 4] that keeps every thread
    busy, capped by the largest power of two dividing the row's chunks."""
    pow2 = chunks & -chunks
    want = 1
    while want < max(2, math.ceil(threads / rows)):
        want *= 2
    t = min(4, pow2, want)
    return math.ceil(rows / (threads // t)) * (chunks // t)


@pytest.mark.parametrize(("problem", "config", "arch"), [
    (Problem(64, DType.FP16, False), KernelConfig(128, 128, 4, 2), "sm_80"),
    (Problem(128, DType.BF16, True), KernelConfig(64, 64, 4, 3), "sm_90"),
    (Problem(96, DType.FP16, False), KernelConfig(128, 32, 8, 2), "sm_80"),
])
def test_forward_kernel_main_loop_matches_the_algorithm(
        compile_sass: CompileSass, problem: Problem, config: KernelConfig, arch: str) -> None:
    fn = _forward_sass(compile_sass, problem, config, arch).function()
    loops = main_loops(fn)
    assert loops.unmasked is not None
    # Steps that cross the causal diagonal are unrolled for these tiles: no masked loop.
    assert loops.masked is None
    body = loops.unmasked.mix
    expected = analytic_tile_mix(problem, config)
    d = mma_head_dim(problem)
    slabs = config.rows_per_warp // 16
    # One iteration holds Q K^T and P V for one K/V tile; the steps outside the loop (the
    # peeled first one, unrolled masked ones) hold whole tiles too.
    mmas = slabs * config.block_n * d // 64
    assert body["mma"] == mmas and fn.mix()["mma"] % mmas == 0
    assert body.mma_flops == expected.mma_flops
    want_hmma = "HMMA.16816.F32" + (".BF16" if problem.dtype is DType.BF16 else "")
    assert body.by_opcode.get(want_hmma) == mmas
    # One exp2 per score plus one rescale per row a thread holds.
    assert body.by_opcode.get("MUFU.EX2") == expected.mufu
    assert body["ldsm"] * 512 == body.ldsm_bytes == expected.ldsm_bytes
    # K and V tiles of block_n rows x d/8 16-byte chunks, by the copy plan.
    assert body["ldgsts"] == 2 * _copies_per_thread(config.block_n, problem.head_dim // 8,
                                                    config.threads)
    # One barrier per tile with two or more stages, two with one.
    assert body["bar"] == (1 if config.num_stages >= 2 else 2)
    # No mask and no guard in the unmasked loop: nothing selects -inf.
    assert not any("INF" in i.operands for i in fn.instructions
                   if loops.unmasked.loop.start <= i.offset <= loops.unmasked.loop.end)
    # cp.async moves 16 bytes per instruction; the epilogue's global stores are 128-bit.
    assert all(op.endswith(".128") for op in body.by_opcode if op.startswith("LDGSTS"))
    assert fn.mix().store_widths.get(128, 0) > 0
