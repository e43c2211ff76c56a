// Split-KV decoding over an e4m3 KV cache (decode_split.cuh with Tr::kFp8Cache): the traits
// switch and the conversions of one 16-byte chunk of a shared K/V tile (8 values).
//
// The cache holds e4m3 bytes; the real key is k_descale[b, h] * byte (FlashAttention-3's
// descale factors, float32 (batch, heads_kv)). Every e4m3 value is exactly an fp16 and a bf16
// value, so a cache row is dequantised *exactly* into the kernel's 16-bit shared tiles without
// its descale, and the unchanged 16-bit warp GEMMs read it: the K descale joins the softmax
// scale (fp32 scores s = q.k8 * (softmax_scale * k_descale)), the V descale multiplies O with
// the row's 1 / sum. A new row x (16-bit) is quantised with its (batch, head)'s descale as
// e4m3(x / descale) (fp32 division, cvt.rn.satfinite: round to nearest even, saturating to
// +-448; NaN stays NaN): the value appended to the cache and, dequantised, the one attended to,
// so a call attends to exactly the cache a later call reads.
#pragma once

#include "decode_traits.cuh"
#include "fp8.cuh"

namespace ft {

// The descale factors of an e4m3 cache: float32 (batch, heads_kv), contiguous.
struct CacheDescales {
  const float* k = nullptr;
  const float* v = nullptr;
};

// Decoding traits (Base: DecodeTraits of q's 16-bit type) over an e4m3 K/V cache. The shared
// tiles and the GEMMs are Base's; only the cache's element type differs.
template <class Base>
struct WithE4m3Cache : Base {
  using Cache = unsigned char;  // one e4m3 value
  static constexpr bool kFp8Cache = true;
  // A 16-byte shared chunk (8 values) is 8 bytes of a cache row.
  static constexpr int kCacheChunkBytes = Base::kChunkElems;
};

// 8 e4m3 values (two words, value 0 in the low byte of words.x) as the 16 bytes of 8 exact
// 16-bit values of Ops' type, in order.
template <class Ops>
__device__ __forceinline__ uint4 e4m3_chunk_to_16bit(uint2 bytes) {
  const unsigned words[2] = {bytes.x, bytes.y};
  unsigned out[4];
  dequantise_words<E4m3Format, Ops, 2>(words, out);
  uint4 chunk;
  chunk.x = out[0], chunk.y = out[1], chunk.z = out[2], chunk.w = out[3];
  return chunk;
}

// The two 16-bit values of a packed pair (lo: bits 0-15) as floats (exact).
template <class Element>
__device__ __forceinline__ void unpack_pair(unsigned pair, float& lo, float& hi);
template <>
__device__ __forceinline__ void unpack_pair<__half>(unsigned pair, float& lo, float& hi) {
  half2_bits_to_float2(pair, lo, hi);
}
template <>
__device__ __forceinline__ void unpack_pair<__nv_bfloat16>(unsigned pair, float& lo,
                                                           float& hi) {
  lo = __uint_as_float(pair << 16);  // a bf16 is the high half of a float
  hi = __uint_as_float(pair & 0xffff0000u);
}

// 8 values of the 16-bit Element quantised as e4m3(x / descale), in order (the appended
// rows).
template <class Element>
__device__ __forceinline__ uint2 quantise_chunk_e4m3(uint4 chunk, float descale) {
  const unsigned in[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
  unsigned half[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float lo, hi;
    unpack_pair<Element>(in[i], lo, hi);
    // A true division, as the reference quantiser (torch) divides: x * (1 / descale) may
    // round differently.
    half[i] = cvt_e4m3x2_f32(lo / descale, hi / descale);
  }
  uint2 bytes;
  bytes.x = half[0] | (half[1] << 16);
  bytes.y = half[2] | (half[3] << 16);
  return bytes;
}

}  // namespace ft
