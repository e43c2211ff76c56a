// FP8 (OCP e4m3 and e5m2) conversions of flashtune kernels, packed two per 16-bit word as
// the cvt instructions take them (sm_89 and later). Under FLASHTUNE_EMULATOR the emulator's
// implementation (flashtune_emu/fp8.h) replaces the GPU half, signature for signature, and
// reproduces every bit of each result.
//
// Contract (PTX ISA, cvt):
//   * cvt_e4m3x2_f32(lo, hi) / cvt_e5m2x2_f32(lo, hi): cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32:
//     round to nearest even; a magnitude above the largest finite value (448 for e4m3,
//     57344 for e5m2), infinities included, becomes that value with its sign (satfinite;
//     the instruction has no non-saturating form); NaN becomes the canonical NaN 0x7F;
//     denormal results are kept. `lo` lands in bits 0-7, `hi` in bits 8-15.
//   * cvt_e4m3x2_f16x2(h2) / cvt_e5m2x2_f16x2(h2): the same from a half2 (lo = bits 0-15).
//   * cvt_f16x2_e4m3x2(v) / cvt_f16x2_e5m2x2(v): cvt.rn.f16x2.{e4m3x2,e5m2x2}: exact (every
//     FP8 value is a half); an FP8 NaN becomes the half canonical NaN 0x7FFF; e5m2's
//     infinities stay infinities. Byte 0 of v lands in bits 0-15 of the result.
//   * e4m3x2_to_float2 / e5m2x2_to_float2: the two values as floats (exact).
#pragma once

#include "primitives.cuh"

#if defined(FLASHTUNE_EMULATOR)
#include "flashtune_emu/fp8.h"
#else

namespace ft {

__device__ __forceinline__ unsigned short cvt_e4m3x2_f32(float lo, float hi) {
  unsigned short d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}
__device__ __forceinline__ unsigned short cvt_e5m2x2_f32(float lo, float hi) {
  unsigned short d;
  asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;\n" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}
__device__ __forceinline__ unsigned short cvt_e4m3x2_f16x2(unsigned h2) {
  unsigned short d;
  asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;\n" : "=h"(d) : "r"(h2));
  return d;
}
__device__ __forceinline__ unsigned short cvt_e5m2x2_f16x2(unsigned h2) {
  unsigned short d;
  asm("cvt.rn.satfinite.e5m2x2.f16x2 %0, %1;\n" : "=h"(d) : "r"(h2));
  return d;
}
__device__ __forceinline__ unsigned cvt_f16x2_e4m3x2(unsigned short v) {
  unsigned d;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(d) : "h"(v));
  return d;
}
__device__ __forceinline__ unsigned cvt_f16x2_e5m2x2(unsigned short v) {
  unsigned d;
  asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(d) : "h"(v));
  return d;
}

}  // namespace ft

#endif  // FLASHTUNE_EMULATOR

namespace ft {

// Both halves of a half2 bit pattern as floats (exact).
__device__ __forceinline__ void half2_bits_to_float2(unsigned h2, float& lo, float& hi) {
  __half_raw l, h;
  l.x = static_cast<unsigned short>(h2 & 0xffffu);
  h.x = static_cast<unsigned short>(h2 >> 16);
  lo = __half2float(__half(l));
  hi = __half2float(__half(h));
}
__device__ __forceinline__ void e4m3x2_to_float2(unsigned short v, float& lo, float& hi) {
  half2_bits_to_float2(cvt_f16x2_e4m3x2(v), lo, hi);
}
__device__ __forceinline__ void e5m2x2_to_float2(unsigned short v, float& lo, float& hi) {
  half2_bits_to_float2(cvt_f16x2_e5m2x2(v), lo, hi);
}

// The two OCP FP8 formats, each as an mma of two FP8 operands (m16n8k32: an A/B register
// holds four values) and the exact conversion of two values to floats.
struct E4m3Format {
  static __device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[2], const float (&c)[4]) {
    mma_m16n8k32_e4m3(d, a, b, c);
  }
  static __device__ __forceinline__ void to_float2(unsigned short v, float& lo, float& hi) {
    e4m3x2_to_float2(v, lo, hi);
  }
};
struct E5m2Format {
  static __device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[2], const float (&c)[4]) {
    mma_m16n8k32_e5m2(d, a, b, c);
  }
  static __device__ __forceinline__ void to_float2(unsigned short v, float& lo, float& hi) {
    e5m2x2_to_float2(v, lo, hi);
  }
};


// The 4 W FP8 values of `words` converted exactly (every e4m3 and e5m2 value is an fp16 and
// a bf16 value) and packed in pairs of the 16-bit type of Ops (TensorOps::pack), in order.
template <class Format, class Ops, int W>
__device__ __forceinline__ void dequantise_words(const unsigned (&words)[W],
                                                 unsigned (&out)[2 * W]) {
#pragma unroll
  for (int w = 0; w < W; ++w) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float lo, hi;
      Format::to_float2(static_cast<unsigned short>(words[w] >> (16 * h)), lo, hi);
      out[2 * w + h] = Ops::pack(lo, hi);
    }
  }
}

}  // namespace ft
