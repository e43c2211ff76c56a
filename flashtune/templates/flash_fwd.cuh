// FlashAttention-2 forward pass (sm_80 and newer): one thread block per kBlockM query rows
// of one (batch, head).
//
// Per block: Q is copied to shared memory once; K and V tiles of kBlockN keys stream through
// rings of kNumStages shared buffers fed by cp.async; each warp computes S = Q K^T for its
// rows on tensor cores, masks it where needed, folds it into an online softmax held in
// registers, and accumulates O += P V with P taken straight from the S registers. At the
// end O is normalised, staged through the warp's own (no longer needed) Q rows and written
// with 128-bit stores, with the natural-log LSE of each row.
//
// The key tiles are walked from the last one down, so that the tiles that need a mask come
// first. The main loop is split by what a tile needs:
//   the first step (peeled): the only tile that can be partial (bounds-checked copies, the
//     key-range mask) and the first one (no rescale of the all-zero O);
//   masked steps (causal only): the tiles that cross the diagonal; the causal mask;
//   unmasked steps: every row sees every key; no mask, no bounds check.
// No step needs a guard against rows that have seen only masked keys: their running max
// starts at a finite value below every score (OnlineSoftmax::kNoMax).
//
// Tensors: Q, O (batch, seqlen_q, heads_q, dim); K, V (batch, seqlen_k, heads_kv, dim);
// strides in elements, the last dim contiguous; base pointers 16-byte aligned and strides
// multiples of 8 elements. LSE: contiguous float32 (batch, heads_q, seqlen_q). GQA/MQA:
// heads_q is a multiple of heads_kv and query head h reads kv head h / (heads_q / heads_kv).
// seqlen_q, seqlen_k >= 1. softmax_scale must be positive (the running max is taken over
// unscaled scores).
#pragma once

#include "fwd_traits.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"
#include "warp_gemm.cuh"

namespace ft {

// The per-thread state of one block's main loop and its steps. Steps are named by their key
// tile, counted down from the last one to 0.
template <class Tr>
struct FwdMainloop {
  using Element = typename Tr::Element;
  static constexpr int kStages = Tr::kNumStages;

  Element* sk;                 // K stage buffers
  Element* sv;                 // V stage buffers
  const Element* q_lane;       // this warp's Q rows plus the lane's ldmatrix offset
  LaneOffsets<Tr> lanes;
  TileStream<Tr> k_in;
  TileStream<Tr> v_in;
  int tid;
  int stage;                   // element offset of the stage buffer of the previous step
  float scale_log2;
  RowLimits<Tr> limits;        // the keys the lane's rows may see
  OnlineSoftmax<Tr> softmax;
  float acc_o[Tr::kMTiles][Tr::kOTiles][4];

  // Stage buffer offsets rotate through 0, kKvElems, ..., (kStages - 1) * kKvElems.
  static __device__ __forceinline__ int next_stage(int off) {
    if constexpr (kStages == 1) {
      return 0;
    } else if constexpr (kStages == 2) {
      return Tr::kKvElems - off;
    } else {
      return off == (kStages - 1) * Tr::kKvElems ? 0 : off + Tr::kKvElems;
    }
  }

  // Copies before the loop: Q and the first tile walked (bounds-checked: first_rows of its
  // rows exist), then the next (whole) tiles up to kStages - 1 ahead; one commit group per
  // K and per V of a tile (one stage) or per tile (more stages). first_tile: its index.
  __device__ __forceinline__ void prologue(Element* sq, const Element* q_bh,
                                           long long q_row_stride, int m0, int seqlen_q,
                                           int first_tile, int first_rows) {
    load_rows_checked<Tr, Tr::kBlockM>(sq, q_bh, q_row_stride, m0, seqlen_q, tid);
    k_in.template load<true>(sk, first_rows, tid);
    if constexpr (Tr::kOneBarrier) {
      v_in.template load<true>(sv, first_rows, tid);
      cp_async_commit();
#pragma unroll
      for (int t = 1; t + 1 < kStages; ++t) {
        if (first_tile - t >= 0) {
          k_in.template load<false>(sk + t * Tr::kKvElems, Tr::kBlockN, tid);
          v_in.template load<false>(sv + t * Tr::kKvElems, Tr::kBlockN, tid);
        }
        cp_async_commit();
      }
    } else {
      cp_async_commit();
    }
    stage = (kStages - 1) * Tr::kKvElems;
  }

  // The step of key tile `tile`. kFirst: the first step, whose tile alone can be partial
  // (first_rows of its rows exist); kMasked: the tile may hold keys some row may not see.
  template <bool kFirst, bool kMasked>
  __device__ __forceinline__ void step(int tile, int first_rows = Tr::kBlockN) {
    const int prev = stage;
    const int cur = next_stage(prev);
    stage = cur;
    float s[Tr::kMTiles][Tr::kSTiles][4];
    if constexpr (Tr::kOneBarrier) {
      // This tile has landed for every thread, and every warp is done with the previous
      // step, whose buffers take the tile kStages - 1 steps ahead.
      cp_async_wait<Tr::kPipelineWait>();
      block_sync();
      if (tile >= kStages - 1) {
        k_in.template load<false>(sk + prev, Tr::kBlockN, tid);
        v_in.template load<false>(sv + prev, Tr::kBlockN, tid);
      }
      cp_async_commit();
    } else {
      // One buffer each: V is copied while Q K^T and the softmax run, the next K while
      // P V runs (or, under Tr::kLateKLoad, after it).
      cp_async_wait<0>();
      block_sync();  // K landed; every warp is done reading the previous V
      v_in.template load<kFirst>(sv, first_rows, tid);
      cp_async_commit();
    }
    gemm_qk<Tr>(s, q_lane, sk + cur + lanes.k);
    unsigned p[Tr::kMTiles][Tr::kPvSteps][4];
    if constexpr (kMasked) {
      const TileMask<Tr, kFirst, Tr::kCausal> mask(limits, tile * Tr::kBlockN);
      softmax.template update<kFirst>(s, p, acc_o, scale_log2, mask);
    } else {
      softmax.template update<kFirst>(s, p, acc_o, scale_log2, NoMask());
    }
    if constexpr (!Tr::kOneBarrier) {
      cp_async_wait<0>();
      block_sync();  // V landed; every warp is done reading K
      if constexpr (!Tr::kLateKLoad) load_next_k(tile);
    }
    gemm_pv<Tr>(acc_o, p, sv + cur + lanes.v);
    if constexpr (!Tr::kOneBarrier && Tr::kLateKLoad) load_next_k(tile);
  }

  // One stage: the K tile after `tile`, into the one K buffer (free: every warp has passed
  // the barrier after its Q K^T).
  __device__ __forceinline__ void load_next_k(int tile) {
    if (tile >= 1) k_in.template load<false>(sk, Tr::kBlockN, tid);
    cp_async_commit();
  }
};

template <class Tr>
__device__ __forceinline__ void flash_fwd(
    const typename Tr::Element* __restrict__ q, const typename Tr::Element* __restrict__ k,
    const typename Tr::Element* __restrict__ v, typename Tr::Element* __restrict__ o,
    float* __restrict__ lse, int seqlen_q, int seqlen_k, int heads_q, int heads_kv,
    long long q_batch_stride, long long q_row_stride, long long q_head_stride,
    long long k_batch_stride, long long k_row_stride, long long k_head_stride,
    long long v_batch_stride, long long v_row_stride, long long v_head_stride,
    long long o_batch_stride, long long o_row_stride, long long o_head_stride,
    float softmax_scale) {
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;

  const int m_block = static_cast<int>(blockIdx.x);
  const int head = static_cast<int>(blockIdx.y);
  const int batch = static_cast<int>(blockIdx.z);
  const int kv_head = head / (heads_q / heads_kv);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();

  // Row 0 of this (batch, head) in each tensor (64-bit offsets). The outputs' are formed
  // where they are written, so that they hold no registers across the main loop.
  const Element* q_bh = q + batch * q_batch_stride + head * q_head_stride;
  const Element* k_bh = k + batch * k_batch_stride + kv_head * k_head_stride;
  const Element* v_bh = v + batch * v_batch_stride + kv_head * v_head_stride;
  auto o_rows = [&]() { return o + batch * o_batch_stride + head * o_head_stride; };
  auto lse_rows = [&]() {
    return lse + (static_cast<long long>(batch) * heads_q + head) * seqlen_q;
  };

  // Keys [0, n_end) are visible to some row of the block; the causal diagonal is aligned to
  // the bottom-right corner: row i sees key j iff j <= i + seqlen_k - seqlen_q.
  const int m0 = m_block * kBlockM;
  const int m_end = seqlen_q < m0 + kBlockM ? seqlen_q : m0 + kBlockM;
  int n_end = seqlen_k;
  // Keys [0, n_full) are visible to every row of the block: tiles inside need no mask.
  int n_full = seqlen_k;
  if constexpr (Tr::kCausal) {
    const int last_row_end = m_end + seqlen_k - seqlen_q;
    const int first_row_end = m0 + 1 + seqlen_k - seqlen_q;
    n_end = last_row_end < n_end ? last_row_end : n_end;
    n_full = first_row_end < n_full ? first_row_end : n_full;
  }
  if (n_end <= 0) {  // no row of the block sees any key
    store_empty_rows<Tr>(o_rows(), o_row_stride, lse_rows(), m0, seqlen_q, tid);
    return;
  }
  const int n_tiles = (n_end + kBlockN - 1) / kBlockN;
  // Tiles from first_masked_tile up reach past n_full.
  const int first_masked_tile = n_full <= 0 ? 0 : n_full / kBlockN;

  FT_DYNAMIC_SMEM(unsigned char, smem);
  Element* const sq = reinterpret_cast<Element*>(smem);
  zero_pad_columns<Tr>(sq, tid);

  const int warp_row0 = warp * Tr::kWarpRows;
  int tile = n_tiles - 1;
  FwdMainloop<Tr> loop{sq + Tr::kKOffset,
                       sq + Tr::kVOffset,
                       nullptr,
                       LaneOffsets<Tr>(lane),
                       TileStream<Tr>(k_bh, k_row_stride, tile, tid),
                       TileStream<Tr>(v_bh, v_row_stride, tile, tid),
                       tid,
                       0,
                       softmax_scale * 1.44269504088896340736f,
                       {},
                       {},
                       {}};
  loop.q_lane = sq + Tr::Smem::offset(warp_row0, 0) + loop.lanes.q;
  const int first_rows = seqlen_k - tile * kBlockN;
  loop.prologue(sq, q_bh, q_row_stride, m0, seqlen_q, tile, first_rows);
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < Tr::kOTiles; ++dt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) loop.acc_o[mt][dt][i] = 0.0f;
    }
  }

  loop.limits.init(m0 + warp_row0, seqlen_q, seqlen_k, lane);
  loop.template step<true, true>(tile, first_rows);
  --tile;
  if constexpr (Tr::kCausal) {
    // The masked tiles are those from floor(n_full / kBlockN) to the last, and
    // n_end - n_full <= kBlockM - 1, so after the first step at most
    // kMaxMasked = ceil((kBlockM - 2) / kBlockN) of them remain. Up to two are unrolled as
    // conditional steps (straight-line code leaves the compiler more registers than a loop
    // that must agree with the unmasked one); more take a loop.
    constexpr int kMaxMasked = (kBlockM - 2 + kBlockN - 1) / kBlockN;
    if constexpr (kMaxMasked <= 2) {
#pragma unroll
      for (int i = 0; i < kMaxMasked; ++i) {
        if (tile >= first_masked_tile) loop.template step<false, true>(tile--);
      }
    } else {
      for (; tile >= first_masked_tile; --tile) loop.template step<false, true>(tile);
    }
  }
  for (; tile >= 0; --tile) loop.template step<false, false>(tile);
  cp_async_wait_all();  // only empty groups remain; leave none behind

  // Epilogue. Every warp passed the last barrier after its last read of Q, and only this
  // warp reads its own Q rows, so they are free to stage this warp's output rows.
  float inv_sum[Tr::kMTiles][2];
  float row_lse[Tr::kMTiles][2];
  loop.softmax.finalize(inv_sum, row_lse);
  float* const lse_bh = lse_rows();
  const int g = lane / 4;
  const int t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mt * 16 + g + 8 * h;
#pragma unroll
      for (int dt = 0; dt < Tr::kOTiles; ++dt) {
        *reinterpret_cast<unsigned*>(sq + Tr::Smem::offset(warp_row0 + r, dt) + 2 * t) =
            Tr::Ops::pack(loop.acc_o[mt][dt][2 * h] * inv_sum[mt][h],
                          loop.acc_o[mt][dt][2 * h + 1] * inv_sum[mt][h]);
      }
      const int row = m0 + warp_row0 + r;
      if (t == 0 && row < seqlen_q) lse_bh[row] = row_lse[mt][h];
    }
  }
  warp_sync();
  store_warp_rows<Tr>(o_rows(), o_row_stride, sq, warp_row0, m0, seqlen_q, lane);
}

}  // namespace ft
