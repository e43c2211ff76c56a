// The emulator's implementation of the warpgroup primitives (flashtune/templates/
// warpgroup.cuh). Semantics and checks: src/setmaxnreg.cpp, src/named_barrier.cpp.
#pragma once

#include "flashtune_emu/runtime.h"

namespace ft {

template <int N>
__device__ inline void setmaxnreg_inc(::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    ftemu_setmaxnreg(1, N, ::ftemu::to_loc(l));
}
template <int N>
__device__ inline void setmaxnreg_dec(::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    ftemu_setmaxnreg(0, N, ::ftemu::to_loc(l));
}

__device__ inline void named_barrier_sync(unsigned id, unsigned count,
                                          ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    ftemu_named_barrier(1, id, count, ::ftemu::to_loc(l));
}
__device__ inline void named_barrier_arrive(unsigned id, unsigned count,
                                            ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    ftemu_named_barrier(0, id, count, ::ftemu::to_loc(l));
}

}  // namespace ft
