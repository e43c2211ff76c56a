// The on-chip steps of the FP8 forward on sm_90a wgmma (FA3's FP8 forward): P from the S
// accumulators into the 8-bit A registers of P V, and V transposed in shared memory into the
// K-major operand FP8 wgmma requires, with the key order the two steps agree on.
//
// Why a key permutation: wgmma m64nNk32 with 8-bit A wants thread L of a warp to hold keys
// 4 (L % 4) + 0..3 (+ 16) of rows L/4 and L/4 + 8 in its 4 registers, while the fp32 S
// accumulators give it keys 2 (L % 4) + {0, 1} of each n8 column block. Rather than move
// values between threads (shuffles), P's registers take the keys the thread already holds and
// V's transposed copy stores its key rows in the same order, so the sum over keys is the same
// (within each k32 step, whose 32 products are summed exactly). Position p = 16 h + 4 t + j
// (h < 2, t < 4, j < 4) of a k32 step holds key
//     key_of_position(p) = 16 h + 8 (j / 2) + 2 t + j % 2,
// a permutation of 0..31 (keys 2t, 2t+1, 8+2t, 9+2t for h = 0; 16 more for h = 1).
//
// Layouts (shared memory, 128-byte swizzle as wgmma's descriptors and TMA read and write
// them: row r of a 128-byte panel at r * 128, its 16-byte chunk c at c ^ (r % 8), panels of
// `rows` rows one after another):
//   * V as TMA lands it: kRows key rows of kCols bytes (head dim D), panels of 128 columns;
//   * V^T: kCols rows (d) of kRows bytes (key positions), panels of 128 positions, the
//     K-major B operand of P V: k32 step s reads bytes 32 (s % 4) of panel s / 4.
#pragma once

#include "fp8.cuh"

namespace ft {

// The key (0..31) that position p (0..31) of a k32 step of P V holds (see above).
__host__ __device__ constexpr int key_of_position(int p) {
  return 16 * (p / 16) + 8 * ((p % 4) / 2) + 2 * ((p % 16) / 4) + p % 2;
}

// Byte offset of byte c of row r in a 128-byte-swizzled tile of `rows` rows.
__device__ __forceinline__ int swizzled_byte(int rows, int r, int c) {
  return (c / 128) * rows * 128 + r * 128 + ((((c % 128) / 16) ^ (r % 8)) * 16) + c % 16;
}

// The A registers of P V's k32 steps from the S accumulators s (the wgmma accumulator layout
// of an m64 x kBlockN tile, already exponentiated: P's values), rounded to FP8 by
// cvt.rn.satfinite (e4m3, or e5m2 where Format is E5m2Format): step kk's register r holds
// n8 blocks 4 kk + 2 (r / 2) and 4 kk + 2 (r / 2) + 1, rows g (r even) or g + 8 (r odd), two
// values each, so no value leaves its thread.
template <int kBlockN, bool kE5M2>
__device__ __forceinline__ void fp8_p_registers(const float (&s)[kBlockN / 2],
                                                unsigned (&p)[kBlockN / 32][4]) {
  static_assert(kBlockN % 32 == 0, "P V steps over 32 keys");
#pragma unroll
  for (int kk = 0; kk < kBlockN / 32; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      // accumulator v of n8 block b: s[4 b + v]; v 0, 1 row g, 2, 3 row g + 8
      const int b0 = 4 * kk + 2 * (r / 2);
      const int v = 2 * (r % 2);
      unsigned short lo, hi;
      if constexpr (kE5M2) {
        lo = cvt_e5m2x2_f32(s[4 * b0 + v], s[4 * b0 + v + 1]);
        hi = cvt_e5m2x2_f32(s[4 * b0 + 4 + v], s[4 * b0 + 4 + v + 1]);
      } else {
        lo = cvt_e4m3x2_f32(s[4 * b0 + v], s[4 * b0 + v + 1]);
        hi = cvt_e4m3x2_f32(s[4 * b0 + 4 + v], s[4 * b0 + 4 + v + 1]);
      }
      p[kk][r] = static_cast<unsigned>(lo) | static_cast<unsigned>(hi) << 16;
    }
  }
}

// V^T (kCols rows of kRows key positions) from V (kRows key rows of kCols bytes), both
// 128-byte swizzled, by kThreads threads (tid 0 .. kThreads - 1), in units of 4 x 4 bytes:
// a unit reads 4 bytes of each of the 4 key rows one output word needs (keys
// key_of_position(4 t' + 0..3) of its k32 step), transposes them in registers (byte
// permutes) and writes 4 words, one per d row. The caller orders the writes before wgmma's
// reads (fence_proxy_async and a barrier).
template <int kRows, int kCols, int kThreads>
__device__ __forceinline__ void transpose_v_fp8(const unsigned char* v, unsigned char* vt,
                                                int tid) {
  static_assert(kRows % 32 == 0 && kCols % 4 == 0, "whole k32 steps and 4-byte columns");
  constexpr int kGroups = kRows / 4;  // output words per d row
  constexpr int kUnits = kGroups * (kCols / 4);
#pragma unroll 1
  for (int u = tid; u < kUnits; u += kThreads) {
    const int group = u % kGroups;  // positions 4 group .. 4 group + 3
    const int c = 4 * (u / kGroups);  // d columns c .. c + 3
    const int base = 32 * (group / 8);
    const int p0 = 4 * (group % 8);
    unsigned w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int key = base + key_of_position(p0 + j);
      w[j] = *reinterpret_cast<const unsigned*>(v + swizzled_byte(kRows, key, c));
    }
    // out[i] byte j = byte i of w[j]: d row c + i, position 4 group + j
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const unsigned out = (w[0] >> (8 * i) & 0xFFu) | (w[1] >> (8 * i) & 0xFFu) << 8 |
                           (w[2] >> (8 * i) & 0xFFu) << 16 | (w[3] >> (8 * i) & 0xFFu) << 24;
      *reinterpret_cast<unsigned*>(vt + swizzled_byte(kCols, c + i, 4 * group)) = out;
    }
  }
}

}  // namespace ft
