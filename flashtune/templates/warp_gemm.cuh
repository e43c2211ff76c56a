// The two warp-level products of the forward kernel on m16n8k16 tensor cores.
//
// Fragment layouts and ldmatrix row addresses follow reference/ptx-warp-semantics.md
// sections 1 and 2; g = lane / 4 and t = lane % 4 below.
#pragma once

#include "fwd_traits.cuh"

namespace ft {

// S = Q_w K^T for the warp's kWarpRows query rows and the tile's kBlockN keys.
// sq: the warp's first Q row in shared memory ([row][dim]); sk: the K tile ([key][dim]).
// s[mt][nt] is the C fragment of rows 16 mt.., keys 8 nt.. (c0,c1: row g; c2,c3: row g+8;
// columns 2t, 2t+1).
template <class Tr>
__device__ __forceinline__ void gemm_qk(float (&s)[Tr::kMTiles][Tr::kSTiles][4],
                                        const typename Tr::Element* sq,
                                        const typename Tr::Element* sk, int lane) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < Tr::kSTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[mt][nt][i] = 0.0f;
    }
  }
  // A (Q, x4): lane addresses row lane % 16, column half lane / 16.
  const typename Tr::Element* q_lane = sq + (lane % 16) * Tr::kRowStride + (lane / 16) * 8;
  // B (K, x4 = two n8 tiles): lane addresses key 8 (lane / 16) + lane % 8, column half
  // (lane / 8) % 2; registers {0,1} hold key tile 2p, {2,3} key tile 2p+1.
  const typename Tr::Element* k_lane =
      sk + ((lane / 16) * 8 + lane % 8) * Tr::kRowStride + ((lane / 8) % 2) * 8;
#pragma unroll
  for (int kk = 0; kk < Tr::kQkSteps; ++kk) {
    unsigned a[Tr::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
      ldmatrix_x4(a[mt], q_lane + mt * 16 * Tr::kRowStride + kk * 16);
    }
#pragma unroll
    for (int np = 0; np < Tr::kSTiles / 2; ++np) {
      unsigned b[4];
      ldmatrix_x4(b, k_lane + np * 16 * Tr::kRowStride + kk * 16);
      const unsigned b_lo[2] = {b[0], b[1]};
      const unsigned b_hi[2] = {b[2], b[3]};
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        Tr::Ops::mma(s[mt][2 * np], a[mt], b_lo, s[mt][2 * np]);
        Tr::Ops::mma(s[mt][2 * np + 1], a[mt], b_hi, s[mt][2 * np + 1]);
      }
    }
  }
}

// O += P V, with P (probabilities, float) still in the S fragments: the C fragments of key
// tiles 2j and 2j+1, packed to 16-bit pairs, are exactly the A fragment of k16 step j.
// sv: the V tile ([key][dim]), read transposed as the B operand.
template <class Tr>
__device__ __forceinline__ void gemm_pv(float (&o)[Tr::kMTiles][Tr::kOTiles][4],
                                        const float (&p)[Tr::kMTiles][Tr::kSTiles][4],
                                        const typename Tr::Element* sv, int lane) {
  // B (V, x4.trans = two n8 tiles): lane addresses key lane % 16, dim half lane / 16.
  const typename Tr::Element* v_lane = sv + (lane % 16) * Tr::kRowStride + (lane / 16) * 8;
#pragma unroll
  for (int kk = 0; kk < Tr::kPvSteps; ++kk) {
    unsigned a[Tr::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
      a[mt][0] = Tr::Ops::pack(p[mt][2 * kk][0], p[mt][2 * kk][1]);
      a[mt][1] = Tr::Ops::pack(p[mt][2 * kk][2], p[mt][2 * kk][3]);
      a[mt][2] = Tr::Ops::pack(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1]);
      a[mt][3] = Tr::Ops::pack(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < Tr::kOTiles / 2; ++dp) {
      unsigned b[4];
      ldmatrix_x4_trans(b, v_lane + kk * 16 * Tr::kRowStride + dp * 16);
      const unsigned b_lo[2] = {b[0], b[1]};
      const unsigned b_hi[2] = {b[2], b[3]};
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        Tr::Ops::mma(o[mt][2 * dp], a[mt], b_lo, o[mt][2 * dp]);
        Tr::Ops::mma(o[mt][2 * dp + 1], a[mt], b_hi, o[mt][2 * dp + 1]);
      }
    }
  }
}

}  // namespace ft
