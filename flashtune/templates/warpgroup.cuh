// Warpgroup primitives of flashtune kernels (sm_90a): setmaxnreg, the register split between
// the producer and the consumer warpgroups of a warp-specialised kernel, and named barriers,
// the ping-pong schedule of the consumers (the Hopper notes, sections 1.1 and 1.4). Under
// FLASHTUNE_EMULATOR the emulator's implementation (flashtune_emu/warpgroup.h) replaces the
// GPU half and checks the rules.
//
// Contract: setmaxnreg_inc<N>() / setmaxnreg_dec<N>() with N a multiple of 8 in 24..256,
// executed by every thread of a warpgroup (4 consecutive warps, .sync.aligned); the kernel
// needs a register limit (__launch_bounds__) for it to take effect; the new registers of an
// .inc are undefined. named_barrier_sync(id, count) arrives on named barrier id (1..15; 0 is
// __syncthreads') and waits until `count` threads (a multiple of 32) have arrived in this
// phase; named_barrier_arrive(id, count) arrives without waiting; whole warps take part.
#pragma once

#include "primitives.cuh"

#if defined(FLASHTUNE_EMULATOR)
#include "flashtune_emu/warpgroup.h"
#else

namespace ft {

template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg: a multiple of 8 in 24..256");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg: a multiple of 8 in 24..256");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

__device__ __forceinline__ void named_barrier_sync(unsigned id, unsigned count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(unsigned id, unsigned count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

}  // namespace ft

#endif  // FLASHTUNE_EMULATOR
