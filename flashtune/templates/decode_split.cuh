// Split-KV decoding (FlashDecoding): partial attention of a few query rows per sequence over
// one split of a (paged) KV cache, written as float32 partial O and LSE per split; the
// combine kernel (combine_splits.cuh) merges the splits weighted by their LSE.
//
// Grid: (num_splits, heads_kv * m_blocks, batch). A block serves one (batch, kv head) and
// BlockM *packed* rows, r = g * seqlen_q + i (query head kv_head * group + g, query
// position i), so one K/V tile in shared memory serves every query head of the group: each
// K/V element of a split is read from global memory once per group (m_blocks = 1 when the
// group's rows fit one block). The block's keys are split `split` of the sequence
// (decode_traits.cuh kSplitAlign); K/V tiles of BlockN keys stream through rings of
// NumStages shared buffers fed by cp.async; S = Q K^T and O += P V are the forward's warp
// GEMMs (warp_gemm.cuh, mma.sync m16n8k16) and the online softmax is the forward's
// (softmax.cuh), with this kernel's per-row key limits as its mask. The loads stay this
// kernel's own: K/V rows come through a block table, and Q rows are packed over the group.
//
// Keys: positions [0, cache_len) are cache rows, found through the block table (paged:
// position j is row j % page_size of page block_table[b, j / page_size]; unpaged: row j of
// the batch's own sequence, passed as page b of page_size = max_len); positions
// [cache_len, cache_len + seqlen_new) are the new rows k_new / v_new, which the blocks of
// m-block 0 also store into the cache at those positions (each key is in one split, so one
// block writes it). cache_len = cache_seqlens[b] is read on the device.
//
// Safety: a cache length below 0 or past the capacity (page_size * max_pages), or a block
// table entry outside [0, num_pages) for a page the split uses, is never followed: the
// kernel records the first such error in status[0..3] = (code, batch, index, value), fills
// the block's partial O and LSE with NaN, and (trap_on_error) stops the kernel with a trap
// so that the error surfaces at the next synchronisation.
//
// Splits: num_splits even pieces of each sequence's keys, or, with a split table
// (flashtune.families.decode.splits.SplitTable), pieces of the size of the sequence's own
// length bucket, chosen here from the length the kernel reads: a sequence's splits never
// depend on the rest of the batch (batch-invariant), and one captured launch serves every
// length with its tuned split. A launch of one split given O and LSE writes them directly
// (RowOutputs): no combine.
//
// Causal: query position i sees key j iff j <= i + total - seqlen_q (bottom-right aligned,
// total = cache_len + seqlen_new). Partial outputs (contiguous float32):
//   o_part   (num_splits, batch, heads_q, seqlen_q, V's head dim), normalised within the
//            split (V's head dim: Tr::kHeadDimV, Q/K's unless DecodeWithHeadDimV splits them);
//   lse_part (num_splits, batch, heads_q, seqlen_q), natural log; -inf (and O = 0) for a row
//            that sees no key of the split, so that its weight in the combine is 0.
//
// Features (Tr::kLocal, kSoftcap, kAlibi; run-time values in `var`), as in the forward with
// Nk = total: a window (left, right) shows query position i the keys
// [i + total - seqlen_q - left, i + total - seqlen_q + right]; the key tiles below the
// window of every query position are not visited (a split left with none writes the empty
// partial, weight 0), except those holding new rows that m-block 0 appends. Softcap, then
// ALiBi (the slope of each packed row's own query head), then the declared score
// modifications (Tr::Mods, with the row's query head and absolute position
// i + total - seqlen_q and the key's position j) transform the scores. A block mask
// (Tr::Mods::kTileRanges) hides the keys its mask rejects (evaluated on every walked score)
// and clips the block's walk to the key blocks it marks non-empty for one of the block's
// rows (block_mask_keys), widened by the new rows m-block 0 appends.
//
// An e4m3 cache (Tr::kFp8Cache, decode_fp8.cuh): k_cache and v_cache hold e4m3 bytes with
// descale factors per (batch, kv head). Key tiles are stored into the same 16-bit shared
// tiles by the threads themselves (read-only loads, exact conversion) instead of cp.async;
// the K descale joins softmax_scale (so every score transform and the LSE see the
// dequantised keys) and the V descale multiplies each row's 1 / sum. New rows are quantised
// on their way into the tile, and m-block 0 appends the tile's values as e4m3 (exact).
#pragma once

#include "decode_fp8.cuh"
#include "decode_traits.cuh"
#include "softmax.cuh"
#include "variant_args.cuh"
#include "warp_gemm.cuh"

namespace ft {

// Records the first bad input of the launch: status = (code, batch, index, value). With
// trap_on_error the kernel stops (the error surfaces at the next synchronisation).
__device__ __forceinline__ void record_bad_input(int* status, int code, int batch, int index,
                                                 int value, int trap_on_error) {
  if (atomicCAS(status, 0, code) == 0) {
    status[1] = batch;
    status[2] = index;
    status[3] = value;
  }
  if (trap_on_error) trap();
}

// Where the keys of one (batch, kv head) live.
template <class Tr>
struct KvRows {
  using Element = typename Tr::Element;
  typename Tr::Cache* cache;   // the kv head's row 0 of page 0
  const Element* fresh;        // the new rows of (batch, kv head); read only past cache_len
  const int* pages;            // the batch's block-table row; null: unpaged (page `own_page`)
  long long page_stride;
  long long row_stride;
  long long fresh_row_stride;
  int page_size;
  int own_page;
  int cache_len;
  float descale;               // an e4m3 cache's descale factor of (batch, kv head)

  // Element offset of cache position j (pages already validated).
  __device__ __forceinline__ long long cache_offset(int j) const {
    const int slot = j / page_size;
    const int page = pages != nullptr ? pages[slot] : own_page;
    return page * page_stride + static_cast<long long>(j - slot * page_size) * row_stride;
  }

  // The row of key j: a cache row before cache_len, a new row after.
  __device__ __forceinline__ const Element* row(int j) const {
    return j < cache_len ? cache + cache_offset(j)
                         : fresh + static_cast<long long>(j - cache_len) * fresh_row_stride;
  }
};

// Store chunk c (8 values) of key j into a shared tile from an e4m3 cache: a cache row
// dequantised exactly (without its descale), a new row quantised with it first
// (decode_fp8.cuh), so the tile holds what the cache holds once the new rows are appended;
// zeros where !real. Read-only loads (a cache row read here is never one this launch
// appends) and plain shared stores (the barrier before the tile is read publishes them).
template <class Tr>
__device__ __forceinline__ void load_e4m3_chunk(typename Tr::Element* dst, const KvRows<Tr>& kv,
                                                int j, int c, bool real) {
  uint2 bytes;
  bytes.x = bytes.y = 0u;
  if (real && j < kv.cache_len) {
    bytes = __ldg(reinterpret_cast<const uint2*>(kv.cache + kv.cache_offset(j) +
                                                 c * Tr::kCacheChunkBytes));
  } else if (real) {
    bytes = quantise_chunk_e4m3<typename Tr::Element>(
        __ldg(reinterpret_cast<const uint4*>(kv.fresh +
                                             static_cast<long long>(j - kv.cache_len) *
                                                 kv.fresh_row_stride +
                                             c * Tr::kChunkElems)),
        kv.descale);
  }
  *reinterpret_cast<uint4*>(dst) = e4m3_chunk_to_16bit<typename Tr::Ops>(bytes);
}

// Calls f(r, c) for the (row, 16-byte chunk) pairs of a tile of Rows rows that thread tid
// copies: kThreads / kLoadChunks whole rows per step, or, where a row holds more chunks than
// the block has threads (Q/K of 576 on 2 warps), every row in several passes of kThreads
// chunks.
template <class Tr, int Rows, class F>
__device__ __forceinline__ void for_tile_chunks(int tid, F&& f) {
  constexpr int kPasses = (Tr::kLoadChunks + Tr::kThreads - 1) / Tr::kThreads;
  constexpr int kRowsPerIter = kPasses == 1 ? Tr::kThreads / Tr::kLoadChunks : 1;
  constexpr int kIters = (Rows + kRowsPerIter - 1) / kRowsPerIter;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int c = kPasses == 1 ? tid % Tr::kLoadChunks : tid + pass * Tr::kThreads;
    const int r0 = kPasses == 1 ? tid / Tr::kLoadChunks : 0;
    if (r0 >= kRowsPerIter || c >= Tr::kLoadChunks) continue;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int r = r0 + it * kRowsPerIter;
      if (Rows % kRowsPerIter == 0 || r < Rows) f(r, c);
    }
  }
}

// Issue (without committing) the cp.async copies of keys [key0, key0 + BlockN) into a
// shared tile; keys at or past key_end and head-dim columns past HeadDim read nothing and
// are zero-filled. An e4m3 cache's chunks are stored dequantised instead (load_e4m3_chunk).
template <class Tr>
__device__ __forceinline__ void load_key_tile(typename Tr::Element* tile, const KvRows<Tr>& kv,
                                              int key0, int key_end, int tid) {
  for_tile_chunks<Tr, Tr::kBlockN>(tid, [&](int r, int c) {
    const bool real = c < Tr::kRealChunks && key0 + r < key_end;
    if constexpr (Tr::kFp8Cache) {
      load_e4m3_chunk<Tr>(tile + r * Tr::kRowStride + c * Tr::kChunkElems, kv, key0 + r, c,
                          real);
    } else {
      const typename Tr::Element* src = real ? kv.row(key0 + r) + c * Tr::kChunkElems : kv.cache;
      cp_async<16>(tile + r * Tr::kRowStride + c * Tr::kChunkElems, src, real ? 16 : 0);
    }
  });
}

// Issue the cp.async copies of the block's packed Q rows [m0, m0 + BlockM): row r is query
// position r % seqlen_q of head offset r / seqlen_q; rows past `rows` are zero-filled.
// q_group: query head kv_head * group, position 0, of the batch.
template <class Tr>
__device__ __forceinline__ void load_packed_q(typename Tr::Element* sq,
                                              const typename Tr::Element* q_group,
                                              long long row_stride, long long head_stride,
                                              int m0, int rows, int seqlen_q, int tid) {
  for_tile_chunks<Tr, Tr::kBlockM>(tid, [&](int r, int c) {
    const int packed = m0 + r;
    const bool real = c < Tr::kRealChunks && packed < rows;
    const int g = packed / seqlen_q;
    const typename Tr::Element* src = q_group +
                                      static_cast<long long>(packed - g * seqlen_q) * row_stride +
                                      g * head_stride + c * Tr::kChunkElems;
    cp_async<16>(sq + r * Tr::kRowStride + c * Tr::kChunkElems, real ? src : q_group,
                 real ? 16 : 0);
  });
}

// Store the new keys of a landed shared tile (positions [cache_len, key_end) within
// [key0, key0 + BlockN)) into their cache rows, 128 bits per store; an e4m3 cache's rows are
// the tile's values as e4m3 (exact: the tile holds the quantised rows), 64 bits per store.
template <class Tr>
__device__ __forceinline__ void store_new_keys(const KvRows<Tr>& kv,
                                               const typename Tr::Element* tile, int key0,
                                               int key_end, int tid) {
  const int lo = kv.cache_len > key0 ? kv.cache_len : key0;
  const int hi = key_end < key0 + Tr::kBlockN ? key_end : key0 + Tr::kBlockN;
  for (int idx = tid; idx < (hi - lo) * Tr::kRealChunks; idx += Tr::kThreads) {
    const int r = lo - key0 + idx / Tr::kRealChunks;
    const int c = idx % Tr::kRealChunks;
    const uint4 chunk =
        *reinterpret_cast<const uint4*>(tile + r * Tr::kRowStride + c * Tr::kChunkElems);
    if constexpr (Tr::kFp8Cache) {
      *reinterpret_cast<uint2*>(kv.cache + kv.cache_offset(key0 + r) +
                                c * Tr::kCacheChunkBytes) =
          quantise_chunk_e4m3<typename Tr::Element>(chunk, 1.0f);
    } else {
      *reinterpret_cast<uint4*>(kv.cache + kv.cache_offset(key0 + r) + c * Tr::kChunkElems) =
          chunk;
    }
  }
}

// Where a block writes its packed rows: row r of the split's partial O and LSE, or, when
// the launch has one split and the final outputs are given (`final_o`), O in the input type
// and the LSE directly: what the combine of one split writes (weight exp(0) = 1, LSE + log 1),
// so the combine is not launched.
template <class Tr>
struct RowOutputs {
  float* o_rows;                          // partial O of packed row 0
  float* lse_rows;                        // partial LSE of packed row 0
  typename Tr::Element* final_o;          // null: partials; else O of head offset 0, position 0
  float* final_lse;                       // LSE of packed row 0
  long long o_row_stride;
  long long o_head_stride;
  int seqlen_q;

  __device__ __forceinline__ typename Tr::Element* final_row(int r) const {
    const int g = r / seqlen_q;
    return final_o + static_cast<long long>(r - g * seqlen_q) * o_row_stride +
           g * o_head_stride;
  }

  // The LSE of a row: a row that saw no key has -inf among partials (weight 0 in the
  // combine) and +inf as a final result (the forward's convention).
  __device__ __forceinline__ void store_lse(int r, float value) const {
    if (final_o != nullptr) {
      final_lse[r] = value == -INFINITY ? INFINITY : value;
    } else {
      lse_rows[r] = value;
    }
  }
};

// The whole block writes O = o_value and LSE = lse_value (partial convention) for its
// packed rows.
template <class Tr>
__device__ __forceinline__ void fill_partial_rows(const RowOutputs<Tr>& out, int m0, int rows,
                                                  float o_value, float lse_value, int tid) {
  const int end = rows < m0 + Tr::kBlockM ? rows : m0 + Tr::kBlockM;
  if (out.final_o != nullptr) {
    constexpr int kPairs = DecodeV<Tr>::kHeadDim / 2;
    const unsigned packed = Tr::Ops::pack(o_value, o_value);
    for (int idx = m0 * kPairs + tid; idx < end * kPairs; idx += Tr::kThreads) {
      const int r = idx / kPairs;
      *reinterpret_cast<unsigned*>(out.final_row(r) + 2 * (idx - r * kPairs)) = packed;
    }
  } else {
    constexpr int kDim = DecodeV<Tr>::kHeadDim;
    for (int idx = m0 * kDim + tid; idx < end * kDim; idx += Tr::kThreads) {
      out.o_rows[idx] = o_value;
    }
  }
  for (int r = m0 + tid; r < end; r += Tr::kThreads) out.store_lse(r, lse_value);
}

// The key limits of the warp's rows in one split: key j is visible to row (mt, h) iff
// j < limit[mt][h] (the split's end, and with a causal mask the row's diagonal; packed row
// r is query position r % seqlen_q).
// Local: the first key each row of the warp sees (an empty base without a window, so that
// the plain kernel's limits are what they were).
template <int MTiles, bool Local>
struct SplitStarts {};
template <int MTiles>
struct SplitStarts<MTiles, true> {
  int start[MTiles][2];
};

template <class Tr>
struct SplitLimits : SplitStarts<Tr::kMTiles, Tr::kLocal> {
  int limit[Tr::kMTiles][2];

  __device__ __forceinline__ void init(int row0, int seqlen_q, int total, int key_end,
                                       int lane, int right = 0, int left = 0) {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int end = key_end;
        if constexpr (Tr::kCausal) {
          const int i = (row0 + mt * 16 + lane / 4 + 8 * h) % seqlen_q;
          const int diag = i + 1 + total - seqlen_q;
          end = diag < end ? diag : end;
        }
        if constexpr (Tr::kLocal) {
          const int i = (row0 + mt * 16 + lane / 4 + 8 * h) % seqlen_q;
          const int diag = i + 1 + total - seqlen_q + right;
          end = diag < end ? diag : end;
          this->start[mt][h] = i + total - seqlen_q - left;
        }
        limit[mt][h] = end;
      }
    }
  }
};

// The mask of the tile starting at key key0, row by row (OnlineSoftmax::update's Mask):
// scores of keys a row may not see become -inf.
template <class Tr>
struct SplitMask {
  const SplitLimits<Tr>& rows;
  int col;  // the key of the lane's first column in the tile

  __device__ __forceinline__ SplitMask(const SplitLimits<Tr>& rows_, int key0, int lane)
      : rows(rows_), col(key0 + 2 * (lane % 4)) {}

  __device__ __forceinline__ void row(float (&s)[Tr::kMTiles][Tr::kSTiles][4], int mt,
                                      int h) const {
#pragma unroll
    for (int nt = 0; nt < Tr::kSTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (col + 8 * nt + e >= rows.limit[mt][h]) s[mt][nt][2 * h + e] = -INFINITY;
        if constexpr (Tr::kLocal) {
          if (col + 8 * nt + e < rows.start[mt][h]) s[mt][nt][2 * h + e] = -INFINITY;
        }
      }
    }
  }
};

// The score transforms of the compiled-in features on a tile of raw scores s = q.k, left
// in the unit the softmax reads (softmax_scale, or the cap with softcap; softmax.cuh's
// ScoreTransform): softcap s -> tanh(s * softmax_scale / cap); ALiBi s += -(slope / unit) *
// |i + total - seqlen_q - j| with the slope of the packed row's query head; declared
// modifications s -> mods(unit s, batch, head, i + total - seqlen_q, j) / unit, with the
// packed row's query head and its absolute position in the sequence (so a mask_mod
// q_idx >= kv_idx is decoding's causal mask). A modification's -inf hides the key; the
// kernel's own masks apply after it, so keys it hides stay hidden whatever it returns.
template <class Tr>
struct SplitTransform {
  static constexpr bool kMods = Tr::Mods::kOn;
  static constexpr bool kOn = Tr::kSoftcap || Tr::kAlibi || kMods;
  typename Tr::Mods mods;            // the modifications' params (kMods)
  float tanh_scale;                  // softmax_scale / cap (Softcap)
  float unit;                        // the softmax's unit (kMods)
  float inv_unit;                    // 1 / unit (kMods)
  float neg_slope[Tr::kMTiles][2];   // -slope / unit of the row's head (Alibi)
  int pos[Tr::kMTiles][2];           // i + total - seqlen_q of the row (Alibi, kMods)
  int head[Tr::kMTiles][2];          // the row's query head (kMods)
  int batch;                         // (kMods)
  int col;                           // the lane's first column within a tile

  __device__ __forceinline__ void init(const VariantArgs& var, const typename Tr::Mods& mods_,
                                       float softmax_scale, int row0, int rows, int seqlen_q,
                                       int total, int batch_, int head0, int lane) {
    col = 2 * (lane % 4);
    if constexpr (Tr::kSoftcap) tanh_scale = softmax_scale / var.softcap;
    const float unit_ = Tr::kSoftcap ? var.softcap : softmax_scale;
    const float inv_unit_ = 1.0f / unit_;
    if constexpr (kMods) {
      mods = mods_;
      unit = unit_;
      inv_unit = inv_unit_;
      batch = batch_;
    }
    if constexpr (Tr::kAlibi || kMods) {
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = row0 + mt * 16 + lane / 4 + 8 * h;
          const int g = r / seqlen_q;
          pos[mt][h] = r - g * seqlen_q + total - seqlen_q;
          if constexpr (kMods) head[mt][h] = head0 + g;
          // Padding rows (r >= rows) are never stored; they read no slope.
          if constexpr (Tr::kAlibi) {
            neg_slope[mt][h] =
                r < rows
                    ? -var.alibi_slopes[batch_ * var.alibi_batch_stride + head0 + g] * inv_unit_
                    : 0.0f;
          }
        }
      }
    }
  }

  __device__ __forceinline__ void apply(float (&s)[Tr::kMTiles][Tr::kSTiles][4],
                                        int key0) const {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
      for (int nt = 0; nt < Tr::kSTiles; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float x = s[mt][nt][i];
          const int key = key0 + col + 8 * nt + (i % 2);
          if constexpr (Tr::kSoftcap) x = tanhf(x * tanh_scale);
          if constexpr (Tr::kAlibi) {
            const int d = pos[mt][i / 2] - key;
            x += neg_slope[mt][i / 2] * static_cast<float>(d < 0 ? -d : d);
          }
          if constexpr (kMods) {
            // A block mask's mask (kTileRanges) is its own hook: a hidden key is -inf before
            // the modification runs, so what that reads is read for visible keys only.
            bool hidden = false;
            if constexpr (Tr::Mods::kTileRanges) {
              hidden = !mods.keep(batch, head[mt][i / 2], pos[mt][i / 2], key);
            }
            x = hidden ? -INFINITY
                       : mods(x * unit, batch, head[mt][i / 2], pos[mt][i / 2], key) * inv_unit;
          }
          s[mt][nt][i] = x;
        }
      }
    }
  }
};

// Write the warp's normalised partial O rows and their LSE straight from the fragments:
// -inf (and O = 0) for a row that saw no key of the split, where the forward's softmax
// gives +inf, so that its weight in the combine is 0 (final outputs: RowOutputs). Rows at
// or past `rows` are not written.
// An e4m3 cache's V descale `v_scale` multiplies each row's 1 / sum (O = v_scale P V8).
template <class Tr>
__device__ __forceinline__ void store_partial_rows(OnlineSoftmax<Tr>& softmax,
                                                   const float (&o)[Tr::kMTiles][Tr::kOTiles][4],
                                                   const RowOutputs<Tr>& out, int row0,
                                                   int rows, int lane, float v_scale = 1.0f) {
  float inv_sum[Tr::kMTiles][2];
  float lse[Tr::kMTiles][2];
  softmax.finalize(inv_sum, lse);
  if constexpr (Tr::kFp8Cache) {
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
      inv_sum[mt][0] *= v_scale;
      inv_sum[mt][1] *= v_scale;
    }
  }
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + mt * 16 + lane / 4 + 8 * h;
      if (row >= rows) continue;
      if (out.final_o != nullptr) {
        typename Tr::Element* o_row = out.final_row(row) + 2 * (lane % 4);
#pragma unroll
        for (int dt = 0; dt < DecodeV<Tr>::kRealChunks; ++dt) {
          *reinterpret_cast<unsigned*>(o_row + 8 * dt) = Tr::Ops::pack(
              o[mt][dt][2 * h] * inv_sum[mt][h], o[mt][dt][2 * h + 1] * inv_sum[mt][h]);
        }
      } else {
        float* o_row =
            out.o_rows + static_cast<long long>(row) * DecodeV<Tr>::kHeadDim + 2 * (lane % 4);
#pragma unroll
        for (int dt = 0; dt < DecodeV<Tr>::kRealChunks; ++dt) {
          float2 pair;
          pair.x = o[mt][dt][2 * h] * inv_sum[mt][h];
          pair.y = o[mt][dt][2 * h + 1] * inv_sum[mt][h];
          *reinterpret_cast<float2*>(o_row + 8 * dt) = pair;
        }
      }
      if (lane % 4 == 0) out.store_lse(row, lse[mt][h] == INFINITY ? -INFINITY : lse[mt][h]);
    }
  }
}

// The keys [lo, hi) a block mask (Tr::Mods::kTileRanges) marks non-empty for any row of
// the block: packed rows [m0, min(m0 + BlockM, rows)), query head head0 + r / seqlen_q at
// absolute position r % seqlen_q + total - seqlen_q. The mask's ranges are per query block
// of kMaskBlock positions, in key blocks of kMaskBlock (api.decode.decode_tile_ranges); the
// union over the rows' heads and query blocks is taken (lo = hi: none).
template <class Tr>
__device__ __forceinline__ void block_mask_keys(const typename Tr::Mods& mods, int batch,
                                                int head0, int m0, int rows, int seqlen_q,
                                                int total, int& lo, int& hi) {
  const int end = rows < m0 + Tr::kBlockM ? rows : m0 + Tr::kBlockM;
  const int g_first = m0 / seqlen_q;
  const int g_last = (end - 1) / seqlen_q;
  const int qb_first = (total - seqlen_q) / kMaskBlock;
  const int qb_last = (total - 1) / kMaskBlock;
  lo = 0x7fffffff;
  hi = 0;
  for (int g = g_first; g <= g_last; ++g) {
    for (int qb = qb_first; qb <= qb_last; ++qb) {
      int b_lo = 0;
      int b_hi = 0;
      int full_lo = 0;
      int full_hi = 0;
      mods.tile_range(batch, head0 + g, qb, b_lo, b_hi, full_lo, full_hi);
      if (b_hi > b_lo) {
        lo = b_lo < lo ? b_lo : lo;
        hi = b_hi > hi ? b_hi : hi;
      }
    }
  }
  if (hi == 0) {
    lo = 0;
    return;
  }
  lo *= kMaskBlock;
  hi *= kMaskBlock;
}

template <class Tr>
__device__ __forceinline__ void decode_split(
    const typename Tr::Element* __restrict__ q, typename Tr::Cache* k_cache,
    typename Tr::Cache* v_cache, const typename Tr::Element* k_new,
    const typename Tr::Element* v_new, const int* __restrict__ block_table,
    const int* __restrict__ cache_seqlens, float* __restrict__ o_part,
    float* __restrict__ lse_part, int* status, const int* __restrict__ split_table,
    typename Tr::Element* __restrict__ o, float* __restrict__ lse, int seqlen_q,
    int seqlen_new, int heads_q, int heads_kv, int num_splits, int split_buckets,
    int page_size, int max_pages, int num_pages, int trap_on_error, long long q_batch_stride,
    long long q_row_stride, long long q_head_stride, long long k_page_stride,
    long long k_row_stride, long long k_head_stride, long long v_page_stride,
    long long v_row_stride, long long v_head_stride, long long kn_batch_stride,
    long long kn_row_stride, long long kn_head_stride, long long vn_batch_stride,
    long long vn_row_stride, long long vn_head_stride, long long o_batch_stride,
    long long o_row_stride, long long o_head_stride, long long bt_batch_stride,
    float softmax_scale, const VariantArgs& var = VariantArgs{},
    const typename Tr::Mods& mods = typename Tr::Mods{},
    const CacheDescales& descales = CacheDescales{}) {
  using Element = typename Tr::Element;
  using VTr = DecodeV<Tr>;  // V's tiles and appends (V's head dim)
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kNumStages;

  const int split = static_cast<int>(blockIdx.x);
  const int batch = static_cast<int>(blockIdx.z);
  const int group = heads_q / heads_kv;
  const int rows = group * seqlen_q;  // packed rows of the (batch, kv head)
  const int m_blocks = (rows + kBlockM - 1) / kBlockM;
  const int kv_head = static_cast<int>(blockIdx.y) / m_blocks;
  const int m_block = static_cast<int>(blockIdx.y) - kv_head * m_blocks;
  const int m0 = m_block * kBlockM;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();

  // Packed row r of this (split, batch, kv head) is row r of the partial outputs from here.
  const long long out_row0 =
      ((static_cast<long long>(split) * gridDim.z + batch) * heads_q +
       static_cast<long long>(kv_head) * group) * seqlen_q;
  // One split launched with the final outputs given: they are written here (no combine).
  // Made where it is used (from the parameters), so that it holds no register in the loop.
  auto outputs = [&]() {
    const bool direct = o != nullptr && gridDim.x == 1;
    const long long head0 = static_cast<long long>(kv_head) * group;
    return RowOutputs<Tr>{
        o_part + out_row0 * DecodeV<Tr>::kHeadDim, lse_part + out_row0,
        direct ? o + batch * o_batch_stride + head0 * o_head_stride : nullptr,
        direct ? lse + (static_cast<long long>(batch) * heads_q + head0) * seqlen_q : nullptr,
        o_row_stride, o_head_stride, seqlen_q};
  };

  const int cache_len = cache_seqlens[batch];
  if (cache_len < 0 || cache_len > page_size * max_pages - seqlen_new) {
    if (tid == 0) {
      record_bad_input(status, cache_len < 0 ? kErrNegativeLength : kErrBeyondCapacity, batch,
                       batch, cache_len, trap_on_error);
    }
    fill_partial_rows<Tr>(outputs(), m0, rows, quiet_nan(), quiet_nan(), tid);
    return;
  }
  const int total = cache_len + seqlen_new;
  // Keys per split: the split size of the sequence's own length bucket (decided here, on
  // the device, from the length the kernel reads), else num_splits even pieces.
  int per_split;
  if (split_table != nullptr) {
    int bucket = 0;
    while (bucket + 1 < split_buckets && total > split_table[2 * bucket]) ++bucket;
    // Never more than kMaxSplits pieces (a length past the table's last bound).
    const int least = ((total + kMaxSplits - 1) / kMaxSplits + kSplitAlign - 1) / kSplitAlign *
                      kSplitAlign;
    per_split = split_table[2 * bucket + 1] > least ? split_table[2 * bucket + 1] : least;
  } else {
    per_split =
        ((total + num_splits - 1) / num_splits + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
  }
  const int key_begin = split * per_split;
  const int key_end = total < key_begin + per_split ? total : key_begin + per_split;
  if (key_begin >= key_end) {  // an empty split: weight 0 in the combine
    fill_partial_rows<Tr>(outputs(), m0, rows, 0.0f, -INFINITY, tid);
    return;
  }
  // The first key tile the block visits: with a window, the tile holding the first key of
  // the earliest query position's window (keys before it are outside every row's window),
  // or an earlier one holding new rows m-block 0 must append.
  int first_key = key_begin;
  if constexpr (Tr::kLocal) {
    int skip_to = total - seqlen_q - var.left(total);
    if (m_block == 0 && seqlen_new > 0 && cache_len < skip_to) skip_to = cache_len;
    if (skip_to >= key_end) {  // no row sees a key of this split: weight 0 in the combine
      fill_partial_rows<Tr>(outputs(), m0, rows, 0.0f, -INFINITY, tid);
      return;
    }
    if (skip_to > key_begin) first_key = key_begin + (skip_to - key_begin) / kBlockN * kBlockN;
  }
  // A block mask (Tr::Mods::kTileRanges): the walk is clipped to the union of the key blocks
  // [lo, hi) the mask marks non-empty for the block's rows (block_mask_keys), widened by the
  // new rows m-block 0 appends; a split left with none writes the empty partial.
  int walk_end = key_end;
  if constexpr (Tr::Mods::kTileRanges) {
    int lo = 0;
    int hi = 0;
    block_mask_keys<Tr>(mods, batch, kv_head * group, m0, rows, seqlen_q, total, lo, hi);
    if (m_block == 0 && seqlen_new > 0) {
      lo = hi > lo && lo < cache_len ? lo : cache_len;
      hi = hi > total ? hi : total;
    }
    walk_end = hi < key_end ? hi : key_end;
    const int start = lo > first_key ? lo : first_key;
    if (start >= walk_end) {  // no row sees a key of this split: weight 0 in the combine
      fill_partial_rows<Tr>(outputs(), m0, rows, 0.0f, -INFINITY, tid);
      return;
    }
    if (start > key_begin) first_key = key_begin + (start - key_begin) / kBlockN * kBlockN;
  }

  FT_DYNAMIC_SMEM(unsigned char, smem);
  const int* pages = block_table != nullptr ? block_table + batch * bt_batch_stride : nullptr;
  if (pages != nullptr) {  // every page the split reads or writes must exist
    int* const flags = reinterpret_cast<int*>(smem + Tr::kFlagsOffsetBytes);
    if (tid == 0) flags[0] = 0;
    block_sync();
    const int last = (key_end - 1) / page_size;
    for (int slot = key_begin / page_size + tid; slot <= last; slot += Tr::kThreads) {
      const int page = pages[slot];
      if (page < 0 || page >= num_pages) {
        record_bad_input(status, kErrPageIndex, batch, slot, page, trap_on_error);
        flags[0] = 1;
      }
    }
    block_sync();
    if (flags[0] != 0) {
      fill_partial_rows<Tr>(outputs(), m0, rows, quiet_nan(), quiet_nan(), tid);
      return;
    }
  }

  // An e4m3 cache's descale factors: K's joins the scores' scale (the scores, their
  // transforms and the LSE are those of the dequantised keys), V's scales O at the end.
  float k_scale = 1.0f, v_scale = 1.0f;
  if constexpr (Tr::kFp8Cache) {
    k_scale = descales.k[batch * heads_kv + kv_head];
    v_scale = descales.v[batch * heads_kv + kv_head];
    softmax_scale *= k_scale;
  }
  // The new rows are read only when seqlen_new > 0, and then k_new and v_new are given.
  const KvRows<Tr> k_rows{k_cache + kv_head * k_head_stride,
                          k_new == nullptr ? k_new
                                           : k_new + batch * kn_batch_stride +
                                                 kv_head * kn_head_stride,
                          pages, k_page_stride, k_row_stride, kn_row_stride, page_size, batch,
                          cache_len, k_scale};
  const KvRows<VTr> v_rows{v_cache + kv_head * v_head_stride,
                          v_new == nullptr ? v_new
                                           : v_new + batch * vn_batch_stride +
                                                 kv_head * vn_head_stride,
                          pages, v_page_stride, v_row_stride, vn_row_stride, page_size, batch,
                          cache_len, v_scale};
  // The blocks of m-block 0 append the new keys of their split to the cache.
  const bool appends = m_block == 0 && key_end > cache_len;
  const int n_tiles = (walk_end - first_key + kBlockN - 1) / kBlockN;

  Element* const sq = reinterpret_cast<Element*>(smem);
  Element* const sk = sq + Tr::kKOffset;
  Element* const sv = sq + Tr::kVOffset;

  // One cp.async group per copy, committed as K_0 (with Q), V_0, K_1, V_1, ...; a step past
  // the last tile commits an empty group, which keeps the wait counts uniform.
  auto load_k = [&](int step) {
    if (step < n_tiles) {
      load_key_tile<Tr>(sk + (step % kStages) * Tr::kKvElems, k_rows,
                        first_key + step * kBlockN, key_end, tid);
    }
    cp_async_commit();
  };
  auto load_v = [&](int step) {
    if (step < n_tiles) {
      load_key_tile<VTr>(sv + (step % kStages) * Tr::kVElems, v_rows,
                        first_key + step * kBlockN, key_end, tid);
    }
    cp_async_commit();
  };

  load_packed_q<Tr>(sq, q + batch * q_batch_stride + kv_head * group * q_head_stride,
                    q_row_stride, q_head_stride, m0, rows, seqlen_q, tid);
  load_k(0);
#pragma unroll
  for (int step = 0; step + 1 < kStages; ++step) {
    load_v(step);
    load_k(step + 1);
  }

  float acc_o[Tr::kMTiles][Tr::kOTiles][4];
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < Tr::kOTiles; ++dt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.0f;
    }
  }
  const int warp_row0 = m0 + warp * Tr::kWarpRows;
  SplitLimits<Tr> limits;
  if constexpr (Tr::kLocal) {
    limits.init(warp_row0, seqlen_q, total, key_end, lane, var.right(seqlen_q),
                var.left(total));
  } else {
    limits.init(warp_row0, seqlen_q, total, key_end, lane);
  }
  // The softmax starts as after tiles of masked keys only (no max yet, sums 0), so that
  // every tile, the first one included, takes the same update.
  OnlineSoftmax<Tr> softmax;
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      softmax.max_scaled[mt][h] = OnlineSoftmax<Tr>::kNoMax;
      softmax.sum[mt][h] = 0.0f;
    }
  }
  // Keys below `unmasked` are visible to every row: tiles that end there need no mask.
  int unmasked = key_end;
  if constexpr (Tr::kCausal) {
    const int first_diag = 1 + total - seqlen_q;
    unmasked = first_diag < unmasked ? first_diag : unmasked;
  }
  if constexpr (Tr::kLocal) {  // keys past the window's right edge of the first position
    const int right_edge = 1 + total - seqlen_q + var.right(seqlen_q);
    unmasked = right_edge < unmasked ? right_edge : unmasked;
  }
  SplitTransform<Tr> transform;
  if constexpr (SplitTransform<Tr>::kOn) {
    transform.init(var, mods, softmax_scale, warp_row0, rows, seqlen_q, total, batch,
                   kv_head * group, lane);
  }
  const float scale_log2 = softmax_scale * 1.44269504088896340736f;
  const LaneOffsets<Tr> lanes(lane);
  const QOperand<Tr> q_warp{sq + warp * Tr::kWarpRows * Tr::kRowStride};

  for (int j = 0; j < n_tiles; ++j) {
    const int key0 = first_key + j * kBlockN;
    const int buf = j % kStages;

    // K_j has landed for every thread; every warp is done with step j-1 (its V buffer is
    // the one refilled next).
    cp_async_wait<Tr::kPipelineWait>();
    block_sync();
    load_v(j + kStages - 1);
    if (appends && key0 + kBlockN > cache_len) {
      store_new_keys<Tr>(k_rows, sk + buf * Tr::kKvElems, key0, key_end, tid);
    }

    float s[Tr::kMTiles][Tr::kSTiles][4];
    gemm_qk<Tr>(s, q_warp, sk + buf * Tr::kKvElems, lanes);

    // V_j has landed for every thread; every warp is done reading K_j's buffer.
    cp_async_wait<Tr::kPipelineWait>();
    block_sync();
    load_k(j + kStages);
    if (appends && key0 + kBlockN > cache_len) {
      store_new_keys<VTr>(v_rows, sv + buf * Tr::kVElems, key0, key_end, tid);
    }

    unsigned p[Tr::kMTiles][Tr::kPvSteps][4];
    if constexpr (Tr::kLocal || SplitTransform<Tr>::kOn) {
      if constexpr (SplitTransform<Tr>::kOn) transform.apply(s, key0);
      // The softmax reads scores in the cap's unit with softcap (SplitTransform).
      const float unit_log2 = (Tr::kSoftcap ? var.softcap : softmax_scale) * 1.44269504088896340736f;
      // Keys at or past total - 1 - left are inside every row's window from the left.
      if (key0 + kBlockN > unmasked || (Tr::kLocal && key0 < total - 1 - var.left(total))) {
        softmax.template update<false>(s, p, acc_o, unit_log2,
                                       SplitMask<Tr>(limits, key0, lane));
      } else {
        softmax.template update<false>(s, p, acc_o, unit_log2, NoMask());
      }
    } else if (key0 + kBlockN > unmasked) {
      softmax.template update<false>(s, p, acc_o, scale_log2, SplitMask<Tr>(limits, key0, lane));
    } else {
      softmax.template update<false>(s, p, acc_o, scale_log2, NoMask());
    }
    gemm_pv<Tr>(acc_o, p, sv + buf * Tr::kVElems, lanes);
  }
  cp_async_wait_all();  // only empty groups remain; leave none behind

  store_partial_rows<Tr>(softmax, acc_o, outputs(), warp_row0, rows, lane, v_scale);
}

}  // namespace ft
