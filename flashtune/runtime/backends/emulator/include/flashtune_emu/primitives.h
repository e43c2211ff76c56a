// The emulator's implementation of the flashtune primitives API (namespace ft), the contract
// declared by flashtune/templates/primitives.cuh. Each function has the signature of the
// contract plus a defaulted source location, so errors name the kernel line that called it.
#pragma once

#include "flashtune_emu/runtime.h"

namespace ft {

using loc_t = ::ftemu::loc_t;

// --- mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 ---
__device__ inline void mma_m16n8k16_f16(float (&d)[4], const unsigned (&a)[4],
                                        const unsigned (&b)[2], const float (&c)[4],
                                        loc_t l = loc_t::current()) {
    ftemu_mma_m16n8k16(FTEMU_MMA_F16, d, a, b, c, ::ftemu::to_loc(l));
}
__device__ inline void mma_m16n8k16_bf16(float (&d)[4], const unsigned (&a)[4],
                                         const unsigned (&b)[2], const float (&c)[4],
                                         loc_t l = loc_t::current()) {
    ftemu_mma_m16n8k16(FTEMU_MMA_BF16, d, a, b, c, ::ftemu::to_loc(l));
}

// --- mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 ---
__device__ inline void mma_m16n8k32_e4m3(float (&d)[4], const unsigned (&a)[4],
                                         const unsigned (&b)[2], const float (&c)[4],
                                         loc_t l = loc_t::current()) {
    ftemu_mma_m16n8k32(FTEMU_MMA_E4M3, d, a, b, c, ::ftemu::to_loc(l));
}

// --- mma.sync.aligned.m16n8k32.row.col.f32.e5m2.e5m2.f32 ---
__device__ inline void mma_m16n8k32_e5m2(float (&d)[4], const unsigned (&a)[4],
                                         const unsigned (&b)[2], const float (&c)[4],
                                         loc_t l = loc_t::current()) {
    ftemu_mma_m16n8k32(FTEMU_MMA_E5M2, d, a, b, c, ::ftemu::to_loc(l));
}

// --- ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16 ---
__device__ inline void ldmatrix_x1(unsigned (&r)[1], const void* p, loc_t l = loc_t::current()) {
    ftemu_ldmatrix(1, 0, r, p, ::ftemu::to_loc(l));
}
__device__ inline void ldmatrix_x2(unsigned (&r)[2], const void* p, loc_t l = loc_t::current()) {
    ftemu_ldmatrix(2, 0, r, p, ::ftemu::to_loc(l));
}
__device__ inline void ldmatrix_x4(unsigned (&r)[4], const void* p, loc_t l = loc_t::current()) {
    ftemu_ldmatrix(4, 0, r, p, ::ftemu::to_loc(l));
}
__device__ inline void ldmatrix_x1_trans(unsigned (&r)[1], const void* p,
                                         loc_t l = loc_t::current()) {
    ftemu_ldmatrix(1, 1, r, p, ::ftemu::to_loc(l));
}
__device__ inline void ldmatrix_x2_trans(unsigned (&r)[2], const void* p,
                                         loc_t l = loc_t::current()) {
    ftemu_ldmatrix(2, 1, r, p, ::ftemu::to_loc(l));
}
__device__ inline void ldmatrix_x4_trans(unsigned (&r)[4], const void* p,
                                         loc_t l = loc_t::current()) {
    ftemu_ldmatrix(4, 1, r, p, ::ftemu::to_loc(l));
}

// --- cp.async (global -> shared) and its groups ---
template <int BYTES>
__device__ inline void cp_async(void* smem_dst, const void* gmem_src, int src_bytes,
                                loc_t l = loc_t::current()) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
    ftemu_cp_async(smem_dst, gmem_src, BYTES, src_bytes, ::ftemu::to_loc(l));
}
__device__ inline void cp_async_commit(loc_t l = loc_t::current()) {
    ftemu_cp_async_commit(::ftemu::to_loc(l));
}
template <int N>
__device__ inline void cp_async_wait(loc_t l = loc_t::current()) {
    static_assert(N >= 0, "cp.async.wait_group N needs N >= 0");
    ftemu_cp_async_wait(N, ::ftemu::to_loc(l));
}
__device__ inline void cp_async_wait_all(loc_t l = loc_t::current()) {
    ftemu_cp_async_wait_all(::ftemu::to_loc(l));
}

// --- shuffles ---
__device__ inline float shfl_xor_sync(unsigned mask, float v, int lane_mask, int width = 32,
                                      loc_t l = loc_t::current()) {
    return ::ftemu::shfl(FTEMU_SHFL_XOR, mask, v, lane_mask, width, l);
}
__device__ inline float shfl_xor(float v, int lane_mask, int width = 32,
                                 loc_t l = loc_t::current()) {
    return ::ftemu::shfl(FTEMU_SHFL_XOR, 0xffffffffu, v, lane_mask, width, l);
}
__device__ inline float shfl_sync(unsigned mask, float v, int src_lane, int width = 32,
                                  loc_t l = loc_t::current()) {
    return ::ftemu::shfl(FTEMU_SHFL_IDX, mask, v, src_lane, width, l);
}

// --- red.global.add.f32: round to nearest even, subnormals flushed to signed zero ---
// One emulated thread runs at a time, so the read-modify-write is atomic; what differs
// between launches is only the order of the additions (see LaunchOptions.block_order_seed).
namespace detail {
inline float flush_subnormal(float x) {
    return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x;
}
}  // namespace detail
__device__ inline void atomic_add_f32(float* gmem, float v) {
    *gmem = detail::flush_subnormal(detail::flush_subnormal(*gmem) +
                                    detail::flush_subnormal(v));
}

// --- warp vote: true on every lane when p is true on at least one lane (full warp) ---
__device__ inline bool vote_any(bool p, loc_t l = loc_t::current()) {
    return ftemu_vote(FTEMU_VOTE_ANY, 0xffffffffu, p ? 1 : 0, ::ftemu::to_loc(l)) != 0u;
}

// --- register hint (a compiler hint on the GPU; the identity here) ---
__device__ inline int keep_in_register(int x) { return x; }

// --- barriers and ids ---
__device__ inline void block_sync(loc_t l = loc_t::current()) { __syncthreads(l); }
__device__ inline void warp_sync(loc_t l = loc_t::current()) { __syncwarp(0xffffffffu, l); }
__device__ inline int lane_id() { return static_cast<int>(threadIdx.x & 31u); }
__device__ inline int warp_id() { return static_cast<int>(threadIdx.x >> 5); }

// --- stopping the kernel: the launch ends with an error naming the caller ---
[[noreturn]] __device__ inline void trap(loc_t l = loc_t::current()) {
    ftemu_fail("trap: the kernel stopped itself (an input it must not follow)",
               ::ftemu::to_loc(l));
}

// --- packing two floats into 16-bit pairs (lo = first argument), round to nearest even ---
__device__ inline unsigned pack_half2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    unsigned u;
    std::memcpy(&u, &h, 4);
    return u;
}
__device__ inline unsigned pack_bf162(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    unsigned u;
    std::memcpy(&u, &h, 4);
    return u;
}

// --- fast exp2 (ex2.approx on the GPU) ---
__device__ inline float exp2f_fast(float x) { return std::exp2(x); }

}  // namespace ft

// Dynamic shared memory: the block's buffer, 128-byte aligned, poisoned at block start.
#ifndef FT_DYNAMIC_SMEM
#define FT_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(::ftemu_current->dyn_smem)
#endif
