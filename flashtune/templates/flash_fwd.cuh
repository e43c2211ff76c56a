// FlashAttention-2 forward pass (sm_80 and newer): one thread block per kBlockM query rows
// of one (batch, head) at a time (the main loop is in fwd_mainloop.cuh).
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
// Block order (kOrder) maps the launch grid (query blocks, heads_q, batch) to the tiles:
//   kPlain: blockIdx as is; the query blocks of one head are adjacent in launch order, so
//     the blocks running together share that head's K and V in L2 (heads outermost);
//   kHeadsInner: the heads vary fastest; the query heads of a GQA group, which read the
//     same K and V tiles, run side by side on the same query block;
//   kLongestFirst: the query blocks in reverse; under a causal mask the last blocks see
//     the most keys, and starting them first shortens the tail of the launch.
// kPersistent: a block walks the query blocks blockIdx.x, blockIdx.x + gridDim.x, ... of
// its (head, batch) (a static round-robin tile scheduler), so the grid may have fewer
// blocks in x than there are query blocks; with the full grid each block does one.
//
// Tensors: Q, O (batch, seqlen_q, heads_q, dim); K, V (batch, seqlen_k, heads_kv, dim) (V
// and O: V's dim where it differs);
// strides in elements, the last dim contiguous; base pointers 16-byte aligned and strides
// multiples of 8 elements. LSE: contiguous float32 (batch, heads_q, seqlen_q). GQA/MQA:
// heads_q is a multiple of heads_kv and query head h reads kv head h / (heads_q / heads_kv).
// seqlen_q, seqlen_k >= 1. softmax_scale must be positive (the running max is taken over
// unscaled scores).
//
// Features (Tr::kLocal, kSoftcap, kAlibi; run-time values in FwdParams::var): a sliding
// window walks only the key tiles [floor(n_begin / kBlockN), ceil(n_end / kBlockN)) that some
// row of the block sees, masking those that cross an edge of a row's window; softcap and
// ALiBi transform each tile's scores before its mask (ScoreTransform, softmax.cuh); sinks
// join each row's softmax denominator where the rows are finalised (sinks.cuh).
//
// Split head dims (Tr::kSplitV, WithHeadDimV in fwd_traits.cuh): Q K^T over Q/K's head dim,
// P V and O over V's; V's tiles and O's rows are copied with their own row traits
// (VRows, ORows).
//
// FP8 (Tr::kFp8, fwd_fp8.cuh): e4m3 Q, K, V (In: two values per 16-bit word), a 16-bit O,
// and the descale factors in FwdParams::scales.
#pragma once

#include "fwd_mainloop.cuh"
#include "sinks.cuh"
#include "variant_args.cuh"

namespace ft {

enum class BlockOrder { kPlain, kHeadsInner, kLongestFirst };

// The FP8 forward's descale factors (fwd_fp8.cuh); a 16-bit forward has none.
struct Fp8Scales;
struct NoFp8Scales {};

// The kernel's arguments (see the entry point in flash_fwd.cu.jinja); `mods` holds the
// params of the declared score modifications; In is the inputs' type (Element, or 16-bit
// words of two e4m3 values with `scales` their descale factors).
template <class Element, class Mods = NoScoreMods, class In = Element,
          class Scales = NoFp8Scales>
struct FwdParams {
  const In* __restrict__ q;
  const In* __restrict__ k;
  const In* __restrict__ v;
  Element* __restrict__ o;
  float* __restrict__ lse;
  int seqlen_q, seqlen_k, heads_q, heads_kv;
  long long q_batch_stride, q_row_stride, q_head_stride;
  long long k_batch_stride, k_row_stride, k_head_stride;
  long long v_batch_stride, v_row_stride, v_head_stride;
  long long o_batch_stride, o_row_stride, o_head_stride;
  float softmax_scale;
  VariantArgs var;
  Mods mods;
  Scales scales;
};

template <class Tr>
using FwdParamsOf = FwdParams<typename Tr::Element, typename Tr::Mods, typename Tr::In,
                              typename detail::Select<Tr::kFp8, Fp8Scales, NoFp8Scales>::type>;

// One block's work: kBlockM query rows from m_block * kBlockM of one (batch, head).
template <class Tr>
__device__ __forceinline__ void fwd_tile(const FwdParamsOf<Tr>& a, int m_block, int head,
                                         int batch, unsigned char* smem) {
  using Element = typename Tr::Element;
  using In = typename Tr::In;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  int seqlen_q = a.seqlen_q;
  int seqlen_k = a.seqlen_k;
  long long q_start = 0;  // varlen: the sequence's first row in the packed Q and O
  long long k_start = 0;  // ... and in the packed K and V
  if constexpr (Tr::kVarlen) {
    q_start = a.var.cu_seqlens_q[batch];
    k_start = a.var.cu_seqlens_k[batch];
    seqlen_q = a.var.cu_seqlens_q[batch + 1] - static_cast<int>(q_start);
    seqlen_k = a.var.cu_seqlens_k[batch + 1] - static_cast<int>(k_start);
    if (m_block * kBlockM >= seqlen_q) return;  // the grid is sized by the longest sequence
  }
  const int kv_head = head / (a.heads_q / a.heads_kv);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();

  // Row 0 of this (batch, head) in each tensor (64-bit offsets). The outputs' are formed
  // where they are written, so that they hold no registers across the main loop.
  const In* q_bh = a.q + (Tr::kVarlen ? q_start * a.q_row_stride : batch * a.q_batch_stride) +
                   head * a.q_head_stride;
  const In* k_bh = a.k + (Tr::kVarlen ? k_start * a.k_row_stride : batch * a.k_batch_stride) +
                   kv_head * a.k_head_stride;
  const In* v_bh = a.v + (Tr::kVarlen ? k_start * a.v_row_stride : batch * a.v_batch_stride) +
                   kv_head * a.v_head_stride;
  auto o_rows = [&]() {
    return a.o + (Tr::kVarlen ? q_start * a.o_row_stride : batch * a.o_batch_stride) +
           head * a.o_head_stride;
  };
  auto lse_rows = [&]() {
    if constexpr (Tr::kVarlen) return a.lse + static_cast<long long>(head) * a.seqlen_q + q_start;
    return a.lse + (static_cast<long long>(batch) * a.heads_q + head) * seqlen_q;
  };

  // Keys [n_begin, n_end) are visible to some row of the block; the causal diagonal is
  // aligned to the bottom-right corner: row i sees key j iff j <= i + seqlen_k - seqlen_q
  // (local: iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right).
  const int m0 = m_block * kBlockM;
  const int m_end = seqlen_q < m0 + kBlockM ? seqlen_q : m0 + kBlockM;
  int n_end = seqlen_k;
  // Keys [n_full_begin, n_full) are visible to every row of the block: tiles inside need no
  // mask.
  int n_full = seqlen_k;
  int n_begin = 0;
  int n_full_begin = 0;
  int right = 0;
  int left = 0;
  if constexpr (Tr::kCausal || Tr::kLocal) {
    if constexpr (Tr::kLocal) {
      right = a.var.right(seqlen_q);
      left = a.var.left(seqlen_k);
    }
    const int last_row_end = m_end + seqlen_k - seqlen_q + right;
    const int first_row_end = m0 + 1 + seqlen_k - seqlen_q + right;
    n_end = last_row_end < n_end ? last_row_end : n_end;
    n_full = first_row_end < n_full ? first_row_end : n_full;
  }
  if constexpr (Tr::kLocal) {
    const int first_row_begin = m0 + seqlen_k - seqlen_q - left;
    const int last_row_begin = m_end - 1 + seqlen_k - seqlen_q - left;
    n_begin = first_row_begin > 0 ? first_row_begin : 0;
    n_full_begin = last_row_begin > 0 ? last_row_begin : 0;
  }
  // A block mask's full key tiles [full_lo, full_hi): no mask evaluated there.
  [[maybe_unused]] int full_lo = 0;
  [[maybe_unused]] int full_hi = 0;
  if constexpr (Tr::Mods::kTileRanges) {
    // A block mask's hook (api.block_mask): only key tiles [lo, hi) hold a key some row of
    // this query tile sees; the others are never loaded or computed.
    int lo = 0;
    int hi = 0;
    a.mods.tile_range(batch, head, m_block, lo, hi, full_lo, full_hi);
    n_begin = n_begin > lo * kBlockN ? n_begin : lo * kBlockN;
    n_end = n_end < hi * kBlockN ? n_end : hi * kBlockN;
  }
  if (n_end <= n_begin) {  // no row of the block sees any key
    store_empty_rows<ORows<Tr>>(o_rows(), a.o_row_stride, lse_rows(), m0, seqlen_q, tid);
    if constexpr (Tr::kSinks) {  // the sink alone: LSE = sink (O stays 0); the rows are
      // this thread's own of the loop above, so its +inf is overwritten in order
      float* const lse_bh = lse_rows();
      for (int r = tid; r < kBlockM; r += Tr::kThreads) {
        if (m0 + r < seqlen_q) lse_bh[m0 + r] = a.var.sinks[head];
      }
    }
    return;
  }
  const int n_tiles = (n_end + kBlockN - 1) / kBlockN;
  // Tiles from first_masked_tile up reach past n_full.
  int first_masked_tile = n_full <= 0 ? 0 : n_full / kBlockN;
  if constexpr (Tr::Mods::kTileRanges) {
    if (first_masked_tile < n_begin / kBlockN) first_masked_tile = n_begin / kBlockN;
  }

  Element* const sq = reinterpret_cast<Element*>(smem);  // Q's rows; O's at the end
  In* const sq_in = reinterpret_cast<In*>(smem);
  const int warp_row0 = warp * Tr::kWarpRows;
  int tile = n_tiles - 1;
  // qk_scale: the softmax scale of the raw Q K^T, so that softcap, ALiBi and the score
  // modifications all see the scores of the dequantised Q and K (FP8: times this batch and
  // KV head's descale factors); unit: the scale the softmax applies to the transformed
  // scores (the cap with softcap, whose tanh already took qk_scale).
  float qk_scale = a.softmax_scale;
  if constexpr (Tr::kFp8) {
    const int bh = batch * a.heads_kv + kv_head;
    qk_scale *= a.scales.q[bh] * a.scales.k[bh];
  }
  const float unit = Tr::kSoftcap ? a.var.softcap : qk_scale;
  FwdMainloop<Tr> loop{sq_in + Tr::kKOffset,
                       sq + Tr::kVOffset,
                       {},
                       LaneOffsets<Tr>(lane),
                       TileStream<InRows<Tr>>(k_bh, a.k_row_stride, tile, tid),
                       VStream<Tr>(v_bh, a.v_row_stride, tile, tid),
                       tid,
                       0,
                       unit * 1.44269504088896340736f,
                       {},
                       {},
                       {},
                       {}};
  if constexpr (Tr::kLocal || Tr::Mods::kTileRanges) loop.low_tile = n_begin / kBlockN;
  if constexpr (Tr::kSoftcap) loop.transform.tanh_scale = qk_scale / a.var.softcap;
  if constexpr (Tr::kAlibi) {
    loop.transform.neg_slope = -a.var.alibi_slopes[batch * a.var.alibi_batch_stride + head] / unit;
  }
  if constexpr (Tr::Mods::kOn) {
    loop.transform.mods = a.mods;
    loop.transform.unit = unit;
    loop.transform.inv_unit = 1.0f / unit;
    loop.transform.row0 = m0 + warp_row0 + lane / 4;
    loop.transform.col_lane = 2 * (lane % 4);
    loop.transform.batch = batch;
    loop.transform.head = head;
    loop.transform.full_begin = full_lo * kBlockN;
    loop.transform.full_end = full_hi * kBlockN;
  }
  if constexpr (Tr::kDropout) {
    loop.dropout.site.init(a.var.dropout_seed, a.var.dropout_offset, a.var.dropout_p);
    loop.dropout.site.at(loop.dropout.site.stream, batch, a.heads_q, head);
    loop.dropout.row0 = m0 + warp_row0 + lane / 4;
    loop.dropout.col_lane = 2 * (lane % 4);
  }
  loop.q.rows = sq_in + Tr::Smem::offset(warp_row0, 0);
  const int first_rows = seqlen_k - tile * kBlockN;
  loop.prologue(sq_in, q_bh, a.q_row_stride, m0, seqlen_q, tile, first_rows);
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < Tr::kOTiles; ++dt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) loop.acc_o[mt][dt][i] = 0.0f;
    }
  }

  loop.limits.init(m0 + warp_row0, seqlen_q, seqlen_k, lane, right, left);
  loop.template step<true, true>(tile, first_rows);
  --tile;
  if constexpr (Tr::kLocal) {
    // Down from the top: tiles crossing the right edge of some row's window, tiles every
    // row sees whole, tiles crossing the left edge (down to the lowest visible one). When
    // the window is narrower than the block, the middle run is empty.
    const int low = loop.low();
    const int left_masked_end = (n_full_begin + kBlockN - 1) / kBlockN;
    for (; tile >= low && tile >= first_masked_tile; --tile) loop.template step<false, true>(tile);
    for (; tile >= low && tile >= left_masked_end; --tile) loop.template step<false, false>(tile);
    for (; tile >= low; --tile) loop.template step<false, true>(tile);
  } else if constexpr (Tr::kCausal) {
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
  if constexpr (Tr::kLocal) {
    // every tile was walked above
  } else if constexpr (Tr::kPipelined) {
    for (; tile >= loop.low() + 1; --tile) loop.template step<false, false, Next::kAlways>(tile);
    if (tile == loop.low()) loop.template step<false, false, Next::kNever>(tile);
  } else {
    for (; tile >= loop.low(); --tile) loop.template step<false, false>(tile);
  }
  cp_async_wait_all();  // only empty groups remain; leave none behind

  // Epilogue. Every warp passed the last barrier after its last read of Q, and only this
  // warp reads its own Q rows, so they are free to stage this warp's output rows.
  float inv_sum[Tr::kMTiles][2];
  float row_lse[Tr::kMTiles][2];
  if constexpr (Tr::kSinks) {
    finalize_with_sink(loop.softmax, sink_log2_of(a.var.sinks, head), inv_sum, row_lse);
  } else {
    loop.softmax.finalize(inv_sum, row_lse);
  }
  if constexpr (Tr::kDropout) loop.dropout.scale_rows(inv_sum);  // kept P: 1 / (1 - p)
  if constexpr (Tr::kFp8) {  // O of the dequantised V
    const float v_descale = a.scales.v[batch * a.heads_kv + kv_head];
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
      inv_sum[mt][0] *= v_descale;
      inv_sum[mt][1] *= v_descale;
    }
  }
  // O wider than Q's rows (WithHeadDimV) is staged across the rows of every warp.
  if constexpr (Tr::kSplitV && Tr::kOStageSync) block_sync();
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
        *reinterpret_cast<unsigned*>(sq + Tr::OSmem::offset(warp_row0 + r, dt) + 2 * t) =
            Tr::Ops::pack(loop.acc_o[mt][dt][2 * h] * inv_sum[mt][h],
                          loop.acc_o[mt][dt][2 * h + 1] * inv_sum[mt][h]);
      }
      const int row = m0 + warp_row0 + r;
      if (t == 0 && row < seqlen_q) lse_bh[row] = row_lse[mt][h];
    }
  }
  warp_sync();
  store_warp_rows<ORows<Tr>>(o_rows(), a.o_row_stride, sq, warp_row0, m0, seqlen_q, lane);
}

// The kernel: maps the launch grid to tiles (kOrder, kPersistent) and runs fwd_tile.
template <class Tr, BlockOrder kOrder = BlockOrder::kPlain, bool kPersistent = false>
__device__ __forceinline__ void flash_fwd(const FwdParamsOf<Tr>& a) {
  static_assert(!(kPersistent && kOrder == BlockOrder::kHeadsInner),
                "a persistent block walks the query blocks of one head: plain or "
                "longest-first order");
  FT_DYNAMIC_SMEM(unsigned char, smem);
  zero_pad_columns<Tr>(reinterpret_cast<typename Tr::Element*>(smem),
                       static_cast<int>(threadIdx.x));
  const int m_blocks = ((Tr::kVarlen ? a.var.max_seqlen_q : a.seqlen_q) + Tr::kBlockM - 1) /
                       Tr::kBlockM;
  if constexpr (kPersistent) {
    const int head = static_cast<int>(blockIdx.y);
    const int batch = static_cast<int>(blockIdx.z);
    for (int i = static_cast<int>(blockIdx.x); i < m_blocks;
         i += static_cast<int>(gridDim.x)) {
      const int m_block = kOrder == BlockOrder::kLongestFirst ? m_blocks - 1 - i : i;
      fwd_tile<Tr>(a, m_block, head, batch, smem);
      block_sync();  // every warp is done with shared memory before the next tile's copies
      if constexpr (Tr::kSplitV) {
        // O's staging (V's columns) may have written pad columns of Q, K or V rows; the next
        // tile's first barrier orders these zeros before any read.
        zero_pad_columns<Tr>(reinterpret_cast<typename Tr::Element*>(smem),
                             static_cast<int>(threadIdx.x));
      }
    }
  } else if constexpr (kOrder == BlockOrder::kHeadsInner) {
    // The grid has m_blocks x heads_q x batch blocks; re-split its linear index.
    const int heads = static_cast<int>(gridDim.y);
    const long long linear =
        blockIdx.x + static_cast<long long>(gridDim.x) *
                         (blockIdx.y + static_cast<long long>(gridDim.y) * blockIdx.z);
    const int head = static_cast<int>(linear % heads);
    const long long rest = linear / heads;
    fwd_tile<Tr>(a, static_cast<int>(rest % m_blocks), head,
                 static_cast<int>(rest / m_blocks), smem);
  } else {
    const int x = static_cast<int>(blockIdx.x);
    fwd_tile<Tr>(a, kOrder == BlockOrder::kLongestFirst ? m_blocks - 1 - x : x,
                 static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z), smem);
  }
}

}  // namespace ft
