// Masking and the online softmax of the forward kernel, on S fragments held in registers.
//
// A lane holds, per m16 tile mt, two query rows: g (h = 0, elements 0 and 1 of each
// fragment) and g + 8 (h = 1, elements 2 and 3), g = lane / 4. The four lanes of a quad
// share their rows, so row reductions end with two xor-shuffles over the quad.
#pragma once

#include "fwd_traits.cuh"

namespace ft {

// Which keys the lane's rows may see. Keys [0, end) are visible to query row `row`, with
// end = min(seqlen_k, row + 1 + seqlen_k - seqlen_q + right) when causal (right = 0: the
// mask is aligned to the bottom-right corner) or local (a sliding window), and seqlen_k
// otherwise; local, keys before start = row + seqlen_k - seqlen_q - left are hidden too.
// Stored relative to the lane's first column (2 (lane % 4)) and to the warp's first row, so
// that a row (mt, h) adds only the constant 16 mt + 8 h: one register per bound.
template <class Tr>
struct RowLimits {
  int diag;      // end of the warp's first row (causal, local), minus the lane's column
  int key_end;   // seqlen_k minus the lane's column
  int start;     // local: start of the warp's first row's window, minus the lane's column
  int pos;       // ALiBi: i + seqlen_k - seqlen_q of the warp's first row, minus the column

  // right, left: the window's clamped sizes (0, unused: causal; unused: full).
  __device__ __forceinline__ void init(int row0, int seqlen_q, int seqlen_k, int lane,
                                       int right = 0, int left = 0) {
    const int g = lane / 4;
    const int col_lane = 2 * (lane % 4);
    const int rel = row0 + g + seqlen_k - seqlen_q - col_lane;
    diag = rel + 1 + right;
    key_end = seqlen_k - col_lane;
    start = rel - left;
    pos = rel;
  }
};

// The mask of one tile starting at key col0: row by row, sets to -inf every score its row
// may not see. kBound: the tile may reach past seqlen_k; kDiag: it may reach past the end
// of some row (causal, or the right edge of a window); with Tr::kLocal it may also start
// before some row's window. Applied row by row inside the softmax, which keeps few values
// live at once.
template <class Tr, bool kBound, bool kDiag>
struct TileMask {
  int diag;     // RowLimits::diag relative to the tile
  int key_end;  // RowLimits::key_end relative to the tile
  int start;    // RowLimits::start relative to the tile

  __device__ __forceinline__ TileMask(const RowLimits<Tr>& rows, int col0)
      : diag(rows.diag - col0), key_end(rows.key_end - col0), start(rows.start - col0) {}

  __device__ __forceinline__ void row(float (&s)[Tr::kMTiles][Tr::kSTiles][4], int mt,
                                      int h) const {
#pragma unroll
    for (int nt = 0; nt < Tr::kSTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = nt * 8 + e;  // the key's column relative to the lane's first one
        // Row (mt, h) ends at diag + 16 mt + 8 h; the constants stay on the left, so each
        // compare is one instruction against one register.
        const bool hidden = (kBound && c >= key_end) || (kDiag && c - mt * 16 - 8 * h >= diag) ||
                            (Tr::kLocal && c - mt * 16 - 8 * h < start);
        if (hidden) s[mt][nt][2 * h + e] = -INFINITY;
      }
    }
  }
};

// The score transforms of the compiled-in features, on a tile of raw scores s = q.k before
// its mask. The softmax multiplies what it is given by scale_log2 / log2(e) (a positive
// `unit`: softmax_scale, or the cap with softcap), so each transform leaves its result in
// that unit:
//   softcap: s -> tanh(s * softmax_scale / cap), i.e. cap * tanh(scale s / cap) / cap;
//   ALiBi: s += -(slope / unit) * |i + seqlen_k - seqlen_q - j| (the bias in that unit);
//   declared mods: s -> mods(unit s, batch, head, i, j) / unit (ModSite).
template <class Mods, bool = Mods::kOn>
struct ModSite {};

// What declared score modifications read besides the score: their params (the functor)
// and the lane's coordinates.
template <class Mods>
struct ModSite<Mods, true> {
  Mods mods;
  float unit;      // the unit the softmax reads scores in (see above)
  float inv_unit;  // 1 / unit
  int row0;        // the query row of the lane's row (0, 0) within its sequence
  int col_lane;    // the lane's first key column within a tile
  int batch;
  int head;
  int full_begin;  // keys [full_begin, full_end): a block mask's full tiles (kTileRanges)
  int full_end;
};

template <class Tr>
struct ScoreTransform : ModSite<typename Tr::Mods> {
  float tanh_scale;  // softmax_scale / cap (softcap)
  float neg_slope;   // -slope / unit (ALiBi)

  __device__ __forceinline__ void apply(float (&s)[Tr::kMTiles][Tr::kSTiles][4],
                                        const RowLimits<Tr>& rows, int col0) const {
    const int pos = rows.pos - col0;  // i + Nk - Nq - j of row (0, 0), column 0 of the lane
    [[maybe_unused]] bool partial = false;  // a block mask's partial tile: its mask hides keys
    if constexpr (Tr::Mods::kTileRanges) {
      partial = col0 < this->full_begin || col0 >= this->full_end;
    }
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
      for (int nt = 0; nt < Tr::kSTiles; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float x = s[mt][nt][i];
          if constexpr (Tr::kSoftcap) x = tanhf(x * tanh_scale);
          if constexpr (Tr::kAlibi) {
            // Element i: row h = i / 2, column e = i % 2.
            const int d = pos + mt * 16 + 8 * (i / 2) - nt * 8 - (i % 2);
            x += neg_slope * static_cast<float>(d < 0 ? -d : d);
          }
          if constexpr (Tr::Mods::kOn) {
            const int q_idx = this->row0 + mt * 16 + 8 * (i / 2);
            const int kv_idx = col0 + this->col_lane + nt * 8 + (i % 2);
            // A hidden key of a partial tile is -inf before the modification runs, so
            // what the modification reads (captured tensors) is read only for visible keys,
            // as when its mask is part of the expression.
            bool hidden = false;
            if constexpr (Tr::Mods::kTileRanges) {
              hidden = partial && !this->mods.keep(this->batch, this->head, q_idx, kv_idx);
            }
            x = hidden ? -INFINITY
                       : this->mods(x * this->unit, this->batch, this->head, q_idx, kv_idx) *
                             this->inv_unit;
          }
          s[mt][nt][i] = x;
        }
      }
    }
  }
};

// The mask of a tile every row sees whole.
struct NoMask {
  template <class S>
  __device__ __forceinline__ void row(S&, int, int) const {}
};

// Running softmax statistics of the lane's rows, in the log2 domain: scores are multiplied
// by scale_log2 = softmax_scale * log2(e) so that exp(scale * x) = exp2(scale_log2 * x).
template <class Tr>
struct OnlineSoftmax {
  // The running max of a row that has seen no visible key yet: finite and below every
  // finite score, so that masked (-inf) scores give exp2(-inf - kNoMax) = 0 and no
  // guard against exp2(-inf + inf) = NaN is needed anywhere.
  static constexpr float kNoMax = -3.40282346638528859812e+38f;  // -FLT_MAX

  // Running max of the raw scores seen so far, times scale_log2 (kNoMax before any key).
  float max_scaled[Tr::kMTiles][2];
  // This lane's share of the row sum of exp2(scaled score - max_scaled); the quad's four
  // shares are added in finalize (the rescaling is the same for all four, so it commutes).
  float sum[Tr::kMTiles][2];

  // The factors exp2(old max - new max) by which a fold rescales O, per row, and whether
  // the max of some row of the warp changed (one warp vote; every other factor is 1).
  struct Rescale {
    float alpha[Tr::kMTiles][2];
    bool changed;
  };

  // Fold one tile of scores, masked by `mask`, into the statistics and write its
  // probabilities exp2(scale_log2 * s - new max), packed to 16-bit pairs, as the A operand
  // of P V: p[mt][kk] is the A fragment of k16 step kk (the C fragments of key tiles 2 kk
  // and 2 kk + 1).
  //
  // kFirst: the first tile of the block; the statistics start here and O (all zero) is not
  // rescaled. Otherwise the sums are rescaled by exp2(old max - new max), and O too when the
  // max of some row of the warp changed. O is rescaled last, when the scores are packed and
  // fewer registers are live.
  template <bool kFirst, class Mask>
  __device__ __forceinline__ void update(float (&s)[Tr::kMTiles][Tr::kSTiles][4],
                                         unsigned (&p)[Tr::kMTiles][Tr::kPvSteps][4],
                                         float (&o)[Tr::kMTiles][Tr::kOTiles][4],
                                         float scale_log2, const Mask& mask) {
    // Each pair packed as soon as it is made: its two floats die at once (the kernels whose
    // registers are tightest keep them).
    const Rescale r = fold<kFirst, true>(s, p, scale_log2, mask);
    if constexpr (!kFirst) rescale(o, r);
  }

  // The first half of update, for a schedule in which O is still being written (FA3's
  // intra-warpgroup overlap): folds the tile into the statistics and leaves its
  // probabilities in s as floats; pack and rescale finish the tile once O may be touched.
  template <bool kFirst, class Mask>
  __device__ __forceinline__ Rescale exponentiate(float (&s)[Tr::kMTiles][Tr::kSTiles][4],
                                                  float scale_log2, const Mask& mask) {
    unsigned unused[Tr::kMTiles][Tr::kPvSteps][4];  // not written (kPack false)
    return fold<kFirst, false>(s, unused, scale_log2, mask);
  }

  // The fold of one tile: the new maxima, the probabilities and their sums; kPack: the
  // probabilities packed into p at once, else left in s as floats.
  template <bool kFirst, bool kPack, class Mask>
  __device__ __forceinline__ Rescale fold(float (&s)[Tr::kMTiles][Tr::kSTiles][4],
                                          unsigned (&p)[Tr::kMTiles][Tr::kPvSteps][4],
                                          float scale_log2, const Mask& mask) {
    Rescale r;
    r.changed = false;
    // The new maxima and the rescale factors.
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mask.row(s, mt, h);
        float m = fmaxf(s[mt][0][2 * h], s[mt][0][2 * h + 1]);
#pragma unroll
        for (int nt = 1; nt < Tr::kSTiles; ++nt) {
          m = fmaxf(m, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
        }
        m = fmaxf(m, shfl_xor(m, 1));
        m = fmaxf(m, shfl_xor(m, 2));
        // The product is rounded the same way in every tile, so the rescale factors
        // telescope exactly; -inf stays -inf (scale_log2 > 0) and loses to the old max.
        const float m_tile = m * scale_log2;
        const float m_new = fmaxf(kFirst ? kNoMax : max_scaled[mt][h], m_tile);
        if constexpr (!kFirst) {
          r.alpha[mt][h] = exp2f_fast(max_scaled[mt][h] - m_new);
          r.changed = r.changed || m_new != max_scaled[mt][h];
        }
        max_scaled[mt][h] = m_new;
      }
    }
    // The probabilities and their sums.
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float tile_sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < Tr::kSTiles; ++nt) {
          const float p0 = exp2f_fast(s[mt][nt][2 * h] * scale_log2 - max_scaled[mt][h]);
          const float p1 = exp2f_fast(s[mt][nt][2 * h + 1] * scale_log2 - max_scaled[mt][h]);
          tile_sum += p0 + p1;
          if constexpr (kPack) {
            // Key tile nt is half nt % 2 of k16 step nt / 2; row h is register h of a half.
            p[mt][nt / 2][2 * (nt % 2) + h] = Tr::Ops::pack(p0, p1);
          } else {
            s[mt][nt][2 * h] = p0;
            s[mt][nt][2 * h + 1] = p1;
          }
        }
        sum[mt][h] = kFirst ? tile_sum : sum[mt][h] * r.alpha[mt][h] + tile_sum;
      }
    }
    return r;
  }

  // The probabilities exponentiate left in s, packed to 16-bit pairs in P V's A layout.
  static __device__ __forceinline__ void pack(const float (&s)[Tr::kMTiles][Tr::kSTiles][4],
                                              unsigned (&p)[Tr::kMTiles][Tr::kPvSteps][4]) {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
      for (int nt = 0; nt < Tr::kSTiles; ++nt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // Key tile nt is half nt % 2 of k16 step nt / 2; row h is register h of a half.
          p[mt][nt / 2][2 * (nt % 2) + h] = Tr::Ops::pack(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]);
        }
      }
    }
  }

  // O times the factors of a fold (not the first), when the max of some row changed.
  static __device__ __forceinline__ void rescale(float (&o)[Tr::kMTiles][Tr::kOTiles][4],
                                                 const Rescale& r) {
    if (vote_any(r.changed)) {
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
        for (int dt = 0; dt < Tr::kOTiles; ++dt) {
          o[mt][dt][0] *= r.alpha[mt][0];
          o[mt][dt][1] *= r.alpha[mt][0];
          o[mt][dt][2] *= r.alpha[mt][1];
          o[mt][dt][3] *= r.alpha[mt][1];
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
