// TMA primitives of flashtune kernels (sm_90): tile loads of a tensor described by a tensor
// map into shared memory, completing on an mbarrier (the Hopper notes, sections 2.1, 3 and
// 6.4). Under FLASHTUNE_EMULATOR the emulator's implementation (flashtune_emu/tma.h)
// replaces the GPU half, signature for signature, and CUtensorMap is its own 128-byte record.
//
// Contract:
//   * a tensor map is a 128-byte object encoded on the host (flashtune.runtime.tma: by the
//     driver's cuTensorMapEncodeTiled on a GPU) and passed as a `const __grid_constant__
//     CUtensorMap` kernel parameter; device code takes its address and never copies it;
//   * tma_load_<N>d(dst, map, bar, c0, .., cN-1) loads the box whose first element is at
//     coordinates (c0 innermost, ..) into shared memory at dst (128-byte aligned; swizzled as
//     the map says), filling out-of-bounds elements, and completes the box's bytes (the full
//     box, out-of-bounds elements included) as transactions on the mbarrier bar; the phase
//     that receives them must expect them (mbarrier_arrive_expect_tx);
//   * the data is visible to a thread after a wait on that phase returned true; the load is
//     in the async proxy, so wgmma may read it without a proxy fence.
#pragma once

#include "mbarrier.cuh"

#if defined(FLASHTUNE_EMULATOR)
#include "flashtune_emu/tma.h"
#else

#if !defined(__cuda_cuda_h__)
// cuda.h is not on NVRTC's include path: the driver's 128-byte opaque tensor map.
struct alignas(64) CUtensorMap_st {
  unsigned long long opaque[16];
};
typedef CUtensorMap_st CUtensorMap;
#endif

namespace ft {

__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map))
               : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map,
                                            unsigned long long* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(detail::smem_u32(dst)),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(detail::smem_u32(bar)), "r"(c0),
      "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map,
                                            unsigned long long* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(detail::smem_u32(dst)),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(detail::smem_u32(bar)), "r"(c0),
      "r"(c1), "r"(c2)
      : "memory");
}

__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map,
                                            unsigned long long* bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(detail::smem_u32(dst)),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(detail::smem_u32(bar)), "r"(c0),
      "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

__device__ __forceinline__ void tma_load_5d(void* dst, const CUtensorMap* map,
                                            unsigned long long* bar, int c0, int c1, int c2,
                                            int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n" ::"r"(detail::smem_u32(dst)),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(detail::smem_u32(bar)), "r"(c0),
      "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

}  // namespace ft

#endif  // FLASHTUNE_EMULATOR
