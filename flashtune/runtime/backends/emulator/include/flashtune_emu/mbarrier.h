// The emulator's implementation of the mbarrier primitives (flashtune/templates/mbarrier.cuh).
// Semantics and checks: src/mbarrier.cpp.
#pragma once

#include "flashtune_emu/runtime.h"

namespace ft {

__device__ inline void mbarrier_init(unsigned long long* bar, unsigned count,
                                     ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    ftemu_mbarrier_init(bar, count, ::ftemu::to_loc(l));
}
// The init is made visible by the __syncthreads that must follow it (checked there).
__device__ inline void mbarrier_init_fence() {}
__device__ inline void mbarrier_arrive(unsigned long long* bar,
                                       ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    ftemu_mbarrier_arrive(bar, 0, ::ftemu::to_loc(l));
}
__device__ inline void mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes,
                                                 ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    ftemu_mbarrier_arrive(bar, bytes, ::ftemu::to_loc(l));
}
__device__ inline void mbarrier_complete_tx(unsigned long long* bar, unsigned bytes,
                                            ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    ftemu_mbarrier_complete_tx(bar, bytes, ::ftemu::to_loc(l));
}
__device__ inline void cp_async_mbarrier_arrive(unsigned long long* bar,
                                                ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    ftemu_mbarrier_cp_async_arrive(bar, ::ftemu::to_loc(l));
}
__device__ inline bool mbarrier_try_wait_parity(unsigned long long* bar, unsigned parity,
                                                ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    return ftemu_mbarrier_try_wait_parity(bar, parity, ::ftemu::to_loc(l)) != 0;
}
__device__ inline void mbarrier_wait_parity(unsigned long long* bar, unsigned parity,
                                            ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    while (!mbarrier_try_wait_parity(bar, parity, l)) {
    }
}

}  // namespace ft
