// Block-cooperative global <-> shared copies of row tiles (rows of one (batch, head)).
//
// Preconditions of every copy here: the global base pointer is 16-byte aligned and the row
// stride is a multiple of 8 elements, so each 16-byte chunk of a row is one aligned
// 128-bit transaction.
#pragma once

#include "fwd_traits.cuh"

namespace ft {

// Issue (without committing) the cp.async copies of global rows [row0, row0 + ROWS) of one
// (batch, head) into a shared tile of ROWS rows. Rows at or past row_limit, and the head-dim
// columns in [kHeadDim, kHeadDimMma), read nothing and are zero-filled: the zeros keep
// padded keys and dims out of Q K^T and P V. `base` addresses row 0 of the (batch, head);
// it stands in as the (unread) source of zero-filled chunks.
template <class Tr, int ROWS>
__device__ __forceinline__ void load_rows_async(typename Tr::Element* smem_tile,
                                                const typename Tr::Element* base,
                                                long long row_stride, int row0, int row_limit,
                                                int tid) {
  // Each thread copies one fixed chunk column c of rows r, r + kRowsPerIter, ... so that its
  // source pointer only advances by a constant; when kThreads is not a multiple of the
  // chunks per row, the last few threads idle.
  constexpr int kRowsPerIter = Tr::kThreads / Tr::kLoadChunks;
  constexpr int kIters = (ROWS + kRowsPerIter - 1) / kRowsPerIter;
  static_assert(kRowsPerIter >= 1, "a block copies at least one row per step");
  const int c = tid % Tr::kLoadChunks;
  const int r0 = tid / Tr::kLoadChunks;
  if (r0 >= kRowsPerIter) return;
  const bool real_col = c < Tr::kRealChunks;
  const typename Tr::Element* src =
      base + static_cast<long long>(row0 + r0) * row_stride + c * Tr::kChunkElems;
  typename Tr::Element* dst = smem_tile + r0 * Tr::kRowStride + c * Tr::kChunkElems;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int r = r0 + i * kRowsPerIter;
    if (ROWS % kRowsPerIter == 0 || r < ROWS) {
      const bool real = real_col && row0 + r < row_limit;
      cp_async<16>(dst + i * kRowsPerIter * Tr::kRowStride, real ? src : base, real ? 16 : 0);
    }
    src += kRowsPerIter * row_stride;
  }
}

// One warp copies its finished rows of O from shared memory to global memory, 128 bits per
// store: local rows [0, kWarpRows) of `smem_rows` go to global rows row0 + r < row_limit,
// real head-dim columns only.
template <class Tr>
__device__ __forceinline__ void store_warp_rows(typename Tr::Element* base, long long row_stride,
                                                const typename Tr::Element* smem_rows, int row0,
                                                int row_limit, int lane) {
  constexpr int kChunks = Tr::kWarpRows * Tr::kRealChunks;
  constexpr int kIters = (kChunks + 31) / 32;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int idx = i * 32 + lane;
    const int r = idx / Tr::kRealChunks;
    const int c = idx % Tr::kRealChunks;
    if ((kChunks % 32 == 0 || idx < kChunks) && row0 + r < row_limit) {
      const uint4 chunk = *reinterpret_cast<const uint4*>(smem_rows + r * Tr::kRowStride +
                                                          c * Tr::kChunkElems);
      *reinterpret_cast<uint4*>(base + static_cast<long long>(row0 + r) * row_stride +
                                c * Tr::kChunkElems) = chunk;
    }
  }
}

// The whole block writes O = 0 and LSE = +inf for its rows [row0, row0 + kBlockM) that are
// below row_limit: the rows that see no key at all.
template <class Tr>
__device__ __forceinline__ void store_empty_rows(typename Tr::Element* o_base, long long row_stride,
                                                 float* lse_rows, int row0, int row_limit,
                                                 int tid) {
  constexpr int kChunks = Tr::kBlockM * Tr::kRealChunks;
  uint4 zero;
  zero.x = zero.y = zero.z = zero.w = 0u;
  for (int idx = tid; idx < kChunks; idx += Tr::kThreads) {
    const int r = idx / Tr::kRealChunks;
    const int c = idx % Tr::kRealChunks;
    if (row0 + r < row_limit) {
      *reinterpret_cast<uint4*>(o_base + static_cast<long long>(row0 + r) * row_stride +
                                c * Tr::kChunkElems) = zero;
    }
  }
  for (int r = tid; r < Tr::kBlockM; r += Tr::kThreads) {
    if (row0 + r < row_limit) lse_rows[row0 + r] = INFINITY;
  }
}

}  // namespace ft
