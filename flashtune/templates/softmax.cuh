// Masking and the online softmax of the forward kernel, on S fragments held in registers.
//
// A lane holds, per m16 tile mt, two query rows: g (h = 0, elements 0 and 1 of each
// fragment) and g + 8 (h = 1, elements 2 and 3), g = lane / 4. The four lanes of a quad
// share their rows, so row reductions end with two xor-shuffles over the quad.
#pragma once

#include "fwd_traits.cuh"

namespace ft {

// Set to -inf every score of key `col` that query row `row` may not see: col >= seqlen_k,
// or (causal) col > row + seqlen_k - seqlen_q, i.e. the mask is aligned to the bottom-right
// corner when the lengths differ. row0: global query row of the warp's first row;
// col0: global key of the tile's first column.
template <class Tr>
__device__ __forceinline__ void apply_mask(float (&s)[Tr::kMTiles][Tr::kSTiles][4], int row0,
                                           int col0, int seqlen_q, int seqlen_k, int lane) {
  const int g = lane / 4;
  const int col_lane = col0 + 2 * (lane % 4);
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int limit = seqlen_k;  // keys [0, limit) are visible to this row
      if constexpr (Tr::kCausal) {
        const int row = row0 + mt * 16 + g + 8 * h;
        const int diag = row + 1 + seqlen_k - seqlen_q;
        limit = diag < limit ? diag : limit;
      }
#pragma unroll
      for (int nt = 0; nt < Tr::kSTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (col_lane + nt * 8 + e >= limit) s[mt][nt][2 * h + e] = -INFINITY;
        }
      }
    }
  }
}

// Running softmax statistics of the lane's rows, in the log2 domain: scores are multiplied
// by scale_log2 = softmax_scale * log2(e) so that exp(scale * x) = exp2(scale_log2 * x).
template <class Tr>
struct OnlineSoftmax {
  // Running max of the raw scores seen so far, times scale_log2; -inf before any key.
  float max_scaled[Tr::kMTiles][2];
  // This lane's share of the row sum of exp2(scaled score - max_scaled); the quad's four
  // shares are added in finalize (the rescaling is the same for all four, so it commutes).
  float sum[Tr::kMTiles][2];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
      max_scaled[mt][0] = max_scaled[mt][1] = -INFINITY;
      sum[mt][0] = sum[mt][1] = 0.0f;
    }
  }

  // Fold one tile of scores into the statistics: rescale the O accumulator and the sums by
  // exp2(old max - new max), and turn s into probabilities exp2(scale_log2 * s - new max)
  // in place (ready to be packed as the A operand of P V).
  //
  // A row whose keys so far are all masked keeps max -inf; its probabilities use a max of 0
  // instead, so exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN.
  __device__ __forceinline__ void update(float (&s)[Tr::kMTiles][Tr::kSTiles][4],
                                         float (&o)[Tr::kMTiles][Tr::kOTiles][4],
                                         float scale_log2) {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float m = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < Tr::kSTiles; ++nt) {
          m = fmaxf(m, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
        }
        m = fmaxf(m, shfl_xor(m, 1));
        m = fmaxf(m, shfl_xor(m, 2));
        // The new running max; the product is rounded the same way in every tile, so the
        // rescale factors telescope exactly.
        const float m_tile = m == -INFINITY ? -INFINITY : m * scale_log2;
        const float m_new = fmaxf(max_scaled[mt][h], m_tile);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;
        const float alpha = exp2f_fast(max_scaled[mt][h] - m_use);
        max_scaled[mt][h] = m_new;
        float tile_sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < Tr::kSTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = exp2f_fast(s[mt][nt][2 * h + e] * scale_log2 - m_use);
            s[mt][nt][2 * h + e] = p;
            tile_sum += p;
          }
        }
        sum[mt][h] = sum[mt][h] * alpha + tile_sum;
#pragma unroll
        for (int dt = 0; dt < Tr::kOTiles; ++dt) {
          o[mt][dt][2 * h] *= alpha;
          o[mt][dt][2 * h + 1] *= alpha;
        }
      }
    }
  }

  // Complete the row sums over the quad; give 1/sum per row (0 for a row that saw no key,
  // so its O is 0) and the natural-log LSE (+inf for a row that saw no key, so that
  // exp(s - lse) = 0 downstream).
  __device__ __forceinline__ void finalize(float (&inv_sum)[Tr::kMTiles][2],
                                           float (&lse)[Tr::kMTiles][2]) {
    constexpr float kLn2 = 0.693147180559945309f;
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float l = sum[mt][h];
        l += shfl_xor(l, 1);
        l += shfl_xor(l, 2);
        const bool empty = l == 0.0f;
        inv_sum[mt][h] = empty ? 0.0f : 1.0f / l;
        lse[mt][h] = empty ? INFINITY : max_scaled[mt][h] * kLn2 + logf(l);
      }
    }
  }
};

}  // namespace ft
