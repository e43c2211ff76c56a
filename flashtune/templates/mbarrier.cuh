// mbarrier primitives of flashtune kernels: an 8-byte barrier object in shared memory with
// phases, arrival counts and a transaction count (the Hopper notes, sections 2.1 and 6.3).
// init and arrive are sm_80 PTX; expect-tx, complete-tx and try_wait.parity need sm_90.
// Under FLASHTUNE_EMULATOR the emulator's implementation (flashtune_emu/mbarrier.h) replaces
// the GPU half, signature for signature.
//
// Contract:
//   * mbarrier_init(bar, count) by one thread, then mbarrier_init_fence() and a block barrier
//     before any other thread uses it;
//   * a phase completes when `count` arrivals were made and its transaction count is zero;
//     mbarrier_arrive_expect_tx(bar, bytes) adds bytes to it and arrives,
//     mbarrier_complete_tx(bar, bytes) takes bytes off (what a TMA copy does when it lands);
//   * cp_async_mbarrier_arrive(bar) (.noinc): one arrival, made when every cp.async this
//     thread issued before it has landed (the init count includes these arrivals);
//   * mbarrier_try_wait_parity(bar, parity) is true once the phase of that parity has
//     completed (phase 0 has parity 0); the current or the immediately preceding phase only;
//     it may return false before then, so mbarrier_wait_parity loops on it. A wait that
//     returns true makes the data released by the phase's arrivals (and its copies) visible.
#pragma once

#include "primitives.cuh"

#if defined(FLASHTUNE_EMULATOR)
#include "flashtune_emu/mbarrier.h"
#else

namespace ft {

__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(detail::smem_u32(bar)),
               "r"(count)
               : "memory");
}
// Makes initialised barriers visible to other threads and to the async proxy.
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned long long* bar,
                                                          unsigned bytes) {
  asm volatile(
      "{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(
          detail::smem_u32(bar)),
      "r"(bytes)
      : "memory");
}
// A plain arrival: expect-tx of zero bytes changes nothing.
__device__ __forceinline__ void mbarrier_arrive(unsigned long long* bar) {
  mbarrier_arrive_expect_tx(bar, 0);
}
__device__ __forceinline__ void mbarrier_complete_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.complete_tx.shared::cta.b64 [%0], %1;\n" ::"r"(detail::smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_mbarrier_arrive(unsigned long long* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(
                   detail::smem_u32(bar))
               : "memory");
}
__device__ __forceinline__ bool mbarrier_try_wait_parity(unsigned long long* bar,
                                                         unsigned parity) {
  unsigned done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(detail::smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void mbarrier_wait_parity(unsigned long long* bar, unsigned parity) {
  while (!mbarrier_try_wait_parity(bar, parity)) {
  }
}

}  // namespace ft

#endif  // FLASHTUNE_EMULATOR
