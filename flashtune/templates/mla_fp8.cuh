// MLA decoding over an FP8 latent cache in FlashMLA's format, the on-chip half: the raw
// 656-byte rows travel to shared memory by cp.async (one read of each cache byte), and each
// tile is dequantised from there into the 16-bit latent tile the 16-bit kernel reads
// (mla_decode.cuh), so scores and P V run unchanged.
//
// Row format (per token, 656 bytes, 16-byte aligned in the cache):
//   bytes [0, 512)   512 e4m3 values: the latent's first 512 dims (also V);
//   bytes [512, 528) 4 float32 scales, scale g for values [128 g, 128 g + 128);
//   bytes [528, 656) 64 bf16 values: the RoPE dims, stored as they are.
// Latent value d is e4m3(byte d) x scale[d / 128]: the e4m3 value is decoded exactly into a
// float, multiplied by the float32 scale in float32 (round to nearest even: exact when the
// scale is a power of two and the product a normal float), then rounded to bf16 (round to
// nearest even: exact for a power-of-two scale, since e4m3 has 3 mantissa bits and bf16 7).
// The RoPE bf16 values are copied bit for bit, so the 16-bit element type must be bf16.
//
// The e4m3 decoder is integer and float arithmetic, not the cvt of fp8.cuh: sm_80 has no
// FP8 conversion instruction, and one tile's dequantisation serves every query head of the
// block, so its cost is spread over all of them.
#pragma once

#include "tensor_ops.cuh"

namespace ft {

// The byte layout of one FP8 latent row (above).
struct MlaFp8Row {
  static constexpr int kBytes = 656;
  static constexpr int kNope = 512;          // e4m3 values (bytes)
  static constexpr int kGroup = 128;         // values per scale
  static constexpr int kScaleOffset = 512;   // bytes
  static constexpr int kRopeOffset = 528;    // bytes
  static constexpr int kChunks = kBytes / 16;          // 16-byte cp.async chunks: 41
  static constexpr int kNopeChunks = kNope / 16;       // 32 chunks of 16 e4m3 values
  static constexpr int kRopeChunks = (kBytes - kRopeOffset) / 16;  // 8 chunks of 8 bf16
  static_assert(kBytes % 16 == 0 && kRopeOffset % 16 == 0, "rows are whole 16-byte chunks");
};

// The e4m3 value of the low 8 bits of `b`, exactly: (8 + m) x 2^(e - 10) for exponent field
// e >= 1, m x 2^-9 for e = 0 (subnormals), NaN for S.1111.111 (e4m3 has no infinities). The
// significand is an integer below 16 and the power of two a normal float, so the product
// is exact.
__device__ __forceinline__ float e4m3_bits_to_float(unsigned b) {
  const unsigned e = (b >> 3) & 0xfu;
  const unsigned m = b & 0x7u;
  const float pow2 = __uint_as_float(((e != 0u ? e : 1u) + 117u) << 23);
  const float mag = static_cast<float>(e != 0u ? (m | 0x8u) : m) * pow2;
  if (e == 0xfu && m == 0x7u) return __int_as_float(0x7fc00000);
  return (b & 0x80u) != 0u ? -mag : mag;
}

// Issue (without committing) the cp.async copies of the raw FP8 rows of keys [key0, key0 +
// BlockN) of a sequence into `raw` (BlockN rows of MlaFp8Row::kBytes); keys at or past
// key_end read nothing and are zero-filled (value 0 x scale 0 = 0). Strides are in bytes.
template <class Tr>
__device__ __forceinline__ void mla_load_fp8_rows(unsigned char* raw,
                                                  const unsigned char* cache,
                                                  const int* pages, int own_page,
                                                  long long page_stride, long long row_stride,
                                                  int page_size, int key0, int key_end,
                                                  int tid) {
  constexpr int kChunks = MlaFp8Row::kChunks;
  for (int idx = tid; idx < Tr::kBlockN * kChunks; idx += Tr::kThreads) {
    const int r = idx / kChunks;
    const int c = idx - r * kChunks;
    const int j = key0 + r;
    const unsigned char* src = cache;
    if (j < key_end) {
      const int slot = j / page_size;
      const int page = pages != nullptr ? pages[slot] : own_page;
      src = cache + page * page_stride + static_cast<long long>(j - slot * page_size) * row_stride +
            c * 16;
    }
    cp_async<16>(raw + r * MlaFp8Row::kBytes + c * 16, src, j < key_end ? 16 : 0);
  }
}

// Dequantise the BlockN raw rows of `raw` into the 16-bit latent tile `tile` (rows of
// Tr::kRowStride elements): per row 32 chunks of 16 e4m3 values (each times its group's
// scale, rounded to Element) and 8 chunks of RoPE values copied as they are.
template <class Tr>
__device__ __forceinline__ void mla_dequantise_tile(typename Tr::Element* tile,
                                                    const unsigned char* raw, int tid) {
  using Ops = typename Tr::Ops;
  constexpr int kWork = MlaFp8Row::kNopeChunks + MlaFp8Row::kRopeChunks;
  // Not unrolled: O's accumulators hold most registers across this loop.
#pragma unroll 1
  for (int idx = tid; idx < Tr::kBlockN * kWork; idx += Tr::kThreads) {
    const int r = idx / kWork;
    const int c = idx - r * kWork;
    const unsigned char* row = raw + r * MlaFp8Row::kBytes;
    typename Tr::Element* dst = tile + r * Tr::kRowStride;
    if (c < MlaFp8Row::kNopeChunks) {
      const uint4 bytes = *reinterpret_cast<const uint4*>(row + 16 * c);
      const float scale = *reinterpret_cast<const float*>(
          row + MlaFp8Row::kScaleOffset + 4 * (16 * c / MlaFp8Row::kGroup));
      const unsigned words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
      unsigned out[8];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const unsigned pair = words[w] >> (16 * h);
          out[2 * w + h] = Ops::pack(e4m3_bits_to_float(pair & 0xffu) * scale,
                                     e4m3_bits_to_float((pair >> 8) & 0xffu) * scale);
        }
      }
      *reinterpret_cast<uint4*>(dst + 16 * c) = make_uint4(out[0], out[1], out[2], out[3]);
      *reinterpret_cast<uint4*>(dst + 16 * c + 8) = make_uint4(out[4], out[5], out[6], out[7]);
    } else {
      const int k = c - MlaFp8Row::kNopeChunks;
      *reinterpret_cast<uint4*>(dst + MlaFp8Row::kNope + 8 * k) =
          *reinterpret_cast<const uint4*>(row + MlaFp8Row::kRopeOffset + 16 * k);
    }
  }
}

}  // namespace ft
