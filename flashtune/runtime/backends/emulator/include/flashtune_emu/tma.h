// The emulator's implementation of the TMA primitives (flashtune/templates/tma.cuh): the
// tensor map is the emulator's record (abi.h ftemu_tensor_map). Semantics and checks:
// src/tma.cpp.
#pragma once

#include "flashtune_emu/runtime.h"

typedef ftemu_tensor_map CUtensorMap;

namespace ft {

__device__ inline void prefetch_tensormap(const CUtensorMap* map,
                                          ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    ftemu_prefetch_tensormap(map, ::ftemu::to_loc(l));
}

namespace detail {
template <int R>
inline void tma_load(void* dst, const CUtensorMap* map, unsigned long long* bar,
                     const int (&coords)[R], const ::ftemu::loc_t& l) {
    ftemu_tma_load(dst, map, R, coords, bar, ::ftemu::to_loc(l));
}
}  // namespace detail

__device__ inline void tma_load_2d(void* dst, const CUtensorMap* map, unsigned long long* bar,
                                   int c0, int c1, ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    detail::tma_load<2>(dst, map, bar, {c0, c1}, l);
}
__device__ inline void tma_load_3d(void* dst, const CUtensorMap* map, unsigned long long* bar,
                                   int c0, int c1, int c2,
                                   ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    detail::tma_load<3>(dst, map, bar, {c0, c1, c2}, l);
}
__device__ inline void tma_load_4d(void* dst, const CUtensorMap* map, unsigned long long* bar,
                                   int c0, int c1, int c2, int c3,
                                   ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    detail::tma_load<4>(dst, map, bar, {c0, c1, c2, c3}, l);
}
__device__ inline void tma_load_5d(void* dst, const CUtensorMap* map, unsigned long long* bar,
                                   int c0, int c1, int c2, int c3, int c4,
                                   ::ftemu::loc_t l = ::ftemu::loc_t::current()) {
    detail::tma_load<5>(dst, map, bar, {c0, c1, c2, c3, c4}, l);
}

}  // namespace ft
