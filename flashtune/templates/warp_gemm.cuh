// The two warp-level products of the forward kernel on m16n8k16 tensor cores.
//
// Fragment layouts and ldmatrix row addresses follow reference/ptx-warp-semantics.md
// sections 1 and 2; g = lane / 4 and t = lane % 4 below.
#pragma once

#include "fwd_traits.cuh"

namespace ft {

namespace detail {
template <class...>
using Void = void;
// The type of Q's and K's elements in shared memory and Q K^T's mma of traits Tr: Tr::In
// and Tr::QkOps where Tr declares them (the forward's traits, FP8 included), else the
// 16-bit Element and its Ops (decoding's traits).
template <class Tr, class = void>
struct QkInputs {
  using In = typename Tr::Element;
  using Ops = typename Tr::Ops;
};
template <class Tr>
struct QkInputs<Tr, Void<typename Tr::In>> {
  using In = typename Tr::In;
  using Ops = typename Tr::QkOps;
};
// The shared layout of V's tiles: Tr::VSmem where Tr declares it (the forward's traits,
// whose V head dim may differ from Q/K's), else Tr::Smem (decoding's traits).
template <class Tr, class = void>
struct VLayout {
  using type = typename Tr::Smem;
};
template <class Tr>
struct VLayout<Tr, Void<typename Tr::VSmem>> {
  using type = typename Tr::VSmem;
};
}  // namespace detail

// The shared-memory offsets each lane addresses in the ldmatrix loads of one warp, from the
// start of a tile; computed once per thread and kept in registers, so a tile's loads cost
// no index math (one offset for padded rows, a few for swizzled ones: ChunkRun).
template <class Tr>
struct LaneOffsets {
  // A (Q, x4): row lane % 16, column half lane / 16, k16 step kk: q.at(kk, 16 mt).
  ChunkRun<typename Tr::Smem, 2, Tr::kQkSteps> q;
  // B (K, x4 = two n8 tiles): key 8 (lane / 16) + lane % 8, column half (lane / 8) % 2;
  // k.at(kk, 16 np) addresses key tiles 2 np and 2 np + 1.
  ChunkRun<typename Tr::Smem, 2, Tr::kQkSteps> k;
  // B (V, x4.trans = two n8 tiles): key lane % 16, dim half lane / 16; v.at(dp, 16 kk).
  ChunkRun<typename detail::VLayout<Tr>::type, 2, Tr::kOTiles / 2> v;

  __device__ __forceinline__ explicit LaneOffsets(int lane) {
    q.init(lane % 16, lane / 16);
    k.init((lane / 16) * 8 + lane % 8, (lane / 8) % 2);
    v.init(lane % 16, lane / 16);
    pin(q);
    pin(k);
    pin(v);
  }

  // Kept in registers unless the accumulators already fill them (then the compiler may
  // recompute the offsets rather than spill).
  template <class Run>
  static __device__ __forceinline__ void pin(Run& run) {
    if constexpr (Tr::kAccumulatorRegisters < 192) {
#pragma unroll
      for (int i = 0; i < Run::kVariants; ++i) run.base[i] = keep_in_register(run.base[i]);
    }
  }
};

// Q as the A operand of Q K^T, re-read from shared memory every tile.
template <class Tr>
struct QFromSmem {
  const typename detail::QkInputs<Tr>::In* rows;  // this warp's first Q row in shared memory

  __device__ __forceinline__ void prepare(const LaneOffsets<Tr>&) {}
  __device__ __forceinline__ void fragment(unsigned (&a)[4], int mt, int kk,
                                           const LaneOffsets<Tr>& lanes) const {
    ldmatrix_x4(a, rows + lanes.q.at(kk, 16 * mt));
  }
};

// Q as the A operand of Q K^T, loaded from shared memory once (prepare, after Q landed) and
// held in registers.
template <class Tr>
struct QInRegisters {
  const typename detail::QkInputs<Tr>::In* rows;
  unsigned frag[Tr::kMTiles][Tr::kQkSteps][4];

  __device__ __forceinline__ void prepare(const LaneOffsets<Tr>& lanes) {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
      for (int kk = 0; kk < Tr::kQkSteps; ++kk) {
        ldmatrix_x4(frag[mt][kk], rows + lanes.q.at(kk, 16 * mt));
      }
    }
  }
  __device__ __forceinline__ void fragment(unsigned (&a)[4], int mt, int kk,
                                           const LaneOffsets<Tr>&) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = frag[mt][kk][i];
  }
};

template <class Tr>
using QOperand = typename detail::Select<Tr::kQInRegs, QInRegisters<Tr>, QFromSmem<Tr>>::type;

// S = Q_w K^T for the warp's kWarpRows query rows and the tile's kBlockN keys, in k steps
// of Tr::QkOps's mma (k16 for 16-bit inputs, k32 for e4m3: the same ldmatrix recipes on
// 16-bit words). sk: the K tile. s[mt][nt] is the C fragment of rows 16 mt.., keys 8 nt.. (c0,c1: row g;
// c2,c3: row g+8; columns 2t, 2t+1).
template <class Tr>
__device__ __forceinline__ void gemm_qk(float (&s)[Tr::kMTiles][Tr::kSTiles][4],
                                        const QOperand<Tr>& q,
                                        const typename detail::QkInputs<Tr>::In* sk,
                                        const LaneOffsets<Tr>& lanes) {
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
    for (int mt = 0; mt < Tr::kMTiles; ++mt) q.fragment(a[mt], mt, kk, lanes);
#pragma unroll
    for (int np = 0; np < Tr::kSTiles / 2; ++np) {
      unsigned b[4];
      ldmatrix_x4(b, sk + lanes.k.at(kk, 16 * np));
      const unsigned b_lo[2] = {b[0], b[1]};
      const unsigned b_hi[2] = {b[2], b[3]};
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        detail::QkInputs<Tr>::Ops::mma(s[mt][2 * np], a[mt], b_lo, s[mt][2 * np]);
        detail::QkInputs<Tr>::Ops::mma(s[mt][2 * np + 1], a[mt], b_hi, s[mt][2 * np + 1]);
      }
    }
  }
}

// O += P V. p[mt][kk]: the A fragment of P for m16 tile mt and k16 step kk (probabilities
// packed to 16-bit pairs by OnlineSoftmax::update). sv: the V tile ([key][dim]), read
// transposed as the B operand.
template <class Tr>
__device__ __forceinline__ void gemm_pv(float (&o)[Tr::kMTiles][Tr::kOTiles][4],
                                        const unsigned (&p)[Tr::kMTiles][Tr::kPvSteps][4],
                                        const typename Tr::Element* sv,
                                        const LaneOffsets<Tr>& lanes) {
#pragma unroll
  for (int kk = 0; kk < Tr::kPvSteps; ++kk) {
#pragma unroll
    for (int dp = 0; dp < Tr::kOTiles / 2; ++dp) {
      unsigned b[4];
      ldmatrix_x4_trans(b, sv + lanes.v.at(dp, 16 * kk));
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
