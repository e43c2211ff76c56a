// The two warp-level products of the forward kernel on m16n8k16 tensor cores.
//
// Fragment layouts and ldmatrix row addresses follow reference/ptx-warp-semantics.md
// sections 1 and 2; g = lane / 4 and t = lane % 4 below.
#pragma once

#include "fwd_traits.cuh"

namespace ft {

// The row each lane addresses in the ldmatrix loads of one warp, as element offsets from
// the start of a tile; computed once per thread and kept in registers, so a tile's loads
// cost no index math.
template <class Tr>
struct LaneOffsets {
  int q;  // A (Q, x4): row lane % 16, column half lane / 16
  int k;  // B (K, x4 = two n8 tiles): key 8 (lane / 16) + lane % 8, column half (lane / 8) % 2
  int v;  // B (V, x4.trans = two n8 tiles): key lane % 16, dim half lane / 16

  __device__ __forceinline__ explicit LaneOffsets(int lane)
      : q(pin(Tr::Smem::offset(lane % 16, lane / 16))),
        k(pin(Tr::Smem::offset((lane / 16) * 8 + lane % 8, (lane / 8) % 2))),
        v(q) {}

  // Pinned to registers unless the accumulators already fill them (then the compiler may
  // recompute the offsets rather than spill).
  static __device__ __forceinline__ int pin(int x) {
    return Tr::kAccumulatorRegisters < 192 ? keep_in_register(x) : x;
  }
};

// S = Q_w K^T for the warp's kWarpRows query rows and the tile's kBlockN keys.
// q_lane / k_lane: the warp's Q tile and the K tile, each plus its lane offset.
// s[mt][nt] is the C fragment of rows 16 mt.., keys 8 nt.. (c0,c1: row g; c2,c3: row g+8;
// columns 2t, 2t+1).
template <class Tr>
__device__ __forceinline__ void gemm_qk(float (&s)[Tr::kMTiles][Tr::kSTiles][4],
                                        const typename Tr::Element* q_lane,
                                        const typename Tr::Element* k_lane) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < Tr::kSTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[mt][nt][i] = 0.0f;
    }
  }
#pragma unroll
  for (int kk = 0; kk < Tr::kQkSteps; ++kk) {
    unsigned a[Tr::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
      ldmatrix_x4(a[mt], q_lane + Tr::Smem::offset(mt * 16, 2 * kk));
    }
#pragma unroll
    for (int np = 0; np < Tr::kSTiles / 2; ++np) {
      unsigned b[4];
      ldmatrix_x4(b, k_lane + Tr::Smem::offset(np * 16, 2 * kk));
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

// O += P V. p[mt][kk]: the A fragment of P for m16 tile mt and k16 step kk (probabilities
// packed to 16-bit pairs by OnlineSoftmax::update). v_lane: the V tile ([key][dim]) plus its
// lane offset, read transposed as the B operand.
template <class Tr>
__device__ __forceinline__ void gemm_pv(float (&o)[Tr::kMTiles][Tr::kOTiles][4],
                                        const unsigned (&p)[Tr::kMTiles][Tr::kPvSteps][4],
                                        const typename Tr::Element* v_lane) {
#pragma unroll
  for (int kk = 0; kk < Tr::kPvSteps; ++kk) {
#pragma unroll
    for (int dp = 0; dp < Tr::kOTiles / 2; ++dp) {
      unsigned b[4];
      ldmatrix_x4_trans(b, v_lane + Tr::Smem::offset(kk * 16, 2 * dp));
      const unsigned b_lo[2] = {b[0], b[1]};
      const unsigned b_hi[2] = {b[2], b[3]};
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        Tr::Ops::mma(o[mt][2 * dp], p[mt][kk], b_lo, o[mt][2 * dp]);
        Tr::Ops::mma(o[mt][2 * dp + 1], p[mt][kk], b_hi, o[mt][2 * dp + 1]);
      }
    }
  }
}

}  // namespace ft
