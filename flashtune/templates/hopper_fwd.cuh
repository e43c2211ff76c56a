// FlashAttention forward pass for sm_90a on wgmma: one consumer warpgroup (128 threads) per
// 64 query rows of one (batch, head); kBlockM = 64, 128 or 192 (1 to 3 warpgroups per block).
//
// Per block: Q (kBlockM x D) and a ring of kStages K and V tiles (kBlockN x D and kBlockN x
// Dv, V's head dim: HopperFwdTraits' HeadDimV, D unless split) live in
// shared memory in the 128-byte-swizzled layout wgmma's descriptors read (panels of 64
// columns: row r of a panel is 128 bytes at r * 128, its 16-byte chunk c at c ^ (r % 8)).
// Every thread copies its share of each tile with cp.async and arrives on the stage's full
// mbarrier with cp.async.mbarrier.arrive.noinc (count: all threads), so the phase completes
// once every copy of the tile has landed; each thread waits for it, computes, and arrives on
// the stage's empty mbarrier (count: all threads) when its warpgroup's wgmma reads of the
// stage are complete; a stage is refilled only after its empty phase completed. Q lands with
// the first tile's phase.
//
// Per key tile, in each warpgroup: S = Q K^T by wgmma with both operands in shared memory
// (K-major, D / 16 k-steps of m64 n kBlockN k16), the online softmax of the mma.sync forward
// (softmax.cuh: the wgmma accumulator layout is the m16n8 C pattern repeated over the
// columns, so its fragments serve as they are), P packed from the S accumulators into the
// register-A layout (the same map with N = 16), and O += P V by wgmma with A from registers
// and V from shared memory as an MN-major operand (kBlockN / 16 k-steps of m64 n D k16).
//
// Masking, block order (key tiles from the last one down), GQA, the LSE and the argument list
// are those of the mma.sync forward (flash_fwd.cuh): Q, O (batch, seqlen_q, heads_q, D);
// K, V (batch, seqlen_k, heads_kv, D); strides in elements, last dim contiguous, base pointers
// 16-byte aligned, strides multiples of 8; LSE contiguous float32 (batch, heads_q, seqlen_q);
// the causal diagonal aligned to the bottom-right corner.
//
// FT_HOPPER_PLANTED_BUG (tests only; 0 in every rendered kernel) plants one bug for the
// emulator's tests: 1 the K and V descriptors step over panels of a power-of-two number of
// rows (the next one from kBlockN) instead of kBlockN's.
#pragma once

#include "dropout.cuh"
#include "flash_fwd.cuh"  // FwdParams (the same arguments) and softmax.cuh
#include "mbarrier.cuh"
#include "sinks.cuh"
#include "wgmma.cuh"

#ifndef FT_HOPPER_PLANTED_BUG
#define FT_HOPPER_PLANTED_BUG 0
#endif

namespace ft {

// Compile-time shape of one variant. The fields named like FwdTraits' are the ones
// softmax.cuh reads (one 16-row m tile per warp).
template <typename Element_, bool IsBf16, int HeadDim, int BlockM, int BlockN, int Stages,
          bool Causal, bool WarpSpecialized = false, bool PingPong = false,
          bool Overlap = false, bool Local = false, bool Softcap = false, bool Alibi = false,
          bool Varlen = false, bool Sinks = false, class Mods_ = NoScoreMods,
          int HeadDimV = HeadDim>
struct HopperFwdTraits {
  using Element = Element_;
  using Ops = TensorOps<Element>;
  // Declared score modifications (codegen.score_mods' functor; ScoreTransform applies them
  // to every tile's scores, a mask as -inf). A block mask's tile ranges (Mods::kTileRanges)
  // narrow each block's key range (clip_to_block_mask); its mask is evaluated only on the
  // walked tiles that are not full.
  using Mods = Mods_;
  static constexpr bool kBf16 = IsBf16;
  static constexpr int kHeadDim = HeadDim;
  // V's and O's head dim (P V's N, O's accumulators and stores); Q/K's unless split
  // (DeepSeek's 192 / 128, or Q/K 512 or 576 beside V's column chunk of at most 256).
  static constexpr int kHeadDimV = HeadDimV;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kStages = Stages;
  static constexpr bool kCausal = Causal;
  // The attention features, with the mma.sync forward's meaning (fwd_traits.cuh): a sliding
  // window (key tiles outside every row's window never loaded, those crossing an edge
  // masked), softcap and ALiBi (softmax.cuh's ScoreTransform), varlen (packed sequences,
  // VariantArgs' cu_seqlens) and sinks (sinks.cuh). softmax.cuh's masks read kLocal.
  static constexpr bool kLocal = Local;
  static constexpr bool kSoftcap = Softcap;
  static constexpr bool kAlibi = Alibi;
  static constexpr bool kVarlen = Varlen;
  static constexpr bool kSinks = Sinks;
  static constexpr bool kTransformed = Softcap || Alibi || Mods::kOn;
  static constexpr bool kDropout = false;  // on in WithDropout<...> (dropout.cuh)
  static constexpr int kWarpGroups = BlockM / 64;  // consumer warpgroups (the math)
  // hopper_fwd_ws.cuh adds a producer warpgroup (warps 0..3) in front of them.
  static constexpr bool kWarpSpecialized = WarpSpecialized;
  // Ping-pong: the two consumer warpgroups take turns to issue their Q K^T (named barriers).
  static constexpr bool kPingPong = PingPong;
  // Intra-warpgroup overlap (hopper_fwd_ws.cuh): Q K^T of key tile j is issued with P V of
  // tile j - 1 and the softmax of tile j runs while P V does (one S set plus P).
  static constexpr bool kOverlap = Overlap;
  static constexpr int kThreads = 128 * (kWarpGroups + (WarpSpecialized ? 1 : 0));
  static constexpr int kMTiles = 1;                 // 16 rows per warp
  static constexpr int kSTiles = BlockN / 8;        // n8 column blocks of S
  static constexpr int kPvSteps = BlockN / 16;      // k16 steps of P V
  static constexpr int kOTiles = HeadDimV / 8;      // n8 column blocks of O
  static constexpr int kQkSteps = HeadDim / 16;     // k16 steps of Q K^T
  static constexpr int kPanels = HeadDim / 64;      // 128-byte panels of a row
  static constexpr int kChunks = HeadDim / 8;       // 16-byte chunks of a Q or K row
  static constexpr int kOChunks = HeadDimV / 8;     // 16-byte chunks of a V or O row
  // Byte offsets from the 1024-byte-aligned base of the tiles.
  static constexpr int kTileBytes = BlockN * HeadDim * 2;    // a K stage
  static constexpr int kVTileBytes = BlockN * HeadDimV * 2;  // a V stage
  static constexpr int kQBytes = BlockM * HeadDim * 2;
  static constexpr int kKOffset = kQBytes;
  static constexpr int kVOffset = kKOffset + Stages * kTileBytes;
  static constexpr int kBarOffset = kVOffset + Stages * kVTileBytes;
  // Tiles, the 2 x kStages barriers (a Q barrier more when warp-specialised), and up to 1023
  // bytes to align the base.
  static constexpr int kSmemBytes = kBarOffset + 16 * Stages + (WarpSpecialized ? 8 : 0) + 1024;

  // Whole 128-byte panels; Q/K's up to 576 (its rows live in shared memory only), V's up to
  // 256 (O's accumulators and the N of P V's wgmma).
  static_assert(HeadDim % 64 == 0 && HeadDim <= 576, "Q/K's head dim: 64 to 576, whole panels");
  static_assert(HeadDimV % 64 == 0 && HeadDimV <= 256, "V's head dim: 64 to 256, whole panels");
  static_assert(BlockM == 64 || BlockM == 128 || BlockM == 192,
                "block_m: 64, 128 or 192 (one to three warpgroups of 64 rows)");
  // block_n is the N of Q K^T's wgmma and a multiple of P V's k16 steps, of the 8 rows of a
  // 128B swizzle pattern, and a TMA box of at most 256 rows (32 and 48: the narrow key
  // tiles of Q/K head dims above 256, whose K stages fill shared memory).
  static_assert(BlockN % 16 == 0 && BlockN >= 32 && BlockN <= 256,
                "block_n: a multiple of 16 in 32..256");
  static_assert(Stages >= 1 && Stages <= 4, "stages: 1..4");
  // The next tile's K is read while this tile's stage is still in use.
  static_assert(!Overlap || (WarpSpecialized && Stages >= 2),
                "overlap: the warp-specialised kernel with two or more stages");
  // Rows of a 128-byte panel of the K and V tiles: the descriptors' stride between panels.
  static constexpr int kPanelRows = FT_HOPPER_PLANTED_BUG != 1 ? BlockN
                                    : BlockN <= 32                ? 32
                                    : BlockN <= 64                ? 64
                                    : BlockN <= 128               ? 128
                                                                  : 256;

  // Byte offset of 16-byte chunk c of row r in a swizzled tile of `rows` rows.
  static __device__ __forceinline__ int chunk_offset(int rows, int r, int c) {
    return (c / 8) * rows * 128 + r * 128 + (((c % 8) ^ (r % 8)) * 16);
  }
};

// The copy view (load_tile's) of V's rows in the same swizzled layout: V's 16-byte chunks,
// which differ from Tr's (Q's and K's) where the head dims are split.
template <class Tr>
struct HopperVRows {
  using Element = typename Tr::Element;
  static constexpr int kChunks = Tr::kOChunks;
  static __device__ __forceinline__ int chunk_offset(int rows, int r, int c) {
    return Tr::chunk_offset(rows, r, c);
  }
};

// Copies rows [0, rows) of a tile of kRows rows from global memory into the swizzled layout
// with cp.async, shared by kThreads threads (tid: 0 .. kThreads - 1); rows at and past
// `valid` are zero-filled.
template <class Tr, int kRows, int kThreads = Tr::kThreads>
__device__ __forceinline__ void load_tile(unsigned char* dst, const typename Tr::Element* src,
                                          long long row_stride, int valid, int tid) {
  // A thread keeps its chunk column and steps over rows: less address arithmetic per copy
  // (the producer warpgroup has few registers). Rows of 24 or 72 chunks (head dims 192 and
  // 576) do not divide the threads: each thread then steps over the tile's chunks in
  // row-major order.
  if constexpr (kThreads % Tr::kChunks != 0) {
#pragma unroll 1
    for (int idx = tid; idx < kRows * Tr::kChunks; idx += kThreads) {
      const int r = idx / Tr::kChunks;
      const int c = idx % Tr::kChunks;
      const bool in = r < valid;
      const typename Tr::Element* from = src + (in ? r * row_stride : 0) + c * 8;
      cp_async<16>(dst + Tr::chunk_offset(kRows, r, c), from, in ? 16 : 0);
    }
  } else {
    constexpr int kRowsPerPass = kThreads / Tr::kChunks;
    const int c = tid % Tr::kChunks;
#pragma unroll 1
    for (int r = tid / Tr::kChunks; r < kRows; r += kRowsPerPass) {
      const bool in = r < valid;
      // An out-of-range row reads nothing (size 0); its address stays inside the tensor.
      const typename Tr::Element* from = src + (in ? r * row_stride : 0) + c * 8;
      cp_async<16>(dst + Tr::chunk_offset(kRows, r, c), from, in ? 16 : 0);
    }
  }
}

// O = 0 and LSE = lse_value for rows [row0, min(row0 + kBlockM, seqlen_q)): rows that see no
// key (+inf; with sinks the head's sink, the LSE of the sink alone).
template <class Tr>
__device__ __forceinline__ void store_unseen_rows(typename Tr::Element* o, long long row_stride,
                                                  float* lse, int row0, int seqlen_q, int tid,
                                                  float lse_value) {
  for (int idx = tid; idx < Tr::kBlockM * Tr::kOChunks; idx += Tr::kThreads) {
    const int r = row0 + idx / Tr::kOChunks;
    if (r < seqlen_q) {
      uint4 zero;
      zero.x = zero.y = zero.z = zero.w = 0u;
      *reinterpret_cast<uint4*>(o + r * row_stride + (idx % Tr::kOChunks) * 8) = zero;
    }
  }
  for (int r = row0 + tid; r < row0 + Tr::kBlockM; r += Tr::kThreads) {
    if (r < seqlen_q) lse[r] = lse_value;
  }
}

// Whether a step is the block's first tile (no rescale of the all-zero O), as a type.
template <bool kFirst>
struct FirstTile {
  static constexpr bool value = kFirst;
};

// Keys [n_begin, n_end) are visible to some row of the query block m0.., [n_full_begin,
// n_full) to all of them (the causal diagonal and the window aligned to the bottom-right
// corner: row i sees key j iff i + Nk - Nq - left <= j <= i + Nk - Nq + right; causal alone
// is right 0 with no left edge). The block walks `count` key tiles from tile n_tiles - 1
// down to tile `low` (the lowest one with a visible key: tiles below every row's window are
// never loaded), masking those from first_masked_tile up (the right edge and the tail) and,
// with a window, those below left_masked_end (the left edge); the tiles between run
// unmasked. A block mask's full key tiles are keys [full_begin, full_end) (else empty).
struct KeyRange {
  int n_begin;
  int n_end;
  int n_tiles;
  int low;
  int count;
  int first_masked_tile;
  int left_masked_end;
  int full_begin;
  int full_end;
};

// right, left: the window's clamped sizes (VariantArgs::right, left; unused without one).
template <class Tr>
__device__ __forceinline__ KeyRange key_range(int m0, int seqlen_q, int seqlen_k, int right,
                                              int left) {
  const int m_end = seqlen_q < m0 + Tr::kBlockM ? seqlen_q : m0 + Tr::kBlockM;
  int n_end = seqlen_k;
  int n_full = seqlen_k;
  int n_begin = 0;
  int n_full_begin = 0;
  if constexpr (Tr::kCausal || Tr::kLocal) {
    const int reach = Tr::kLocal ? right : 0;
    const int last_row_end = m_end + seqlen_k - seqlen_q + reach;
    const int first_row_end = m0 + 1 + seqlen_k - seqlen_q + reach;
    n_end = last_row_end < n_end ? last_row_end : n_end;
    n_full = first_row_end < n_full ? first_row_end : n_full;
  }
  if constexpr (Tr::kLocal) {
    const int first_row_begin = m0 + seqlen_k - seqlen_q - left;
    const int last_row_begin = m_end - 1 + seqlen_k - seqlen_q - left;
    n_begin = first_row_begin > 0 ? first_row_begin : 0;
    n_full_begin = last_row_begin > 0 ? last_row_begin : 0;
  }
  KeyRange r;
  r.n_begin = n_begin;
  r.n_end = n_end;
  r.n_tiles = (n_end + Tr::kBlockN - 1) / Tr::kBlockN;
  r.low = n_begin / Tr::kBlockN;
  r.count = r.n_tiles - r.low;
  r.first_masked_tile = n_full <= 0 ? 0 : n_full / Tr::kBlockN;
  r.left_masked_end = (n_full_begin + Tr::kBlockN - 1) / Tr::kBlockN;
  r.full_begin = 0;
  r.full_end = 0;
  return r;
}

// A block mask's hook (api.block_mask) on query block m_block of (batch, head): only its key
// tiles [lo, hi) hold a key some row sees, so the range is narrowed to them (the producer
// never loads the others and the consumers never compute them); its full tiles
// [full_lo, full_hi) are where the mask is not evaluated (softmax.cuh's ScoreTransform).
template <class Tr>
__device__ __forceinline__ void clip_to_block_mask(KeyRange& r, const typename Tr::Mods& mods,
                                                   int batch, int head, int m_block) {
  int lo = 0, hi = 0, full_lo = 0, full_hi = 0;
  mods.tile_range(batch, head, m_block, lo, hi, full_lo, full_hi);
  // In tiles first: a range may reach past the keys (a tile count times kBlockN could
  // overflow).
  if (hi > r.n_tiles) hi = r.n_tiles;
  if (full_hi > hi) full_hi = hi;
  if (lo >= hi) {
    r.n_begin = r.n_end;  // no key tile: the block's rows see none (HopperBlock::unseen)
  } else {
    if (r.n_begin < lo * Tr::kBlockN) r.n_begin = lo * Tr::kBlockN;
    if (r.n_end > hi * Tr::kBlockN) r.n_end = hi * Tr::kBlockN;
  }
  r.n_tiles = (r.n_end + Tr::kBlockN - 1) / Tr::kBlockN;
  r.low = r.n_begin / Tr::kBlockN;
  r.count = r.n_tiles - r.low;
  r.full_begin = full_lo * Tr::kBlockN;
  r.full_end = full_hi * Tr::kBlockN;
}

// Calls step(j, FirstTile, mask) for j = 0 .. count - 1 (key tile n_tiles - 1 - j) with the
// mask each tile needs: the first one masked, then those crossing the causal diagonal or
// the window's right edge, then none, then (window) those crossing its left edge.
template <class Tr, class Step>
__device__ __forceinline__ void for_each_key_tile(const KeyRange& range,
                                                  const RowLimits<Tr>& limits, Step&& step) {
  constexpr bool kEdge = Tr::kCausal || Tr::kLocal;
  const int n_tiles = range.n_tiles;
  const int count = range.count;
  step(0, FirstTile<true>{}, TileMask<Tr, true, kEdge>(limits, (n_tiles - 1) * Tr::kBlockN));
  int j = 1;
  if constexpr (kEdge) {
    for (; j < count && n_tiles - 1 - j >= range.first_masked_tile; ++j)
      step(j, FirstTile<false>{}, TileMask<Tr, false, true>(limits, (n_tiles - 1 - j) * Tr::kBlockN));
  }
  if constexpr (Tr::kLocal) {
    for (; j < count && n_tiles - 1 - j >= range.left_masked_end; ++j)
      step(j, FirstTile<false>{}, NoMask{});
    for (; j < count; ++j)
      step(j, FirstTile<false>{}, TileMask<Tr, false, true>(limits, (n_tiles - 1 - j) * Tr::kBlockN));
  } else {
    for (; j < count; ++j) step(j, FirstTile<false>{}, NoMask{});
  }
}

// The schedule of a warpgroup's GEMMs: whether it waits for its turn before issuing Q K^T
// and hands the turn on once it is issued (the ping-pong schedule of hopper_fwd_ws.cuh).
struct FreeSchedule {
  __device__ __forceinline__ void before_qk() const {}
  __device__ __forceinline__ void after_qk() const {}
};

// S = Q K^T for the calling warpgroup by wgmma (both operands in shared memory, K-major) into
// s_view, in one commit group it does not wait for. q_addr, k_addr: shared-window addresses
// of this warpgroup's 64 Q rows and of the stage's K tile.
template <class Tr, class Schedule>
__device__ __forceinline__ void issue_qk(unsigned q_addr, unsigned k_addr,
                                         float (&s_view)[Tr::kBlockN / 2],
                                         const Schedule& schedule) {
  // Each operand's descriptor is built once; a k-step moves it by a constant.
  const unsigned long long q_desc = wgmma_desc(q_addr, 16, 1024, kSwizzle128B);
  const unsigned long long k_desc = wgmma_desc(k_addr, 16, 1024, kSwizzle128B);
  schedule.before_qk();
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < Tr::kQkSteps; ++ks) {
    const unsigned off = (ks % 4) * 32;
    wgmma_ss<Tr::kBlockN, Tr::kBf16, false, false>(
        s_view, wgmma_desc_add(q_desc, (ks / 4) * Tr::kBlockM * 128 + off),
        wgmma_desc_add(k_desc, (ks / 4) * Tr::kPanelRows * 128 + off), ks > 0);
  }
  wgmma_commit();
  schedule.after_qk();
}

// O += P V by wgmma (A = P from registers, V MN-major at v_addr, the stage's V tile) in one
// commit group it does not wait for.
template <class Tr>
__device__ __forceinline__ void issue_pv(unsigned v_addr,
                                         const unsigned (&p)[1][Tr::kPvSteps][4],
                                         float (&acc_o)[1][Tr::kOTiles][4]) {
  // wgmma view of the fragments: d[4 nt + e] is fragment element [nt][e].
  auto& o_view = reinterpret_cast<float(&)[Tr::kHeadDimV / 2]>(acc_o);
  const unsigned long long v_desc = wgmma_desc(v_addr, Tr::kPanelRows * 128, 1024, kSwizzle128B);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Tr::kPvSteps; ++kk) {
    wgmma_rs<Tr::kHeadDimV, Tr::kBf16, true>(o_view, p[0][kk],
                                            wgmma_desc_add(v_desc, kk * 16 * 128), 1);
  }
  wgmma_commit();
}

// What runs on the complete scores of a tile before its softmax: nothing (a plain problem),
// or the score transforms of its features (WarpgroupMath::transform_scores).
struct NoScorePrep {
  template <class S>
  __device__ __forceinline__ void operator()(S&) const {}
};

// What runs on P's packed fragments of a tile before O += P V: nothing, or dropout
// (WarpgroupMath::drop).
struct NoPHook {
  template <class P>
  __device__ __forceinline__ void operator()(P&) const {}
};

// The online softmax of the complete S in acc_s (tied here: a wgmma still writing it is an
// error in the emulator; then prep transforms it) and of O (complete: the caller tied it
// after its last wait), P from the S accumulators, and O += P V (issue_pv) in one commit
// group it does not wait for.
template <class Tr, bool kFirst, class Mask, class Prep = NoScorePrep, class PHook = NoPHook>
__device__ __forceinline__ void softmax_issue_pv(unsigned v_addr, float (&acc_s)[1][Tr::kSTiles][4],
                                                 OnlineSoftmax<Tr>& softmax,
                                                 float (&acc_o)[1][Tr::kOTiles][4],
                                                 float scale_log2, const Mask& mask,
                                                 const Prep& prep = {}, const PHook& p_hook = {}) {
  wgmma_fence_operands(reinterpret_cast<float(&)[Tr::kBlockN / 2]>(acc_s));
  prep(acc_s);
  unsigned p[1][Tr::kPvSteps][4];
  softmax.template update<kFirst>(acc_s, p, acc_o, scale_log2, mask);
  p_hook(p);
  issue_pv<Tr>(v_addr, p, acc_o);
}

// One key tile for the calling warpgroup: S = Q K^T, the online softmax, P and O += P V, each
// GEMM waited for before its result is read (q_addr, k_addr, v_addr: this warpgroup's Q rows
// and the stage's K and V tiles).
template <class Tr, bool kFirst, class Mask, class Schedule = FreeSchedule,
          class Prep = NoScorePrep, class PHook = NoPHook>
__device__ __forceinline__ void tile_math(unsigned q_addr, unsigned k_addr, unsigned v_addr,
                                          OnlineSoftmax<Tr>& softmax,
                                          float (&acc_o)[1][Tr::kOTiles][4], float scale_log2,
                                          const Mask& mask, const Schedule& schedule = {},
                                          const Prep& prep = {}, const PHook& p_hook = {}) {
  float acc_s[1][Tr::kSTiles][4];
  issue_qk<Tr>(q_addr, k_addr, reinterpret_cast<float(&)[Tr::kBlockN / 2]>(acc_s), schedule);
  wgmma_wait<0>();
  softmax_issue_pv<Tr, kFirst>(v_addr, acc_s, softmax, acc_o, scale_log2, mask, prep, p_hook);
  wgmma_wait<0>();
  wgmma_fence_operands(reinterpret_cast<float(&)[Tr::kHeadDimV / 2]>(acc_o));
}

// Epilogue of one warp (query rows row0 .. row0 + 15): O / row sum and the natural-log LSE,
// straight from the accumulators; with sinks (Tr::kSinks) the head's sink sink_log2 joins
// each row's denominator.
template <class Tr>
__device__ __forceinline__ void store_rows(OnlineSoftmax<Tr>& softmax,
                                           const float (&acc_o)[1][Tr::kOTiles][4],
                                           typename Tr::Element* o_bh, long long o_row_stride,
                                           float* lse_bh, int row0, int seqlen_q, int lane,
                                           float sink_log2 = 0.0f, float kept_scale = 1.0f) {
  float inv_sum[1][2];
  float row_lse[1][2];
  if constexpr (Tr::kSinks) finalize_with_sink(softmax, sink_log2, inv_sum, row_lse);
  else softmax.finalize(inv_sum, row_lse);
  inv_sum[0][0] *= kept_scale;  // dropout: the kept elements' 1 / (1 - p)
  inv_sum[0][1] *= kept_scale;
  const int g = lane / 4;
  const int t = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + g + 8 * h;
    if (row < seqlen_q) {
      typename Tr::Element* o_row = o_bh + row * o_row_stride + 2 * t;
#pragma unroll
      for (int dt = 0; dt < Tr::kOTiles; ++dt) {
        *reinterpret_cast<unsigned*>(o_row + 8 * dt) =
            Tr::Ops::pack(acc_o[0][dt][2 * h] * inv_sum[0][h],
                          acc_o[0][dt][2 * h + 1] * inv_sum[0][h]);
      }
      if (t == 0) lse_bh[row] = row_lse[0][h];
    }
  }
}

// The state of one block both sm_90a kernels share: the tiles from a 1024-byte boundary of
// the shared window (128B swizzle patterns repeat every 1024 bytes), the stage barriers, the
// block's (batch, head) and query rows m0.., and the key range they see. With varlen the
// batch index is the sequence: rows q_start.. of the packed Q and O and k_start.. of K and V
// (the tensor maps' batch coordinate is then 0, tma_batch), its LSE rows q_start.. of the
// head's (heads_q, total rows) slice; the grid is sized by the longest sequence.
template <class Tr>
struct HopperBlock {
  unsigned char* smem;  // the tiles: Q, then kStages K and V tiles, then the barriers
  unsigned base;        // the shared-window address of smem
  unsigned long long* full;   // kStages full barriers, then kStages empty ones
  unsigned long long* empty;
  int tid, lane, warp, head, batch, kv_head, m0, seqlen_q, seqlen_k;
  int q_start, k_start, tma_batch;  // the sequence's first rows (varlen; else 0), map batch
  int right, left;                  // the window's clamped sizes (Tr::kLocal; else 0)
  const typename Tr::Element* q_bh;  // this (batch, head)'s Q and its KV head's K and V
  const typename Tr::Element* k_bh;
  const typename Tr::Element* v_bh;
  typename Tr::Element* o_bh;
  float* lse_bh;
  KeyRange range;

  __device__ __forceinline__ HopperBlock(unsigned char* raw,
                                         const FwdParams<typename Tr::Element>& a,
                                         const typename Tr::Mods& mods = {}) {
    const unsigned window = smem_address(raw);
    const unsigned pad = (1024u - (window & 1023u)) & 1023u;
    smem = raw + pad;
    base = window + pad;
    full = reinterpret_cast<unsigned long long*>(smem + Tr::kBarOffset);
    empty = full + Tr::kStages;
    tid = static_cast<int>(threadIdx.x);
    lane = lane_id();
    warp = warp_id();
    head = static_cast<int>(blockIdx.y);
    batch = static_cast<int>(blockIdx.z);
    kv_head = head / (a.heads_q / a.heads_kv);
    seqlen_q = a.seqlen_q;
    seqlen_k = a.seqlen_k;
    q_start = 0;
    k_start = 0;
    tma_batch = batch;
    long long q_row0 = batch * a.q_batch_stride;
    long long k_row0 = batch * a.k_batch_stride;
    long long v_row0 = batch * a.v_batch_stride;
    long long o_row0 = batch * a.o_batch_stride;
    lse_bh = a.lse + (static_cast<long long>(batch) * a.heads_q + head) * seqlen_q;
    if constexpr (Tr::kVarlen) {
      q_start = a.var.cu_seqlens_q[batch];
      k_start = a.var.cu_seqlens_k[batch];
      seqlen_q = a.var.cu_seqlens_q[batch + 1] - q_start;
      seqlen_k = a.var.cu_seqlens_k[batch + 1] - k_start;
      tma_batch = 0;
      q_row0 = q_start * a.q_row_stride;
      k_row0 = k_start * a.k_row_stride;
      v_row0 = k_start * a.v_row_stride;
      o_row0 = q_start * a.o_row_stride;
      lse_bh = a.lse + static_cast<long long>(head) * a.seqlen_q + q_start;
    }
    q_bh = a.q + q_row0 + head * a.q_head_stride;
    k_bh = a.k + k_row0 + kv_head * a.k_head_stride;
    v_bh = a.v + v_row0 + kv_head * a.v_head_stride;
    o_bh = a.o + o_row0 + head * a.o_head_stride;
    right = Tr::kLocal ? a.var.right(seqlen_q) : 0;
    left = Tr::kLocal ? a.var.left(seqlen_k) : 0;
    m0 = static_cast<int>(blockIdx.x) * Tr::kBlockM;
    range = key_range<Tr>(m0, seqlen_q, seqlen_k, right, left);
    if constexpr (Tr::Mods::kTileRanges) {
      clip_to_block_mask<Tr>(range, mods, batch, head, static_cast<int>(blockIdx.x));
    }
  }

  // Whether no row of the block sees a key (or, varlen, the block is past its sequence);
  // then O = 0 and LSE = +inf (with sinks: the sink) are written (by all threads) and the
  // block is done.
  __device__ __forceinline__ bool unseen(const FwdParams<typename Tr::Element>& a) const {
    if (range.n_end > range.n_begin && m0 < seqlen_q) return false;
    const float lse_value = Tr::kSinks ? a.var.sinks[head] : INFINITY;
    store_unseen_rows<Tr>(o_bh, a.o_row_stride, lse_bh, m0, seqlen_q, tid, lse_value);
    return true;
  }
};

// One warpgroup's side of the math: O, the online softmax state and the row limits of one
// warp (query rows row0 .. row0 + 15 of the warpgroup starting at Q tile row 64 group).
template <class Tr>
struct WarpgroupMath {
  float acc_o[1][Tr::kOTiles][4];
  OnlineSoftmax<Tr> softmax;
  RowLimits<Tr> limits;
  ScoreTransform<Tr> transform;  // softcap, ALiBi (Tr::kTransformed)
  // The dropout of P's fragments (Tr::kDropout): the lane's rows row0 + lane / 4 (+ 8).
  typename detail::Select<Tr::kDropout, FwdDropout<Tr>, NoFwdDropout>::type dropout;
  float scale_log2;
  float sink_log2;  // the head's sink times log2(e) (Tr::kSinks)
  unsigned q_addr;  // this warpgroup's Q rows: k-step ks is 32 bytes into panel ks / 4
  int row0;

  __device__ __forceinline__ WarpgroupMath(const HopperBlock<Tr>& b,
                                           const FwdParams<typename Tr::Element>& a,
                                           int group, int row0_,
                                           const typename Tr::Mods& mods = {}) {
#pragma unroll
    for (int dt = 0; dt < Tr::kOTiles; ++dt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_o[0][dt][i] = 0.0f;
    }
    row0 = row0_;
    limits.init(row0, b.seqlen_q, b.seqlen_k, b.lane, b.right, b.left);
    // The unit the softmax reads transformed scores in: the cap with softcap (whose tanh
    // took the softmax scale), else the softmax scale (softmax.cuh's ScoreTransform).
    const float unit = Tr::kSoftcap ? a.var.softcap : a.softmax_scale;
    scale_log2 = unit * 1.44269504088896340736f;
    if constexpr (Tr::kSoftcap) transform.tanh_scale = a.softmax_scale / a.var.softcap;
    if constexpr (Tr::kAlibi) {
      transform.neg_slope =
          -a.var.alibi_slopes[b.batch * a.var.alibi_batch_stride + b.head] / unit;
    }
    if constexpr (Tr::Mods::kOn) {
      transform.mods = mods;
      transform.unit = unit;
      transform.inv_unit = 1.0f / unit;
      transform.row0 = row0 + b.lane / 4;
      transform.col_lane = 2 * (b.lane % 4);
      transform.batch = b.batch;
      transform.head = b.head;
      if constexpr (Tr::Mods::kTileRanges) {
        transform.full_begin = b.range.full_begin;
        transform.full_end = b.range.full_end;
      }
    }
    sink_log2 = Tr::kSinks ? sink_log2_of(a.var.sinks, b.head) : 0.0f;
    if constexpr (Tr::kDropout) {
      dropout.site.init(a.var.dropout_seed, a.var.dropout_offset, a.var.dropout_p);
      dropout.site.at(dropout.site.stream, b.batch, a.heads_q, b.head);
      dropout.row0 = row0 + b.lane / 4;
      dropout.col_lane = 2 * (b.lane % 4);
    }
    q_addr = b.base + group * 64 * 128;
  }

  // Dropout on P's packed fragments of the key tile at col0 (after the row sums were taken;
  // the kept ones are scaled by 1 / (1 - p) in store).
  __device__ __forceinline__ void drop(unsigned (&p)[1][Tr::kPvSteps][4], int col0) const {
    if constexpr (Tr::kDropout) dropout.apply(p, col0);
  }

  // The score transforms of the features on the complete raw scores of the key tile at
  // col0 (before its mask).
  __device__ __forceinline__ void transform_scores(float (&acc_s)[1][Tr::kSTiles][4],
                                                   int col0) const {
    if constexpr (Tr::kTransformed) transform.apply(acc_s, limits, col0);
  }

  static __device__ __forceinline__ unsigned k_tile(const HopperBlock<Tr>& b, int s) {
    return b.base + Tr::kKOffset + s * Tr::kTileBytes;
  }
  static __device__ __forceinline__ unsigned v_tile(const HopperBlock<Tr>& b, int s) {
    return b.base + Tr::kVOffset + s * Tr::kVTileBytes;
  }

  // Key tile of stage s, starting at key col0 (the tile_math of its K and V).
  template <bool kFirst, class Mask, class Schedule = FreeSchedule>
  __device__ __forceinline__ void tile(const HopperBlock<Tr>& b, int s, int col0,
                                       const Mask& mask, const Schedule& schedule = {}) {
    const auto p_hook = [&](unsigned (&p)[1][Tr::kPvSteps][4]) { drop(p, col0); };
    if constexpr (Tr::kTransformed) {
      const auto prep = [&](float (&acc_s)[1][Tr::kSTiles][4]) { transform_scores(acc_s, col0); };
      tile_math<Tr, kFirst>(q_addr, k_tile(b, s), v_tile(b, s), softmax, acc_o, scale_log2,
                            mask, schedule, prep, p_hook);
    } else {
      tile_math<Tr, kFirst>(q_addr, k_tile(b, s), v_tile(b, s), softmax, acc_o, scale_log2,
                            mask, schedule, NoScorePrep{}, p_hook);
    }
  }

  // The steps of the overlapped schedule (FA3's intra-warpgroup order, hopper_fwd_ws.cuh):
  // S = Q K^T of stage s issued into acc_s, and O += P V of stage s issued (neither waited
  // for).
  template <class Schedule>
  __device__ __forceinline__ void qk(const HopperBlock<Tr>& b, int s,
                                     float (&acc_s)[1][Tr::kSTiles][4], const Schedule& schedule) {
    issue_qk<Tr>(q_addr, k_tile(b, s), reinterpret_cast<float(&)[Tr::kBlockN / 2]>(acc_s),
                 schedule);
  }
  __device__ __forceinline__ void pv(const HopperBlock<Tr>& b, int s,
                                     const unsigned (&p)[1][Tr::kPvSteps][4]) {
    issue_pv<Tr>(v_tile(b, s), p, acc_o);
  }

  __device__ __forceinline__ void store(const HopperBlock<Tr>& b, long long o_row_stride) {
    float kept_scale = 1.0f;
    if constexpr (Tr::kDropout) kept_scale = dropout.site.scale;
    store_rows<Tr>(softmax, acc_o, b.o_bh, o_row_stride, b.lse_bh, row0, b.seqlen_q, b.lane,
                   sink_log2, kept_scale);
  }
};

// The stage ring of a block whose threads all copy (cp.async): kStages full and empty
// mbarriers, each counting all kThreads threads, and load(j), which fills stage j % kStages
// with key tile n_tiles - 1 - j of K and V (the tiles walked from the last one down; rows at
// and past seqlen_k zero-filled). View: the copy traits of a row (load_tile's; Tr itself for
// 16-bit rows), whose Element the K and V pointers and row strides count.
template <class Tr, class View = Tr>
struct CpAsyncRing {
  unsigned char* smem;  // the tiles (Tr's offsets)
  unsigned long long* full;
  unsigned long long* empty;
  const typename View::Element* k;
  const typename View::Element* v;
  long long k_row_stride, v_row_stride;
  int n_tiles, seqlen_k, tid;

  // Thread 0 initialises the barriers; every thread returns once they are published.
  __device__ __forceinline__ void init() const {
    if (tid == 0) {
      for (int s = 0; s < Tr::kStages; ++s) {
        mbarrier_init(&full[s], Tr::kThreads);
        mbarrier_init(&empty[s], Tr::kThreads);
      }
      mbarrier_init_fence();
    }
    block_sync();
  }

  __device__ __forceinline__ void load(int j) const {
    const int tile = n_tiles - 1 - j;
    const int s = j % Tr::kStages;
    const long long row0 = static_cast<long long>(tile) * Tr::kBlockN;
    const int valid = seqlen_k - tile * Tr::kBlockN;
    load_tile<View, Tr::kBlockN>(smem + Tr::kKOffset + s * Tr::kTileBytes,
                                 k + row0 * k_row_stride, k_row_stride, valid, tid);
    load_tile<View, Tr::kBlockN>(smem + Tr::kVOffset + s * Tr::kTileBytes,
                                 v + row0 * v_row_stride, v_row_stride, valid, tid);
    cp_async_mbarrier_arrive(&full[s]);
  }
};

// The block of query rows blockIdx.x * kBlockM.. of head blockIdx.y, batch blockIdx.z.
template <class Tr>
__device__ __forceinline__ void hopper_fwd(const FwdParams<typename Tr::Element>& a) {
  static_assert(Tr::kHeadDimV == Tr::kHeadDim, "the cp.async kernel: V's head dim is Q/K's");
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;
  FT_DYNAMIC_SMEM(unsigned char, raw);
  const HopperBlock<Tr> b(raw, a);
  if (b.unseen(a)) return;
  const int n_tiles = b.range.n_tiles;
  const int count = b.range.count;
  const int tid = b.tid;

  const CpAsyncRing<Tr> ring{b.smem, b.full, b.empty, b.k_bh, b.v_bh, a.k_row_stride,
                             a.v_row_stride, n_tiles, b.seqlen_k, tid};
  ring.init();
  auto load = [&](int j) { ring.load(j); };
  load_tile<Tr, Tr::kBlockM>(b.smem, b.q_bh + b.m0 * a.q_row_stride, a.q_row_stride,
                             b.seqlen_q - b.m0, tid);
  for (int j = 0; j < kStages && j < count; ++j) load(j);

  // Warp w of warpgroup w / 4 owns query rows m0 + 16 w ..
  WarpgroupMath<Tr> math(b, a, b.warp / 4, b.m0 + 16 * b.warp);
  for_each_key_tile<Tr>(b.range, math.limits, [&](int j, auto first, auto mask) {
    const int s = j % kStages;
    mbarrier_wait_parity(&b.full[s], static_cast<unsigned>(j / kStages) & 1u);
    fence_proxy_async();  // the cp.async writes (generic proxy) before wgmma's reads
    math.template tile<decltype(first)::value>(b, s, (n_tiles - 1 - j) * kBlockN, mask);
    mbarrier_arrive(&b.empty[s]);  // this thread's warpgroup has read the stage
    if (j + kStages < count) {
      mbarrier_wait_parity(&b.empty[s], static_cast<unsigned>(j / kStages) & 1u);
      load(j + kStages);
    }
  });
  math.store(b, a.o_row_stride);
}

}  // namespace ft
