// The m16n8k16 tensor-core mma and the round-to-nearest 16-bit packing of one element type,
// shared by the kernels that are templated on it (forward, backward, decoding).
#pragma once

#include "primitives.cuh"

namespace ft {

template <typename T>
struct TensorOps;

template <>
struct TensorOps<__half> {
  static __device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[2], const float (&c)[4]) {
    mma_m16n8k16_f16(d, a, b, c);
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    return pack_half2(lo, hi);
  }
};

template <>
struct TensorOps<__nv_bfloat16> {
  static __device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[2], const float (&c)[4]) {
    mma_m16n8k16_bf16(d, a, b, c);
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    return pack_bf162(lo, hi);
  }
};

}  // namespace ft
