// Block-cooperative copies of the backward kernel: row tiles and per-row statistics from
// global to shared memory (cp.async), and 16-bit fragment rows back to global memory.
//
// Row tiles: global rows have a contiguous head dim, a 16-byte aligned base and a row stride
// that is a multiple of 8 elements, so each 16-byte chunk is one aligned transaction.
#pragma once

#include "fp8.cuh"
#include "primitives.cuh"

namespace ft {

// Rows of (batch, head, seqlen) tensors before batch index `batch`: batch * heads * seqlen.
__device__ __forceinline__ long long batch_rows(int batch, int heads, int seqlen) {
  return static_cast<long long>(batch) * heads * seqlen;
}

// Issue (without committing) cp.async copies of global rows [row0, row0 + ROWS) into a
// shared tile of ROWS rows of Tr::kRowStride elements. Rows at or past row_limit and the
// columns [kHeadDim, kHeadDimMma) read nothing and are zero-filled (zeros keep padded rows
// and dims out of every product). `base` addresses global row 0; it stands in as the unread
// source of zero-filled chunks.
template <class Tr, int ROWS>
__device__ __forceinline__ void copy_tile_async(typename Tr::Element* tile,
                                                const typename Tr::Element* base,
                                                long long row_stride, int row0, int row_limit,
                                                int tid) {
  constexpr int kChunks = ROWS * Tr::kLoadChunks;
#pragma unroll 2
  for (int idx = tid; idx < kChunks; idx += Tr::kThreads) {
    const int r = idx / Tr::kLoadChunks;
    const int c = idx % Tr::kLoadChunks;
    const bool real = c < Tr::kRealChunks && row0 + r < row_limit;
    const typename Tr::Element* src =
        real ? base + static_cast<long long>(row0 + r) * row_stride + c * Tr::kChunkElems : base;
    cp_async<16>(tile + r * Tr::kRowStride + c * Tr::kChunkElems, src, real ? 16 : 0);
  }
}

// Load global FP8 rows [row0, row0 + ROWS) (strides in FP8 values) into a shared 16-bit
// tile as copy_tile_async lays it out, each value converted exactly (Tr::Fp8Format): plain
// loads and shared stores, published by the block barrier that publishes the step's
// cp.async copies. Rows at or past row_limit and padded columns are stored as zeros.
template <class Tr, int ROWS>
__device__ __forceinline__ void load_fp8_tile(typename Tr::Element* tile,
                                              const unsigned char* base, long long row_stride,
                                              int row0, int row_limit, int tid) {
  constexpr int kChunks = ROWS * Tr::kLoadChunks;
#pragma unroll 1
  for (int idx = tid; idx < kChunks; idx += Tr::kThreads) {
    const int r = idx / Tr::kLoadChunks;
    const int c = idx % Tr::kLoadChunks;
    uint2 raw;  // 8 FP8 values, one 16-byte chunk of the tile
    raw.x = raw.y = 0u;
    if (c < Tr::kRealChunks && row0 + r < row_limit) {
      raw = *reinterpret_cast<const uint2*>(
          base + static_cast<long long>(row0 + r) * row_stride + c * Tr::kChunkElems);
    }
    const unsigned words[2] = {raw.x, raw.y};
    unsigned out[4];
    dequantise_words<typename Tr::Fp8Format, typename Tr::Ops>(words, out);
    uint4 chunk;
    chunk.x = out[0], chunk.y = out[1], chunk.z = out[2], chunk.w = out[3];
    *reinterpret_cast<uint4*>(tile + r * Tr::kRowStride + c * Tr::kChunkElems) = chunk;
  }
}

// A tile of Q, K or V (Tr::In): cp.async copies of 16-bit rows, or FP8 rows dequantised.
template <class Tr, int ROWS>
__device__ __forceinline__ void load_input_tile(typename Tr::Element* tile,
                                                const typename Tr::In* base,
                                                long long row_stride, int row0, int row_limit,
                                                int tid) {
  if constexpr (Tr::kFp8) {
    load_fp8_tile<Tr, ROWS>(tile, base, row_stride, row0, row_limit, tid);
  } else {
    copy_tile_async<Tr, ROWS>(tile, base, row_stride, row0, row_limit, tid);
  }
}

// Issue cp.async copies of ROWS floats values[row0 ..] into `dst`; rows at or past row_limit
// are zero-filled.
template <class Tr, int ROWS>
__device__ __forceinline__ void copy_stats_async(float* dst, const float* values, int row0,
                                                 int row_limit, int tid) {
  for (int r = tid; r < ROWS; r += Tr::kThreads) {
    const bool real = row0 + r < row_limit;
    cp_async<4>(dst + r, real ? values + row0 + r : values, real ? 4 : 0);
  }
}

// Store a warp's accumulator fragments (MT m16 tiles x NT n8 tiles) times `scale` as 16-bit
// pairs: fragment row i, column j goes to global row row0 + i (if below row_limit), column
// col0 + j (if below Tr::kHeadDim; columns come in pairs and kHeadDim is a multiple of 8).
template <class Tr, int MT, int NT>
__device__ __forceinline__ void store_fragments(typename Tr::Element* base, long long row_stride,
                                                const float (&acc)[MT][NT][4], float scale,
                                                int row0, int row_limit, int col0, int lane) {
  const int g = lane / 4;
  const int t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + mt * 16 + g + 8 * h;
      if (row >= row_limit) continue;
      typename Tr::Element* out = base + static_cast<long long>(row) * row_stride;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int col = col0 + nt * 8 + 2 * t;
        if (col < Tr::kHeadDim) {
          *reinterpret_cast<unsigned*>(out + col) =
              Tr::Ops::pack(acc[mt][nt][2 * h] * scale, acc[mt][nt][2 * h + 1] * scale);
        }
      }
    }
  }
}

}  // namespace ft
