// The emulator's implementation of the sm_90a primitives (flashtune/templates/wgmma.cuh):
// wgmma.mma_async (16-bit k16, 8-bit k32) with shared-memory matrix descriptors, its fence /
// commit / wait, and fence.proxy.async. Semantics and checks: src/wgmma.cpp.
#pragma once

#include "flashtune_emu/runtime.h"

namespace ft {

template <int N, bool BF16, bool TRANS_A, bool TRANS_B>
__device__ inline void wgmma_ss(float (&d)[N / 2], unsigned long long a_desc,
                                unsigned long long b_desc, int scale_d,
                                ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma m64nNk16: N in 8..256, step 8");
    ftemu_wgmma_args args{d, nullptr, a_desc, b_desc, scale_d};
    ftemu_wgmma(N << 8 | (BF16 ? FTEMU_WGMMA_BF16 : 0) | (TRANS_A ? FTEMU_WGMMA_TRANS_A : 0) |
                    (TRANS_B ? FTEMU_WGMMA_TRANS_B : 0),
                &args, ::ftemu::to_loc(l));
}

template <int N, bool BF16, bool TRANS_B>
__device__ inline void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4],
                                unsigned long long b_desc, int scale_d,
                                ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma m64nNk16: N in 8..256, step 8");
    ftemu_wgmma_args args{d, a, 0, b_desc, scale_d};
    ftemu_wgmma(N << 8 | FTEMU_WGMMA_RS | (BF16 ? FTEMU_WGMMA_BF16 : 0) |
                    (TRANS_B ? FTEMU_WGMMA_TRANS_B : 0),
                &args, ::ftemu::to_loc(l));
}

// m64nNk32 with 8-bit operands (E5M2: e5m2, else e4m3), both K-major.
template <int N, bool E5M2>
__device__ inline void wgmma_ss_fp8(float (&d)[N / 2], unsigned long long a_desc,
                                    unsigned long long b_desc, int scale_d,
                                    ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma m64nNk32: N in 8..256, step 8");
    ftemu_wgmma_args args{d, nullptr, a_desc, b_desc, scale_d};
    ftemu_wgmma(N << 8 | (E5M2 ? FTEMU_WGMMA_E5M2 : FTEMU_WGMMA_E4M3), &args,
                ::ftemu::to_loc(l));
}

template <int N, bool E5M2>
__device__ inline void wgmma_rs_fp8(float (&d)[N / 2], const unsigned (&a)[4],
                                    unsigned long long b_desc, int scale_d,
                                    ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma m64nNk32: N in 8..256, step 8");
    ftemu_wgmma_args args{d, a, 0, b_desc, scale_d};
    ftemu_wgmma(N << 8 | FTEMU_WGMMA_RS | (E5M2 ? FTEMU_WGMMA_E5M2 : FTEMU_WGMMA_E4M3), &args,
                ::ftemu::to_loc(l));
}

__device__ inline void wgmma_fence(::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    ftemu_wgmma_fence(::ftemu::to_loc(l));
}
__device__ inline void wgmma_commit(::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    ftemu_wgmma_commit(::ftemu::to_loc(l));
}
template <int N>
__device__ inline void wgmma_wait(::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    static_assert(N >= 0 && N <= 7, "wgmma.wait_group N: 0..7");
    ftemu_wgmma_wait(N, ::ftemu::to_loc(l));
}
// The accumulators as the compiler must see them after the wait that covers them: here the
// check that no wgmma still in flight writes any of them (the emulator's calls take the
// arrays by address, so there is nothing to tie).
template <int R>
__device__ inline void wgmma_fence_operands(float (&d)[R],
                                            ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    ftemu_wgmma_fence_operands(d, R, ::ftemu::to_loc(l));
}
__device__ inline void fence_proxy_async(::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    ftemu_fence_proxy_async(::ftemu::to_loc(l));
}
__device__ inline unsigned smem_address(const void* p,
                                        ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    return ftemu_cvta_shared(p, ::ftemu::to_loc(l));
}

}  // namespace ft
