// FlashAttention-2 backward pass, main kernel (sm_80 and newer): dK, dV and the float32 dQ
// accumulator from Q, K, V, dO, the forward's LSE and D = rowsum(dO * O).
//
// Grid (x, kv head, batch). Block x handles key tiles x, x + gridDim.x, ... of BlockN keys
// (atomic mode launches one block per key tile; the deterministic mode launches fewer, each
// adding into its own dQ slice in a fixed order). For one key tile the block loads K and V
// once, then steps over every query head of the kv head's group and, within it, over the
// query tiles that can see the keys (causal: from the tile holding the first row at or below
// the diagonal, which is aligned to the bottom-right corner). Q, dO, LSE and D of each step
// stream through NumStages shared buffers (cp.async; with two, the next step's copies overlap
// this step's math). P is recomputed from the LSE: P = exp2(S scale log2(e) - LSE log2(e)),
// zero where masked (so a row that sees no key, LSE = +inf, gives P = 0, never NaN).
// dV += P^T dO with P rounded to the input type; dP = dO V^T; dS = P (dP - D);
// with dropout (dropout.cuh: the forward's mask drawn again), P M / (1 - p) in dV and
// dS = P (dP M / (1 - p) - D);
// dK += dS^T Q; dQ += dS K. dK is scaled by softmax_scale once at the end; dQ is scaled by
// the convert kernel. dK and dV of a kv head sum every query head of its group in float32
// registers, so GQA needs no expanded copies.
//
// Declared score modifications (Mods: the functor codegen.score_mods renders, NoScoreMods
// for none) apply when P is recomputed, and dS carries their slope (Mods::grad); with a
// block mask's column ranges (Mods::kTileRanges: per key tile the query tiles [lo, hi)
// holding a row that sees one of its keys, api.block_mask's columns form) a block walks
// only those query tiles and evaluates the mask only on the partial ones.
//
// FP8 inputs (Tr::kFp8, bwd_traits.cuh WithFp8Inputs; the bwd8 family): Q, K and V are
// e4m3 or e5m2 bytes (strides in values), dequantised exactly into the 16-bit tiles as they
// are loaded (plain loads, not cp.async); dO, dK, dV are 16-bit. The descale factors
// (float32 (batch, heads_kv); varlen: per sequence) of the block's kv head make every
// product that of the dequantised inputs: q_descale k_descale joins the softmax scale,
// v_descale scales dP, q_descale dK and k_descale dQ.
//
// Split head dims (Tr::kSplitV, WithBwdHeadDimV): V, dO and dV have V's head dim; dP's
// k steps, dV's columns and their shared rows follow it (BwdVRows copies and stores them).
//
// Output column chunks (Tr::kChunks > 1, WithBwdColumnChunks: head dims 512 and 576): the
// grid is (x, kv heads x chunks, batch) and block (x, chunk c heads_kv + kv head) computes S
// and dP over the full head dims but adds only column chunk c of dK, dV and dQ (S and dP
// are recomputed once per chunk).
//
// Tensors: Q, dO (batch, seqlen_q, heads_q, dim); K, V, dK, dV (batch, seqlen_k, heads_kv,
// dim) (V, dO, dV: V's dim where it differs); strides in elements, last dim contiguous, base pointers 16-byte aligned and row
// strides multiples of 8 elements. LSE, D: contiguous float32 (batch, heads_q, seqlen_q).
// dQ accumulator: contiguous float32 (slices, batch, heads_q, seqlen_q, dim), zeroed before
// the launch (the preprocess kernel does it); atomic mode adds into slice 0, the
// deterministic mode block x into slice x.
//
// Varlen (the forward's packed layout): Q, dO (1, total_q, heads_q, dim), K, V, dK, dV (1,
// total_k, heads_kv, dim), LSE and D (1, heads_q, total_q), the accumulator (slices, 1,
// heads_q, total_q, dim); seqlen_q and seqlen_k are the totals. The grid's batch index is
// the sequence: rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 (keys likewise), and every
// length, mask, ALiBi distance and dropout position below is that sequence's. Blocks past a
// sequence's last key tile (the grid is sized by the longest) do nothing; a sequence with no
// query rows stores dK = dV = 0, one with no keys leaves its rows of the accumulator at 0.
#pragma once

#include "bwd_gemm.cuh"
#include "bwd_tile.cuh"
#include "bwd_traits.cuh"
#include "dropout.cuh"
#include "flex_ops.cuh"
#include "variant_args.cuh"

namespace ft {

// The features' values one step of a block reads (BwdTraits' Local, Softcap, Alibi): the
// window's clamped sizes and the per-head transforms in natural-log units.
struct BwdScoreArgs {
  int right = 0;            // keys visible after a row's diagonal (causal: 0)
  int left = 0;             // keys visible before it (Local)
  float cap = 0.0f;         // Softcap: the cap
  float tanh_scale = 0.0f;  // Softcap: softmax_scale / cap
  float neg_slope = 0.0f;   // Alibi: -slope of the step's (batch, query head)
  float dp_scale = 1.0f;    // FP8: v_descale (dP = dO V^T of the dequantised V)
};

// Step 1 for one warp: P and dS of its query rows over the key tile, into sP and sdS.
// Declared score modifications (Mods, codegen.score_mods): P is recomputed from the
// modified score mods(x) (x the scaled score after softcap and ALiBi; on a block mask's
// partial tile, -inf where mods.keep hides the key) and dS carries mods.grad(x), the
// modification's slope. With a `dscore` buffer (row 0 of the (batch, head) slice of a
// float32 (B, Hq, Nq, Nk) tensor, rows dscore_cols apart, zeroed by the caller) each visible
// element's gradient by the modified score, P (dP - D), is also stored there: every element
// by exactly one block, so the buffer holds the same bits in every block order (captured
// tensors' gradients are reduced from it, codegen.trace_grad).
template <class Tr, class Mods>
__device__ __forceinline__ void bwd_scores(const typename Tr::Element* sq,
                                           const typename Tr::Element* sdo,
                                           const typename Tr::Element* sk,
                                           const typename Tr::Element* sv,
                                           const float* slse, const float* sdsum,
                                           typename Tr::Element* sp, typename Tr::Element* sds,
                                           int row0, int col0, bool masked, int seqlen_q,
                                           int seqlen_k, float scale_log2, int lane,
                                           const BwdScoreArgs& fa, const DropoutSite& drop,
                                           const Mods& mods, int batch, int head, bool partial,
                                           float* dscore, int dscore_cols) {
  constexpr float kLog2e = 1.44269504088896340736f;
  constexpr int kSteps = Tr::kHeadDimMma / 16;
  constexpr int kVSteps = Tr::kHeadDimVMma / 16;  // dP = dO V^T: over V's head dim
  float s[Tr::kMTiles][Tr::kKeyTiles][4];
  float dp[Tr::kMTiles][Tr::kKeyTiles][4];
  zero_fragments(s);
  zero_fragments(dp);
  warp_mma<typename Tr::Ops, Tr::kMTiles, Tr::kKeyTiles, kSteps, false, false>(
      s, sq, Tr::kRowStride, sk, Tr::kRowStride, lane);
  warp_mma<typename Tr::Ops, Tr::kMTiles, Tr::kKeyTiles, kVSteps, false, false>(
      dp, sdo, Tr::kVRowStride, sv, Tr::kVRowStride, lane);
  const int g = lane / 4;
  const int t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
    // Dropout: the kept bits of the lane's rows (h = 0, 1) and keys of each key tile.
    unsigned kept[Tr::kDropout ? Tr::kKeyTiles : 1];
    if constexpr (Tr::kDropout) {
#pragma unroll
      for (int nt = 0; nt < Tr::kKeyTiles; ++nt) {
        kept[nt] = drop.kept(row0 + mt * 16 + g, col0 + nt * 8 + 2 * t);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mt * 16 + g + 8 * h;  // row within the warp's rows
      const float lse_log2 = slse[r] * kLog2e;
      const float dsum = sdsum[r];
      // Keys [first, visible) of the tile are visible to this row (all of them unless
      // masked): key j < seqlen_k and, causal or local, j <= row + seqlen_k - seqlen_q +
      // right; local, also j >= row + seqlen_k - seqlen_q - left.
      int visible = Tr::kBlockN;
      int first = 0;
      if (masked) {
        const int row = row0 + r;
        int limit = row < seqlen_q ? seqlen_k : 0;
        if constexpr (Tr::kCausal || Tr::kLocal) {
          const int diag = row + 1 + seqlen_k - seqlen_q + (Tr::kLocal ? fa.right : 0);
          limit = diag < limit ? diag : limit;
        }
        visible = limit - col0;
        if constexpr (Tr::kLocal) first = row + seqlen_k - seqlen_q - fa.left - col0;
      }
#pragma unroll
      for (int nt = 0; nt < Tr::kKeyTiles; ++nt) {
        float p[2];
        float ds[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = nt * 8 + 2 * t + e;
          const bool seen = col < visible && (!Tr::kLocal || col >= first);
          // Dropout: dP of a dropped element is 0, a kept one's is scaled by 1 / (1 - p)
          // (dS = P (dP M / (1 - p) - D)); dV's P is P M / (1 - p).
          float dpe = dp[mt][nt][2 * h + e];
          if constexpr (Tr::kFp8) dpe *= fa.dp_scale;
          bool keep = true;
          if constexpr (Tr::kDropout) {
            keep = (kept[nt] >> (2 * h + e)) & 1u;
            dpe = keep ? dpe * drop.scale : 0.0f;
          }
          if constexpr (Tr::kSoftcap || Tr::kAlibi || Mods::kOn) {
            // The forward's scores in natural-log units: cap tanh(scale s / cap), then the
            // bias -slope |i + Nk - Nq - j|, then the modifications; softcap's and the
            // modifications' derivatives scale dS.
            float x = s[mt][nt][2 * h + e];
            float dtanh = 1.0f;
            if constexpr (Tr::kSoftcap) {
              const float th = tanhf(x * fa.tanh_scale);
              x = fa.cap * th;
              dtanh = 1.0f - th * th;
            } else {
              x *= scale_log2 * (1.0f / kLog2e);
            }
            if constexpr (Tr::kAlibi) {
              const int d = row0 + r + seqlen_k - seqlen_q - (col0 + col);
              x += fa.neg_slope * static_cast<float>(d < 0 ? -d : d);
            }
            if constexpr (Mods::kOn) {
              const int q_idx = row0 + r;
              const int kv_idx = col0 + col;
              bool kept_by_mask = true;
              if constexpr (Mods::kTileRanges) {
                kept_by_mask = !partial || mods.keep(batch, head, q_idx, kv_idx);
              }
              float slope = 0.0f;
              if constexpr (Mods::kGrad) {
                if (seen && kept_by_mask) slope = mods.grad(x, batch, head, q_idx, kv_idx);
              }
              x = kept_by_mask ? mods(x, batch, head, q_idx, kv_idx) : -INFINITY;
              p[e] = seen ? exp2f_fast(x * kLog2e - lse_log2) : 0.0f;
              const float dmod = p[e] * (dpe - dsum);
              if (dscore != nullptr && seen) {
                dscore[static_cast<long long>(q_idx) * dscore_cols + kv_idx] = dmod;
              }
              // A hidden key (P = 0) passes nothing, whatever the slope there (inf, NaN).
              ds[e] = p[e] == 0.0f ? 0.0f : dmod * slope * dtanh;
            } else {
              p[e] = seen ? exp2f_fast(x * kLog2e - lse_log2) : 0.0f;
              ds[e] = p[e] * (dpe - dsum) * dtanh;
            }
          } else {
            p[e] = seen ? exp2f_fast(s[mt][nt][2 * h + e] * scale_log2 - lse_log2) : 0.0f;
            ds[e] = p[e] * (dpe - dsum);
          }
          if constexpr (Tr::kDropout) p[e] = keep ? p[e] * drop.scale : 0.0f;
        }
        const int at = r * Tr::kPRowStride + nt * 8 + 2 * t;
        *reinterpret_cast<unsigned*>(sp + at) = Tr::Ops::pack(p[0], p[1]);
        *reinterpret_cast<unsigned*>(sds + at) = Tr::Ops::pack(ds[0], ds[1]);
      }
    }
  }
}

// Step 3 for one warp: dQ of its query rows (dS K), added to the float32 accumulator `acc`
// (row 0 of this (slice, batch, head), offset to the block's column chunk, as `sk` is),
// kDqChunk head-dim tiles at a time over the chunk's kChunkTiles. FP8: times `scale`, K's
// descale factor (dS K of the dequantised K).
template <class Tr, int CHUNK0, int TILES>
__device__ __forceinline__ void bwd_dq_chunk(float* acc, const typename Tr::Element* sds,
                                             const typename Tr::Element* sk, int row0,
                                             int seqlen_q, int lane, float scale) {
  float dq[Tr::kMTiles][TILES][4];
  zero_fragments(dq);
  warp_mma<typename Tr::Ops, Tr::kMTiles, TILES, Tr::kBlockN / 16, false, true>(
      dq, sds, Tr::kPRowStride, sk + CHUNK0 * 8, Tr::kRowStride, lane);
  if constexpr (Tr::kFp8) {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
      for (int nt = 0; nt < TILES; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) dq[mt][nt][i] *= scale;
      }
    }
  }
  const int g = lane / 4;
  const int t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + mt * 16 + g + 8 * h;
      if (row >= seqlen_q) continue;
      float* out = acc + static_cast<long long>(row) * Tr::kHeadDim;
#pragma unroll
      for (int nt = 0; nt < TILES; ++nt) {
        const int col = (CHUNK0 + nt) * 8 + 2 * t;
        if (col >= Tr::kChunkCols) continue;
        if constexpr (Tr::kDqSplit) {
          // This block owns its slice and adds its key tiles one after another.
          float2 v = *reinterpret_cast<float2*>(out + col);
          v.x += dq[mt][nt][2 * h];
          v.y += dq[mt][nt][2 * h + 1];
          *reinterpret_cast<float2*>(out + col) = v;
        } else {
          atomic_add_f32(out + col, dq[mt][nt][2 * h]);
          atomic_add_f32(out + col + 1, dq[mt][nt][2 * h + 1]);
        }
      }
    }
  }
}

template <class Tr, int CHUNK0>
__device__ __forceinline__ void bwd_dq(float* acc, const typename Tr::Element* sds,
                                       const typename Tr::Element* sk, int row0, int seqlen_q,
                                       int lane, float scale) {
  constexpr int kTiles = const_min(Tr::kDqChunk, Tr::kChunkTiles - CHUNK0);
  bwd_dq_chunk<Tr, CHUNK0, kTiles>(acc, sds, sk, row0, seqlen_q, lane, scale);
  if constexpr (CHUNK0 + kTiles < Tr::kChunkTiles) {
    bwd_dq<Tr, CHUNK0 + kTiles>(acc, sds, sk, row0, seqlen_q, lane, scale);
  }
}

template <class Tr, class Mods = NoScoreMods>
__device__ __forceinline__ void flash_bwd(
    const typename Tr::In* __restrict__ q, const typename Tr::In* __restrict__ k,
    const typename Tr::In* __restrict__ v, const typename Tr::Element* __restrict__ dout,
    const float* __restrict__ lse, const float* __restrict__ dsum,
    typename Tr::Element* __restrict__ dk, typename Tr::Element* __restrict__ dv,
    float* __restrict__ dq_accum, int seqlen_q, int seqlen_k, int heads_q, int heads_kv,
    long long q_batch_stride, long long q_row_stride, long long q_head_stride,
    long long k_batch_stride, long long k_row_stride, long long k_head_stride,
    long long v_batch_stride, long long v_row_stride, long long v_head_stride,
    long long do_batch_stride, long long do_row_stride, long long do_head_stride,
    long long dk_batch_stride, long long dk_row_stride, long long dk_head_stride,
    long long dv_batch_stride, long long dv_row_stride, long long dv_head_stride,
    float softmax_scale, const VariantArgs& var = VariantArgs{}, const Mods& mods = Mods{},
    float* __restrict__ dscore = nullptr, int dscore_rows = 0, int dscore_cols = 0,
    const float* __restrict__ q_descale = nullptr,
    const float* __restrict__ k_descale = nullptr,
    const float* __restrict__ v_descale = nullptr) {
  using Element = typename Tr::Element;
  using In = typename Tr::In;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kNumStages;
  constexpr float kLog2e = 1.44269504088896340736f;

  // The block's column chunk and kv head (one chunk: blockIdx.y is the kv head).
  const int chunk = Tr::kChunks == 1 ? 0 : static_cast<int>(blockIdx.y) / heads_kv;
  const int kv_head = Tr::kChunks == 1 ? static_cast<int>(blockIdx.y)
                                       : static_cast<int>(blockIdx.y) % heads_kv;
  const int chunk_col0 = chunk * Tr::kChunkCols;     // of dK and dQ (Q/K's head dim)
  const int chunk_col0_v = chunk * Tr::kChunkColsV;  // of dV (V's head dim)
  const int batch = static_cast<int>(blockIdx.z);
  const int group = heads_q / heads_kv;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();
  // FP8 (Tr::kFp8): the descale factors of this (batch or sequence, kv head) make the
  // products of the dequantised inputs: q_descale k_descale scales S (softcap sees those
  // scores), v_descale dP, q_descale dK (with the softmax scale) and k_descale dQ.
  float qk_scale = softmax_scale;
  float dk_scale = softmax_scale;
  float dq_scale = 1.0f;
  float dp_scale = 1.0f;
  if constexpr (Tr::kFp8) {
    const int bh = batch * heads_kv + kv_head;
    qk_scale *= q_descale[bh] * k_descale[bh];
    dk_scale *= q_descale[bh];
    dq_scale = k_descale[bh];
    dp_scale = v_descale[bh];
  }
  const float scale_log2 = qk_scale * kLog2e;

  // Row 0 of this sequence in the (packed or batched) tensors. The LSE, D and accumulator
  // rows of query head h start at stats_row0 + h * stats_rows.
  long long q_row0 = batch * q_batch_stride;
  long long do_row0 = batch * do_batch_stride;
  long long k_row0 = batch * k_batch_stride;
  long long v_row0 = batch * v_batch_stride;
  long long dk_row0 = batch * dk_batch_stride;
  long long dv_row0 = batch * dv_batch_stride;
  long long stats_row0 = batch_rows(batch, heads_q, seqlen_q);
  const long long stats_rows = seqlen_q;  // the whole pack's rows per head when varlen
  const int batches = Tr::kVarlen ? 1 : static_cast<int>(gridDim.z);
  if constexpr (Tr::kVarlen) {
    const int q_start = var.cu_seqlens_q[batch];
    const int k_start = var.cu_seqlens_k[batch];
    seqlen_q = var.cu_seqlens_q[batch + 1] - q_start;
    seqlen_k = var.cu_seqlens_k[batch + 1] - k_start;
    q_row0 = q_start * q_row_stride;
    do_row0 = q_start * do_row_stride;
    k_row0 = k_start * k_row_stride;
    v_row0 = k_start * v_row_stride;
    dk_row0 = k_start * dk_row_stride;
    dv_row0 = k_start * dv_row_stride;
    stats_row0 = q_start;
  }
  const In* k_bh = k + k_row0 + kv_head * k_head_stride;
  const In* v_bh = v + v_row0 + kv_head * v_head_stride;
  Element* dk_bh = dk + dk_row0 + kv_head * dk_head_stride;
  Element* dv_bh = dv + dv_row0 + kv_head * dv_head_stride;
  // Slice of the dQ accumulator this block adds into.
  const long long slice = Tr::kDqSplit ? static_cast<long long>(blockIdx.x) : 0;
  float* dq_slice = dq_accum + slice * batches * heads_q * stats_rows * Tr::kHeadDim;

  FT_DYNAMIC_SMEM(unsigned char, smem);
  Element* const base = reinterpret_cast<Element*>(smem);
  Element* const sk = base + Tr::kKOffset;
  Element* const sv = base + Tr::kVOffset;
  Element* const sq = base + Tr::kQOffset;
  Element* const sdo = base + Tr::kDoOffset;
  Element* const sp = base + Tr::kPOffset;
  Element* const sds = base + Tr::kDsOffset;
  float* const slse = reinterpret_cast<float*>(base + Tr::kElems);
  float* const sdsum = slse + kStages * kBlockM;

  // Warp layouts: step 1 and 3 rows; step 2 keys x head-dim columns (of the chunk).
  const int warp_row0 = warp * Tr::kWarpRows;
  const int warp_key0 = (warp % Tr::kWarpsN) * Tr::kWarpKeys;
  const int warp_col0 = chunk_col0 + (warp / Tr::kWarpsN) * Tr::kKvDimTiles * 8;
  const int warp_col0_v = chunk_col0_v + (warp / Tr::kWarpsN) * Tr::kKvDimTilesV * 8;

  const int n_blocks = (seqlen_k + kBlockN - 1) / kBlockN;
  const int m_blocks = (seqlen_q + kBlockM - 1) / kBlockM;
  BwdScoreArgs fa;
  if constexpr (Tr::kLocal) {
    fa.right = var.right(seqlen_q);
    fa.left = var.left(seqlen_k);
  }
  if constexpr (Tr::kSoftcap) {
    fa.cap = var.softcap;
    fa.tanh_scale = qk_scale / var.softcap;
  }
  fa.dp_scale = dp_scale;
  DropoutSite drop;
  if constexpr (Tr::kDropout) drop.init(var.dropout_seed, var.dropout_offset, var.dropout_p);
  for (int n_block = static_cast<int>(blockIdx.x); n_block < n_blocks;
       n_block += static_cast<int>(gridDim.x)) {
    const int n0 = n_block * kBlockN;
    // The query tiles [m_first, m_end) hold the rows that see some key of this tile: rows
    // i >= j - (seqlen_k - seqlen_q) - right (causal, local) and, local, i <= j -
    // (seqlen_k - seqlen_q) + left; the others are never visited.
    int m_first = 0;
    int m_end = m_blocks;
    if constexpr (Tr::kCausal || Tr::kLocal) {
      const int first_row = n0 - (seqlen_k - seqlen_q) - (Tr::kLocal ? fa.right : 0);
      m_first = first_row > 0 ? first_row / kBlockM : 0;
    }
    if constexpr (Tr::kLocal) {
      const int last_row = n0 + kBlockN - 1 - (seqlen_k - seqlen_q) + fa.left;
      const int end = last_row < 0 ? 0 : last_row / kBlockM + 1;
      m_end = end < m_blocks ? end : m_blocks;
    }
    if constexpr (Mods::kTileRanges) {
      flex::clip_query_tiles(mods, batch, kv_head, group, n_block, m_blocks, m_first, m_end);
    }
    const int m_count = m_end > m_first ? m_end - m_first : 0;
    const int steps = group * m_count;

    // Step s: query head kv_head * group + s / m_count, query tile m_first + s % m_count.
    auto load_step = [&](int s) {
      const int head = kv_head * group + s / m_count;
      const int m0 = (m_first + s % m_count) * kBlockM;
      const int buf = s % kStages;
      load_input_tile<Tr, kBlockM>(sq + buf * Tr::kQElems, q + q_row0 + head * q_head_stride,
                                   q_row_stride, m0, seqlen_q, tid);
      copy_tile_async<BwdVRows<Tr>, kBlockM>(sdo + buf * Tr::kDoElems,
                                   dout + do_row0 + head * do_head_stride, do_row_stride, m0,
                                   seqlen_q, tid);
      const long long stats = stats_row0 + head * stats_rows;
      copy_stats_async<Tr, kBlockM>(slse + buf * kBlockM, lse + stats, m0, seqlen_q, tid);
      copy_stats_async<Tr, kBlockM>(sdsum + buf * kBlockM, dsum + stats, m0, seqlen_q, tid);
    };

    // Every warp is done with the previous key tile's shared memory.
    block_sync();
    load_input_tile<Tr, kBlockN>(sk, k_bh, k_row_stride, n0, seqlen_k, tid);
    load_input_tile<BwdVRows<Tr>, kBlockN>(sv, v_bh, v_row_stride, n0, seqlen_k, tid);
    if (steps > 0) load_step(0);
    cp_async_commit();

    float acc_dk[Tr::kKvTiles][Tr::kKvDimTiles][4];
    float acc_dv[Tr::kKvTiles][Tr::kKvDimTilesV][4];
    zero_fragments(acc_dk);
    zero_fragments(acc_dv);

    for (int s = 0; s < steps; ++s) {
      const int head = kv_head * group + s / m_count;
      const int m0 = (m_first + s % m_count) * kBlockM;
      const int buf = s % kStages;
      // Step s's copies have landed for every thread; every warp is done with step s - 1
      // (so the other buffer, and sP / sdS, may be overwritten).
      cp_async_wait<0>();
      block_sync();
      if (kStages == 2 && s + 1 < steps) {
        load_step(s + 1);
        cp_async_commit();
      }
      const Element* sq_buf = sq + buf * Tr::kQElems;
      const Element* sdo_buf = sdo + buf * Tr::kDoElems;
      bool masked = m0 + kBlockM > seqlen_q || n0 + kBlockN > seqlen_k ||
                    (Tr::kCausal && n0 + kBlockN - 1 > m0 + seqlen_k - seqlen_q);
      if constexpr (Tr::kLocal) {  // the tile crosses the window's right or left edge
        masked = masked || n0 + kBlockN - 1 > m0 + seqlen_k - seqlen_q + fa.right ||
                 n0 < m0 + kBlockM - 1 + seqlen_k - seqlen_q - fa.left;
      }
      if constexpr (Tr::kAlibi) {
        fa.neg_slope = -var.alibi_slopes[batch * var.alibi_batch_stride + head];
      }
      if constexpr (Tr::kDropout) {
        drop.at(static_cast<unsigned long long>(var.dropout_offset), batch, heads_q, head);
      }
      // A block mask's full tiles (every row sees every key) skip the mask's evaluation.
      bool partial = true;
      if constexpr (Mods::kTileRanges) {
        partial = flex::partial_query_tile(mods, batch, head, n_block, m0 / kBlockM);
      }
      float* dscore_bh = nullptr;
      if constexpr (Mods::kOn) {
        // Every chunk computes the same scores: chunk 0's block stores them.
        if (dscore != nullptr && chunk == 0) {
          // (batch or sequence, head)'s dscore_rows x dscore_cols slice: (B, Hq, Nq, Nk),
          // or varlen's padded (sequences, Hq, longest Nq, longest Nk).
          dscore_bh = dscore + (static_cast<long long>(batch) * heads_q + head) *
                                   dscore_rows * dscore_cols;
        }
      }
      bwd_scores<Tr>(sq_buf + warp_row0 * Tr::kRowStride,
                     sdo_buf + warp_row0 * Tr::kVRowStride,
                     sk, sv, slse + buf * kBlockM + warp_row0,
                     sdsum + buf * kBlockM + warp_row0, sp + warp_row0 * Tr::kPRowStride,
                     sds + warp_row0 * Tr::kPRowStride, m0 + warp_row0, n0, masked, seqlen_q,
                     seqlen_k, scale_log2, lane, fa, drop, mods, batch, head, partial,
                     dscore_bh, dscore_cols);
      block_sync();  // sP and sdS are complete

      // dV += P^T dO and dK += dS^T Q over this step's query rows.
      warp_mma<typename Tr::Ops, Tr::kKvTiles, Tr::kKvDimTilesV, kBlockM / 16, true, true>(
          acc_dv, sp + warp_key0, Tr::kPRowStride, sdo_buf + warp_col0_v, Tr::kVRowStride,
          lane);
      warp_mma<typename Tr::Ops, Tr::kKvTiles, Tr::kKvDimTiles, kBlockM / 16, true, true>(
          acc_dk, sds + warp_key0, Tr::kPRowStride, sq_buf + warp_col0, Tr::kRowStride, lane);
      // dQ += dS K for the warp's own rows.
      float* dq_head =
          dq_slice + (stats_row0 + head * stats_rows) * Tr::kHeadDim + chunk_col0;
      bwd_dq<Tr, 0>(dq_head, sds + warp_row0 * Tr::kPRowStride, sk + chunk_col0,
                    m0 + warp_row0, seqlen_q, lane, dq_scale);

      if (kStages == 1 && s + 1 < steps) {
        block_sync();  // every warp is done with the only buffer
        load_step(s + 1);
        cp_async_commit();
      }
    }
    cp_async_wait_all();  // nothing is left in flight (also when there were no steps)

    store_fragments<Tr>(dk_bh, dk_row_stride, acc_dk, dk_scale, n0 + warp_key0, seqlen_k,
                        warp_col0, lane);
    store_fragments<BwdVRows<Tr>>(dv_bh, dv_row_stride, acc_dv, 1.0f, n0 + warp_key0,
                                  seqlen_k, warp_col0_v, lane);
  }
}

}  // namespace ft
