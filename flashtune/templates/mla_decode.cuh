// Absorbed multi-head latent attention (DeepSeek V2/V3 MLA) decoding, split-KV: per
// sequence one latent cache row of kLatentDim = 512 + RopeDim values per key, shared by all
// query heads; scores S = Q L^T over the whole latent row (scaled), V = the first 512 values
// of the same row, output 512 wide per query row. Written as float32 partial O and LSE per
// split, merged by the combine kernel (combine_splits.cuh) exactly as split-KV decoding's.
//
// Grid: (num_splits, m_blocks, batch). A block serves BlockM *packed* query rows of one
// sequence, r = h * seqlen_q + i (query head h, query position i), so one latent tile in
// shared memory serves every query head: each latent byte of a split is read from global
// memory once per row block (m_blocks = 1 when heads_q * seqlen_q <= BlockM, the minimum).
//
// Warps: kRowWarps x kColWarps; warp (wr, wc) = (warp / kColWarps, warp % kColWarps).
// The latent tile is loaded once (cp.async) and used twice:
//   1. S = Q L^T: warp (wr, wc) computes rows [wr * kWarpRows, +kWarpRows) against keys
//      [wc * kWarpKeys, +kWarpKeys) of the tile over the 576-wide latent (mma.sync
//      m16n8k16), and stores its scores (float32) to shared memory;
//   2. the online softmax runs per row on kThreadsPerRow threads (a fixed row per thread,
//      so the running max and sum stay in registers); they write P (the element type) and
//      each row's rescale factor to shared memory;
//   3. O += P V: warp (wr, wc) owns O's rows [wr * kWarpRows, +kWarpRows) and columns
//      [wc * kWarpCols, +kWarpCols): it rescales them, then multiplies P (all the tile's
//      keys) by the tile's first 512 columns (ldmatrix.trans).
// So O's 512 columns are split over kColWarps warps (kWarpCols float accumulators per row
// and thread group instead of 512) and every warp gets all of P through shared memory.
//
// Keys: positions [0, cache_len) of sequence b, cache_len = cache_seqlens[b] read on the
// device; paged: position j is row j % page_size of page block_table[b, j / page_size]
// (any page size); unpaged: row j of the sequence's own rows, passed as page b of
// page_size = max_len. Splits: num_splits even pieces of kSplitAlign-aligned keys
// (decode_traits.cuh, the decode kernel's split contract), so the combine is shared.
// Causal (speculative decoding's few query rows): query position i sees key j iff
// j <= i + cache_len - seqlen_q (bottom-right aligned; the query rows' own keys are already
// in the cache).
//
// FP8 latent cache (Fp8Cache, FlashMLA's 656-byte rows, mla_fp8.cuh): the pipeline's
// cp.async stages hold raw rows (each cache byte read once per row block), and each step
// first dequantises its stage into the one 16-bit latent tile; the rest is unchanged.
//
// Partial outputs (contiguous float32): o_part (num_splits, batch, heads_q, seqlen_q, 512),
// normalised within the split; lse_part (num_splits, batch, heads_q, seqlen_q), natural log;
// -inf (and O = 0) for a row that sees no key of the split (weight 0 in the combine).
//
// Safety: a cache length below 0 or past the capacity, or a block-table entry outside
// [0, num_pages) for a page the split reads, is never followed: the first such error is
// recorded in status[0..3] (decode_traits.cuh kErr*: the decode kernel's codes) and the
// block's partial O and LSE are NaN.
#pragma once

#include "decode_split.cuh"
#include "mla_fp8.cuh"

namespace ft {

// The element type of the cache: Element, or the bytes of FlashMLA's FP8 rows (mla_fp8.cuh).
template <typename Element, bool Fp8Cache>
struct MlaCacheType {
  using Type = Element;
};
template <typename Element>
struct MlaCacheType<Element, true> {
  using Type = unsigned char;
};
template <typename Element>
struct MlaIsBf16 {
  static constexpr bool kValue = false;
};
template <>
struct MlaIsBf16<__nv_bfloat16> {
  static constexpr bool kValue = true;
};

// One variant of the MLA decoding kernel. Shared memory (bytes, in order; the total must
// equal flashtune.families.mla.space.smem_bytes, which the template asserts):
//   Q: BlockM rows | latent: kLatentTiles x BlockN rows (rows of kLatentDim + 8 elements:
//   the forward's padding, so the 8 rows of an ldmatrix phase fall in distinct banks) |
//   raw FP8 rows (Fp8Cache only): NumStages x BlockN rows of 656 bytes |
//   S: BlockM x (BlockN + 4) float | P: BlockM x (BlockN + 8) elements |
//   row factors: BlockM float | row sums: BlockM float | flags: 16 bytes.
// Fp8Cache: the cache holds FlashMLA's FP8 rows; the pipeline's NumStages buffers are raw
// rows, each dequantised into the one latent tile when its step comes (kLatentTiles = 1).
template <typename Element_, int RopeDim, int BlockM, int BlockN, int RowWarps, int ColWarps,
          int NumStages, bool Causal, bool Fp8Cache = false>
struct MlaTraits {
  using Element = Element_;
  using Ops = TensorOps<Element>;
  using CacheElement = typename MlaCacheType<Element, Fp8Cache>::Type;
  static constexpr bool kFp8Cache = Fp8Cache;

  static constexpr int kNopeDim = 512;
  static constexpr int kLatentDim = kNopeDim + RopeDim;
  static constexpr int kVDim = kNopeDim;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kRowWarps = RowWarps;
  static constexpr int kColWarps = ColWarps;
  static constexpr int kNumStages = NumStages;
  static constexpr bool kCausal = Causal;
  static constexpr int kThreads = 32 * RowWarps * ColWarps;

  static constexpr int kWarpRows = BlockM / RowWarps;
  static constexpr int kMTiles = kWarpRows / 16;
  static constexpr int kWarpKeys = BlockN / ColWarps;
  static constexpr int kSTiles = kWarpKeys / 8;
  static constexpr int kWarpCols = kVDim / ColWarps;
  static constexpr int kOTiles = kWarpCols / 8;
  static constexpr int kQkSteps = kLatentDim / 16;
  static constexpr int kPvSteps = BlockN / 16;
  // 32-bit registers per thread held by the S and O accumulator fragments.
  static constexpr int kAccumulatorRegisters = kMTiles * (kSTiles + kOTiles) * 4;

  // Softmax: kThreadsPerRow consecutive threads per row (at most half the tile's keys, so
  // that each handles an even run of keys: P is written in pairs).
  static constexpr int kRowThreadsAll = kThreads / BlockM;
  static constexpr int kThreadsPerRow =
      kRowThreadsAll < BlockN / 2 ? (kRowThreadsAll < 32 ? kRowThreadsAll : 32) : BlockN / 2;
  static constexpr int kKeysPerThread = BlockN / kThreadsPerRow;

  static constexpr int kRowStride = kLatentDim + 8;  // elements
  static constexpr int kSStride = BlockN + 4;        // floats
  static constexpr int kPStride = BlockN + 8;        // elements
  static constexpr int kChunkElems = 8;
  static constexpr int kChunks = kLatentDim / kChunkElems;  // 16-byte chunks per latent row

  static constexpr int kQBytes = BlockM * kRowStride * 2;
  static constexpr int kTileElems = BlockN * kRowStride;
  static constexpr int kLatentTiles = Fp8Cache ? 1 : NumStages;
  static constexpr int kRawStageBytes = Fp8Cache ? BlockN * MlaFp8Row::kBytes : 0;
  static constexpr int kLatentOffsetBytes = kQBytes;
  static constexpr int kRawOffsetBytes = kLatentOffsetBytes + kLatentTiles * kTileElems * 2;
  static constexpr int kSOffsetBytes = kRawOffsetBytes + NumStages * kRawStageBytes;
  static constexpr int kPOffsetBytes = kSOffsetBytes + BlockM * kSStride * 4;
  static constexpr int kFactorOffsetBytes = kPOffsetBytes + BlockM * kPStride * 2;
  static constexpr int kSumOffsetBytes = kFactorOffsetBytes + BlockM * 4;
  static constexpr int kFlagsOffsetBytes = kSumOffsetBytes + BlockM * 4;
  static constexpr int kSmemBytes = kFlagsOffsetBytes + 16;

  // Tiles L_0 .. L_{NumStages-2} are in flight before the loop; before L_j is used, the
  // NumStages - 2 groups committed after it may still be in flight (one stage: none).
  static constexpr int kPipelineWait = NumStages >= 2 ? NumStages - 2 : 0;

  static_assert(sizeof(Element) == 2, "elements are 16-bit (fp16 or bf16)");
  static_assert(!Fp8Cache || (MlaIsBf16<Element>::kValue && RopeDim * 2 ==
                                  MlaFp8Row::kBytes - MlaFp8Row::kRopeOffset),
                "an FP8 latent cache serves bf16 queries (its RoPE part is bf16) and 64 "
                "RoPE dims (FlashMLA's row)");
  static_assert(RopeDim % 16 == 0 && RopeDim >= 16, "the RoPE part comes in k16 steps");
  static_assert(BlockM % (16 * RowWarps) == 0, "each row warp owns whole m16 tiles");
  static_assert(BlockN % (8 * ColWarps) == 0 && BlockN % 16 == 0,
                "each column warp owns whole n8 key tiles; P V takes k16 steps");
  static_assert(kOTiles % 2 == 0, "V loads two n8 column tiles at once");
  static_assert(kThreads >= BlockM, "every row has a softmax thread");
  static_assert(kKeysPerThread % 2 == 0, "P is written in pairs");
  static_assert(BlockM * kThreadsPerRow % 32 == 0, "softmax threads fill whole warps");
  static_assert(NumStages >= 1 && NumStages <= 3, "1 to 3 latent buffers");
  static_assert(kLatentOffsetBytes % 16 == 0 && kRawOffsetBytes % 16 == 0 &&
                    kSOffsetBytes % 16 == 0 &&
                    kPOffsetBytes % 16 == 0 && kFlagsOffsetBytes % 16 == 0,
                "shared regions are 16-byte aligned");
};

// Issue (without committing) the cp.async copies of latent rows [key0, key0 + BlockN) of a
// sequence; keys at or past key_end read nothing and are zero-filled.
template <class Tr>
__device__ __forceinline__ void mla_load_tile(typename Tr::Element* tile,
                                              const typename Tr::Element* cache,
                                              const int* pages, int own_page,
                                              long long page_stride, long long row_stride,
                                              int page_size, int key0, int key_end, int tid) {
  for (int idx = tid; idx < Tr::kBlockN * Tr::kChunks; idx += Tr::kThreads) {
    const int r = idx / Tr::kChunks;
    const int c = idx - r * Tr::kChunks;
    const int j = key0 + r;
    const typename Tr::Element* src = cache;
    if (j < key_end) {
      const int slot = j / page_size;
      const int page = pages != nullptr ? pages[slot] : own_page;
      src = cache + page * page_stride + static_cast<long long>(j - slot * page_size) * row_stride +
            c * Tr::kChunkElems;
    }
    cp_async<16>(tile + r * Tr::kRowStride + c * Tr::kChunkElems, src, j < key_end ? 16 : 0);
  }
}

// Issue the cp.async copies of the block's packed Q rows [m0, m0 + BlockM); rows past
// `rows` are zero-filled. q_seq: query head 0, position 0 of the sequence.
template <class Tr>
__device__ __forceinline__ void mla_load_q(typename Tr::Element* sq,
                                           const typename Tr::Element* q_seq,
                                           long long row_stride, long long head_stride, int m0,
                                           int rows, int seqlen_q, int tid) {
  for (int idx = tid; idx < Tr::kBlockM * Tr::kChunks; idx += Tr::kThreads) {
    const int r = idx / Tr::kChunks;
    const int c = idx - r * Tr::kChunks;
    const int packed = m0 + r;
    const int h = packed / seqlen_q;
    const bool real = packed < rows;
    const typename Tr::Element* src =
        q_seq + static_cast<long long>(packed - h * seqlen_q) * row_stride + h * head_stride +
        c * Tr::kChunkElems;
    cp_async<16>(sq + r * Tr::kRowStride + c * Tr::kChunkElems, real ? src : q_seq,
                 real ? 16 : 0);
  }
}

// The block writes O = o_value and LSE = lse_value for its packed rows.
template <class Tr>
__device__ __forceinline__ void mla_fill_rows(float* o_rows, float* lse_rows, int m0, int rows,
                                              float o_value, float lse_value, int tid) {
  const int end = rows < m0 + Tr::kBlockM ? rows : m0 + Tr::kBlockM;
  for (int idx = m0 * Tr::kVDim + tid; idx < end * Tr::kVDim; idx += Tr::kThreads) {
    o_rows[idx] = o_value;
  }
  for (int r = m0 + tid; r < end; r += Tr::kThreads) lse_rows[r] = lse_value;
}

// S = Q L^T for warp (wr, wc): s[mt][nt] is the m16 x n8 tile of rows wr * kWarpRows + 16 mt
// and keys wc * kWarpKeys + 8 nt; stored to the float S tile.
template <class Tr>
__device__ __forceinline__ void mla_scores(float* ss, const typename Tr::Element* sq,
                                           const typename Tr::Element* tile, int wr, int wc,
                                           int lane) {
  using Ops = typename Tr::Ops;
  float s[Tr::kMTiles][Tr::kSTiles][4];
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < Tr::kSTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
    }
  }
  // A (Q, x4): row lane % 16, column half lane / 16. B (latent rows as K, x2): key lane % 8,
  // column half (lane / 8) % 2 (lanes 16-31 repeat valid addresses).
  const typename Tr::Element* a_base =
      sq + (wr * Tr::kWarpRows + lane % 16) * Tr::kRowStride + (lane / 16) * 8;
  const typename Tr::Element* b_base =
      tile + (wc * Tr::kWarpKeys + lane % 8) * Tr::kRowStride + ((lane / 8) % 2) * 8;
#pragma unroll 2
  for (int kk = 0; kk < Tr::kQkSteps; ++kk) {
    unsigned a[Tr::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
      ldmatrix_x4(a[mt], a_base + mt * 16 * Tr::kRowStride + kk * 16);
    }
#pragma unroll
    for (int nt = 0; nt < Tr::kSTiles; ++nt) {
      unsigned b[2];
      ldmatrix_x2(b, b_base + nt * 8 * Tr::kRowStride + kk * 16);
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) Ops::mma(s[mt][nt], a[mt], b, s[mt][nt]);
    }
  }
  const int g = lane / 4;
  const int t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < Tr::kSTiles; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wr * Tr::kWarpRows + mt * 16 + g + 8 * h;
        const int c = wc * Tr::kWarpKeys + nt * 8 + 2 * t;
        *reinterpret_cast<float2*>(ss + r * Tr::kSStride + c) =
            make_float2(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]);
      }
    }
  }
}

// One row's online softmax over the tile's scores, run by kThreadsPerRow threads that each
// keep the row's running max (scaled, log2 units) and sum.
template <class Tr>
struct MlaRowSoftmax {
  float max_scaled;  // -inf until a visible key
  float sum;

  // Scores of keys key0 + c the row may not see (c >= limit - key0) are dropped; writes the
  // row's P (this thread's kKeysPerThread keys) and, from the row's first thread, the factor
  // the row's O is rescaled by.
  __device__ __forceinline__ void update(const float* srow, typename Tr::Element* prow,
                                         float* factor, int visible, float scale_log2,
                                         int sub) {
    constexpr int kN = Tr::kKeysPerThread;
    const int c0 = sub * kN;
    float x[kN];
    float tile_max = -INFINITY;
#pragma unroll
    for (int e = 0; e < kN; ++e) {
      x[e] = c0 + e < visible ? srow[c0 + e] * scale_log2 : -INFINITY;
      tile_max = fmaxf(tile_max, x[e]);
    }
#pragma unroll
    for (int w = Tr::kThreadsPerRow / 2; w >= 1; w /= 2) {
      tile_max = fmaxf(tile_max, shfl_xor(tile_max, w));
    }
    const float new_max = fmaxf(max_scaled, tile_max);
    // No visible key yet: nothing to rescale (O is 0) and every p is 0.
    const float base = new_max == -INFINITY ? 0.0f : new_max;
    const float alpha = new_max == -INFINITY ? 1.0f : exp2f_fast(max_scaled - new_max);
    float tile_sum = 0.0f;
#pragma unroll
    for (int e = 0; e < kN; e += 2) {
      const float p0 = exp2f_fast(x[e] - base);
      const float p1 = exp2f_fast(x[e + 1] - base);
      tile_sum += p0 + p1;
      *reinterpret_cast<unsigned*>(prow + c0 + e) = Tr::Ops::pack(p0, p1);
    }
#pragma unroll
    for (int w = Tr::kThreadsPerRow / 2; w >= 1; w /= 2) tile_sum += shfl_xor(tile_sum, w);
    sum = sum * alpha + tile_sum;
    max_scaled = new_max;
    if (sub == 0) *factor = alpha;
  }
};

// O = O * factor + P V for warp (wr, wc)'s rows and columns.
template <class Tr>
__device__ __forceinline__ void mla_accumulate(float (&acc)[Tr::kMTiles][Tr::kOTiles][4],
                                               const typename Tr::Element* sp,
                                               const float* factor,
                                               const typename Tr::Element* tile, int wr,
                                               int wc, int lane) {
  using Ops = typename Tr::Ops;
  const int g = lane / 4;
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float f = factor[wr * Tr::kWarpRows + mt * 16 + g + 8 * h];
#pragma unroll
      for (int ot = 0; ot < Tr::kOTiles; ++ot) {
        acc[mt][ot][2 * h] *= f;
        acc[mt][ot][2 * h + 1] *= f;
      }
    }
  }
  // A (P, x4): row lane % 16, key half lane / 16. B (latent as V, x4.trans = two n8 column
  // tiles): key lane % 16, column half lane / 16.
  const typename Tr::Element* a_base =
      sp + (wr * Tr::kWarpRows + lane % 16) * Tr::kPStride + (lane / 16) * 8;
  const typename Tr::Element* b_base =
      tile + (lane % 16) * Tr::kRowStride + wc * Tr::kWarpCols + (lane / 16) * 8;
#pragma unroll
  for (int kk = 0; kk < Tr::kPvSteps; ++kk) {
    unsigned a[Tr::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
      ldmatrix_x4(a[mt], a_base + mt * 16 * Tr::kPStride + kk * 16);
    }
#pragma unroll
    for (int op = 0; op < Tr::kOTiles / 2; ++op) {
      unsigned b[4];
      ldmatrix_x4_trans(b, b_base + kk * 16 * Tr::kRowStride + op * 16);
      const unsigned b0[2] = {b[0], b[1]};
      const unsigned b1[2] = {b[2], b[3]};
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        Ops::mma(acc[mt][2 * op], a[mt], b0, acc[mt][2 * op]);
        Ops::mma(acc[mt][2 * op + 1], a[mt], b1, acc[mt][2 * op + 1]);
      }
    }
  }
}

template <class Tr>
__device__ void mla_decode(const typename Tr::Element* __restrict__ q,
                           const typename Tr::CacheElement* __restrict__ kv_cache,
                           const int* __restrict__ block_table,
                           const int* __restrict__ cache_seqlens, float* __restrict__ o_part,
                           float* __restrict__ lse_part, int* status, int seqlen_q,
                           int heads_q, int num_splits, int page_size, int max_pages,
                           int num_pages, int trap_on_error, long long q_batch_stride,
                           long long q_row_stride, long long q_head_stride,
                           long long kv_page_stride, long long kv_row_stride,
                           long long bt_batch_stride, float softmax_scale) {
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kNumStages;

  const int split = static_cast<int>(blockIdx.x);
  const int m_block = static_cast<int>(blockIdx.y);
  const int batch = static_cast<int>(blockIdx.z);
  const int rows = heads_q * seqlen_q;  // packed rows of the sequence
  const int m0 = m_block * kBlockM;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();
  const int wr = warp / Tr::kColWarps;
  const int wc = warp - wr * Tr::kColWarps;

  const long long out_row0 = (static_cast<long long>(split) * gridDim.z + batch) * rows;
  float* const o_rows = o_part + out_row0 * Tr::kVDim;
  float* const lse_rows = lse_part + out_row0;

  const int cache_len = cache_seqlens[batch];
  if (cache_len < 0 || cache_len > page_size * max_pages) {
    if (tid == 0) {
      record_bad_input(status, cache_len < 0 ? kErrNegativeLength : kErrBeyondCapacity, batch,
                       batch, cache_len, trap_on_error);
    }
    mla_fill_rows<Tr>(o_rows, lse_rows, m0, rows, quiet_nan(), quiet_nan(), tid);
    return;
  }
  const int per_split =
      ((cache_len + num_splits - 1) / num_splits + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
  const int key_begin = split * per_split;
  const int key_end = cache_len < key_begin + per_split ? cache_len : key_begin + per_split;
  if (key_begin >= key_end) {  // an empty split: weight 0 in the combine
    mla_fill_rows<Tr>(o_rows, lse_rows, m0, rows, 0.0f, -INFINITY, tid);
    return;
  }

  FT_DYNAMIC_SMEM(unsigned char, smem);
  const int* pages = block_table != nullptr ? block_table + batch * bt_batch_stride : nullptr;
  if (pages != nullptr) {  // every page the split reads must exist
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
      mla_fill_rows<Tr>(o_rows, lse_rows, m0, rows, quiet_nan(), quiet_nan(), tid);
      return;
    }
  }

  Element* const sq = reinterpret_cast<Element*>(smem);
  Element* const sl = reinterpret_cast<Element*>(smem + Tr::kLatentOffsetBytes);
  unsigned char* const raw = smem + Tr::kRawOffsetBytes;  // FP8 rows (Fp8Cache only)
  float* const ss = reinterpret_cast<float*>(smem + Tr::kSOffsetBytes);
  Element* const sp = reinterpret_cast<Element*>(smem + Tr::kPOffsetBytes);
  float* const factors = reinterpret_cast<float*>(smem + Tr::kFactorOffsetBytes);
  float* const sums = reinterpret_cast<float*>(smem + Tr::kSumOffsetBytes);

  const int n_tiles = (key_end - key_begin + kBlockN - 1) / kBlockN;
  // One cp.async group per tile (Q joins tile 0's); a step past the last tile commits an
  // empty group, which keeps the wait counts uniform.
  auto load = [&](int step) {
    if (step < n_tiles) {
      if constexpr (Tr::kFp8Cache) {
        mla_load_fp8_rows<Tr>(raw + (step % kStages) * Tr::kRawStageBytes, kv_cache, pages,
                              batch, kv_page_stride, kv_row_stride, page_size,
                              key_begin + step * kBlockN, key_end, tid);
      } else {
        mla_load_tile<Tr>(sl + (step % kStages) * Tr::kTileElems, kv_cache, pages, batch,
                          kv_page_stride, kv_row_stride, page_size,
                          key_begin + step * kBlockN, key_end, tid);
      }
    }
    cp_async_commit();
  };
  mla_load_q<Tr>(sq, q + batch * q_batch_stride, q_row_stride, q_head_stride, m0, rows,
                 seqlen_q, tid);
  load(0);
#pragma unroll
  for (int step = 1; step + 1 < kStages; ++step) load(step);

  float acc[Tr::kMTiles][Tr::kOTiles][4];
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int ot = 0; ot < Tr::kOTiles; ++ot) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][ot][e] = 0.0f;
    }
  }
  // The softmax row of this thread (threads past the rows' groups only wait at barriers).
  const int srow = tid / Tr::kThreadsPerRow;
  const int sub = tid - srow * Tr::kThreadsPerRow;
  const bool softmax_thread = srow < kBlockM;
  int limit = key_end;  // keys at or past it are invisible to the row
  if constexpr (Tr::kCausal) {
    const int i = (m0 + srow) % seqlen_q;
    const int diag = i + 1 + cache_len - seqlen_q;
    limit = diag < limit ? diag : limit;
  }
  MlaRowSoftmax<Tr> softmax{-INFINITY, 0.0f};
  const float scale_log2 = softmax_scale * 1.44269504088896340736f;

  for (int j = 0; j < n_tiles; ++j) {
    const int key0 = key_begin + j * kBlockN;
    // L_j has landed for every thread; every warp is done with step j-1 (whose buffer the
    // next load refills, with two or more stages, and whose latent tile an FP8 cache's
    // dequantisation overwrites).
    cp_async_wait<Tr::kPipelineWait>();
    block_sync();
    if constexpr (kStages >= 2) load(j + kStages - 1);
    const Element* const tile = sl + (j % Tr::kLatentTiles) * Tr::kTileElems;
    if constexpr (Tr::kFp8Cache) {
      mla_dequantise_tile<Tr>(sl, raw + (j % kStages) * Tr::kRawStageBytes, tid);
      block_sync();  // the dequantised tile is complete
    }

    mla_scores<Tr>(ss, sq, tile, wr, wc, lane);
    block_sync();  // S complete
    if (softmax_thread) {
      softmax.update(ss + srow * Tr::kSStride, sp + srow * Tr::kPStride, factors + srow,
                     limit - key0, scale_log2, sub);
    }
    block_sync();  // P and the row factors complete
    mla_accumulate<Tr>(acc, sp, factors, tile, wr, wc, lane);
    if constexpr (kStages == 1) {  // one buffer: refill it once every warp is done with it
      block_sync();
      load(j + 1);
    }
  }
  cp_async_wait_all();  // only empty groups remain; leave none behind

  // The row's LSE (natural log) and 1 / sum; a row that saw no key has O = 0, LSE = -inf.
  if (softmax_thread && sub == 0) {
    const bool seen = softmax.sum > 0.0f;
    sums[srow] = seen ? 1.0f / softmax.sum : 0.0f;
    if (m0 + srow < rows) {
      lse_rows[m0 + srow] =
          seen ? softmax.max_scaled * 0.69314718055994530942f + logf(softmax.sum) : -INFINITY;
    }
  }
  block_sync();
  const int g = lane / 4;
  const int t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wr * Tr::kWarpRows + mt * 16 + g + 8 * h;
      if (m0 + r >= rows) continue;
      const float inv = sums[r];
      float* const out = o_rows + static_cast<long long>(m0 + r) * Tr::kVDim +
                         wc * Tr::kWarpCols + 2 * t;
#pragma unroll
      for (int ot = 0; ot < Tr::kOTiles; ++ot) {
        *reinterpret_cast<float2*>(out + ot * 8) =
            make_float2(acc[mt][ot][2 * h] * inv, acc[mt][ot][2 * h + 1] * inv);
      }
    }
  }
}

}  // namespace ft
