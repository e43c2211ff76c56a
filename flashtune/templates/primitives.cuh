// Warp-level primitives of flashtune kernels: mma, ldmatrix, cp.async, shuffles, votes,
// barriers, and the global fp32 reduction.
//
// Kernels call only these functions (namespace ft) and never inline asm, so the CPU
// emulator can run the same source: under FLASHTUNE_EMULATOR the C++ implementation from the
// emulator's include directory replaces this file's GPU half, signature for signature.
// Semantics: reference/ptx-warp-semantics.md (fragment layouts, cp.async group rules).
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#if defined(FLASHTUNE_EMULATOR)
#include "flashtune_emu/primitives.h"
#else

// Dynamic shared memory of the block; the only way kernels obtain shared memory.
#define FT_DYNAMIC_SMEM(type, name) extern __shared__ __align__(128) type name[]

// NVRTC has no <math.h>; kernels use INFINITY as on the host.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace ft {

// ---- tensor cores: D = A * B + C, m16n8k16, row.col, f32 accumulate -------------------

__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const unsigned (&a)[4],
                                                 const unsigned (&b)[2], const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4],
                                                  const unsigned (&b)[2], const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// m16n8k32 with e4m3 or e5m2 A and B (sm_89 and later): each A/B register holds four
// 8-bit values, A register r of a lane row g (+ 8 for odd r), columns 4 t + 16 (r / 2) +
// byte; B register r rows 4 t + 16 r + byte of column g (byte 0 lowest). The ldmatrix
// recipes of the 16-bit operands load exactly these fragments from rows of bytes.
#define FT_MMA_M16N8K32_FP8(name, type)                                                   \
  __device__ __forceinline__ void name(float (&d)[4], const unsigned (&a)[4],             \
                                       const unsigned (&b)[2], const float (&c)[4]) {     \
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32." type "." type ".f32 "             \
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n" \
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                         \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),       \
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));                           \
  }
FT_MMA_M16N8K32_FP8(mma_m16n8k32_e4m3, "e4m3")
FT_MMA_M16N8K32_FP8(mma_m16n8k32_e5m2, "e5m2")
#undef FT_MMA_M16N8K32_FP8

// ---- ldmatrix: 8x8 b16 matrices from shared memory, one row address per lane -------------
// The asm is volatile so that a load is never merged with one from the same address in an
// earlier pipeline stage (the buffer holds different data by then).

namespace detail {
// 32-bit shared-state address of a generic pointer into shared memory.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
}  // namespace detail

__device__ __forceinline__ void ldmatrix_x1(unsigned (&r)[1], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
               : "=r"(r[0])
               : "r"(detail::smem_u32(smem_row)));
}

__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(detail::smem_u32(smem_row)));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(detail::smem_u32(smem_row)));
}

__device__ __forceinline__ void ldmatrix_x1_trans(unsigned (&r)[1], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
               : "=r"(r[0])
               : "r"(detail::smem_u32(smem_row)));
}

__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(detail::smem_u32(smem_row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(detail::smem_u32(smem_row)));
}

// ---- cp.async: global -> shared, zero-filling past src_bytes ----------------------------

template <int BYTES>
__device__ __forceinline__ void cp_async(void* smem_dst, const void* gmem_src, int src_bytes) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :
                 : "r"(detail::smem_u32(smem_dst)), "l"(gmem_src), "r"(src_bytes)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n"
                 :
                 : "r"(detail::smem_u32(smem_dst)), "l"(gmem_src), "n"(BYTES), "r"(src_bytes)
                 : "memory");
  }
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Every committed group except the newest N is complete (for this thread).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// ---- shuffles --------------------------------------------------------------------------

__device__ __forceinline__ float shfl_xor_sync(unsigned mask, float v, int lane_mask,
                                               int width = 32) {
  return __shfl_xor_sync(mask, v, lane_mask, width);
}

__device__ __forceinline__ float shfl_xor(float v, int lane_mask, int width = 32) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask, width);
}

__device__ __forceinline__ float shfl_sync(unsigned mask, float v, int src_lane,
                                           int width = 32) {
  return __shfl_sync(mask, v, src_lane, width);
}

// ---- global-memory reduction -----------------------------------------------------------

// *gmem += v as one atomic fp32 reduction (red.global.add.f32: no value returned). Rounds to
// nearest even; subnormal inputs and results are flushed to zero of the same sign (what the
// PTX ISA states for atom/red .add.f32 on global memory). The order in which concurrent
// reductions land is unspecified, so sums of more than two terms are not reproducible.
__device__ __forceinline__ void atomic_add_f32(float* gmem, float v) {
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(gmem), "f"(v) : "memory");
}

// ---- warp votes -------------------------------------------------------------------------

// True on every lane when the predicate is true on at least one lane of the warp. All 32
// lanes must execute it (vote.sync.any.pred with a full mask).
__device__ __forceinline__ bool vote_any(bool p) { return __any_sync(0xffffffffu, p) != 0; }

// ---- register hints -------------------------------------------------------------------

// x, as a value the compiler cannot recompute: under register pressure it keeps it in a
// register instead of re-deriving it from the thread index inside a hot loop.
__device__ __forceinline__ int keep_in_register(int x) {
  int y;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// ---- barriers and ids ------------------------------------------------------------------

__device__ __forceinline__ void block_sync() { __syncthreads(); }
__device__ __forceinline__ void warp_sync() { __syncwarp(); }
__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x & 31u); }
__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x >> 5); }

// ---- stopping the kernel ---------------------------------------------------------------

// Stop the whole kernel with an error that the host sees at its next synchronisation (the
// CUDA context is unusable afterwards): for inputs that must never be followed.
__device__ __forceinline__ void trap() { __trap(); }

// ---- conversions -----------------------------------------------------------------------

// Two floats -> one register of two 16-bit values, round to nearest even; lo = first arg.
__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

__device__ __forceinline__ unsigned pack_bf162(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

// 2^x through the SFU (ex2.approx: relative error ~2^-22, exp2(-inf) = +0).
__device__ __forceinline__ float exp2f_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace ft

#endif  // FLASHTUNE_EMULATOR
