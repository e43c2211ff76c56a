// One warp's product C += A B on m16n8k16 tensor cores with both operands in shared memory,
// each stored either with its rows or with its k index contiguous. The backward kernel needs
// all four combinations (S = Q K^T, dV += P^T dO, dQ = dS K, ...), so one helper serves.
//
// Fragment layouts and ldmatrix row addresses follow reference/ptx-warp-semantics.md
// sections 1 and 2; g = lane / 4 and t = lane % 4 below. C fragments: c[i][j] covers rows
// 16 i.. and columns 8 j..; c0, c1 are row g, columns 2t, 2t+1; c2, c3 row g + 8.
#pragma once

#include "primitives.cuh"

namespace ft {

// C (MT m16 tiles x NT n8 tiles) += A (MT*16 x KSTEPS*16) B (KSTEPS*16 x NT*8).
//
// A_BY_K = false: A is stored [row][k] (row stride a_stride): ldmatrix.x4 gives the A
//   fragment directly (lane addresses row lane % 16, k half lane / 16).
// A_BY_K = true:  A is stored [k][row]: ldmatrix.x4.trans of the 8x8 blocks (k 0-7, rows
//   0-7), (k 0-7, rows 8-15), (k 8-15, rows 0-7), (k 8-15, rows 8-15) gives a0..a3.
// B_BY_K = false: B is stored [n][k]: ldmatrix.x4 loads two n8 tiles (registers {0,1} and
//   {2,3}); an odd last tile uses ldmatrix.x2.
// B_BY_K = true:  B is stored [k][n]: ldmatrix.x4.trans loads two n8 tiles; x2.trans the
//   odd last one.
// a and b address the first row (or k) and column of the operand; every row, k and column
// the product touches must hold data (shared memory is poisoned until written).
template <class Ops, int MT, int NT, int KSTEPS, bool A_BY_K, bool B_BY_K, class E>
__device__ __forceinline__ void warp_mma(float (&c)[MT][NT][4], const E* a, int a_stride,
                                         const E* b, int b_stride, int lane) {
  const int quad_row = (lane / 16) * 8 + lane % 8;  // row of an 8x8 block pair by lane
  const int quad_col = ((lane / 8) % 2) * 8;
  const E* a_lane = A_BY_K ? a + quad_row * a_stride + quad_col
                           : a + (lane % 16) * a_stride + (lane / 16) * 8;
  const E* b_lane = B_BY_K ? b + (lane % 16) * b_stride + (lane / 16) * 8
                           : b + quad_row * b_stride + quad_col;
  // The x2 loads of an odd last B tile use lanes 0-15 (the others' addresses are unused but
  // kept in bounds).
  const E* b_last = B_BY_K ? b + (lane % 16) * b_stride + (NT - 1) * 8
                           : b + (lane % 8) * b_stride + ((lane / 8) % 2) * 8 +
                                 (NT - 1) * 8 * b_stride;
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    unsigned af[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if constexpr (A_BY_K) {
        ldmatrix_x4_trans(af[mt], a_lane + kk * 16 * a_stride + mt * 16);
      } else {
        ldmatrix_x4(af[mt], a_lane + mt * 16 * a_stride + kk * 16);
      }
    }
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      unsigned bf[4];
      if constexpr (B_BY_K) {
        ldmatrix_x4_trans(bf, b_lane + kk * 16 * b_stride + np * 16);
      } else {
        ldmatrix_x4(bf, b_lane + np * 16 * b_stride + kk * 16);
      }
      const unsigned b_lo[2] = {bf[0], bf[1]};
      const unsigned b_hi[2] = {bf[2], bf[3]};
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        Ops::mma(c[mt][2 * np], af[mt], b_lo, c[mt][2 * np]);
        Ops::mma(c[mt][2 * np + 1], af[mt], b_hi, c[mt][2 * np + 1]);
      }
    }
    if constexpr (NT % 2 == 1) {
      unsigned bf[2];
      if constexpr (B_BY_K) {
        ldmatrix_x2_trans(bf, b_last + kk * 16 * b_stride);
      } else {
        ldmatrix_x2(bf, b_last + kk * 16);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) Ops::mma(c[mt][NT - 1], af[mt], bf, c[mt][NT - 1]);
    }
  }
}

// Zero a fragment array.
template <int MT, int NT>
__device__ __forceinline__ void zero_fragments(float (&c)[MT][NT][4]) {
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) c[i][j][e] = 0.0f;
    }
  }
}

}  // namespace ft
