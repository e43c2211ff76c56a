// Block-cooperative global <-> shared copies of row tiles (rows of one (batch, head)).
//
// Preconditions of every copy here: the global base pointer is 16-byte aligned and the row
// stride is a multiple of 8 elements, so each 16-byte chunk of a row is one aligned
// 128-bit transaction. Global offsets are 64-bit (row * row_stride can pass 2^31).
#pragma once

#include "fwd_traits.cuh"

namespace ft {

// How the block's threads share the copy of a tile of ROWS rows of kRealChunks 16-byte
// chunks (only the real head-dim chunks are copied; zero_pad_columns writes the zero columns
// up to kHeadDimMma once).
//
// kT threads share a row: thread tid takes chunks c0, c0 + kT, c0 + 2 kT, ... (c0 = tid % kT)
// of one row per pass, kRowsPerPass = kThreads / kT rows a pass. Chunks of one row are
// immediate offsets from one source pointer, so a tile costs one 64-bit add per extra pass
// and none per copy. kT is at least 2 (a warp copy then covers whole 32-byte sectors), large
// enough that every thread has a row when the tile has rows for all, at most 4, and divides
// the chunks of a row (1 for an odd count).
//
// Bank conflicts: a 16-byte cp.async writes shared memory in phases of 8 lanes, which cover
// 8 / kT rows of a block of 8; Smem::phase_row picks those rows so that the layout puts
// their chunks in 8 distinct bank groups.
template <class Tr, int ROWS>
struct RowCopy {
  static constexpr int kChunks = Tr::kRealChunks;
  static constexpr int kChunksPow2 = kChunks & -kChunks;  // largest power of two dividing it
  static constexpr int kT = detail::min_int(
      detail::min_int(4, kChunksPow2),
      detail::max_int(2, detail::ceil_pow2(detail::ceil_div(Tr::kThreads, ROWS))));
  static constexpr int kRowsPerPass = Tr::kThreads / kT;
  static constexpr int kPasses = detail::ceil_div(ROWS, kRowsPerPass);
  static constexpr int kRowChunks = kChunks / kT;  // chunks of a row one thread copies
  static_assert(kRowsPerPass % 8 == 0, "rows are assigned in blocks of 8");

  // This thread's shared-memory offsets of its chunks in its rows of a tile.
  using Run = ChunkRun<typename Tr::Smem, kT, kRowChunks>;

  // First row of this thread: q = tid / kT, its block of 8 rows q - q % 8, and its row in
  // the block by the layout's phase order.
  static __device__ __forceinline__ int row(int tid) {
    const int q = tid / kT;
    const int p = q % 8;
    return (q - p) + Tr::Smem::phase_row(p, kT);
  }
  static __device__ __forceinline__ int col(int tid) { return tid % kT; }

  static __device__ __forceinline__ Run run(int tid) {
    Run r;
    r.init(row(tid), col(tid));
    return r;
  }

  // Issue (without committing) this thread's copies into the shared tile `tile`, whose
  // offsets for this thread are `run`. `src`: the thread's chunk c0 of its first row r of
  // the tile (global). kChecked: rows at or past rows_valid (counted from the tile's first
  // row) read nothing and are zero-filled from `safe`, an address that is always readable
  // (it is not read); unchecked copies assume every row exists.
  template <bool kChecked>
  static __device__ __forceinline__ void issue(typename Tr::Element* tile, const Run& run,
                                               const typename Tr::Element* src,
                                               long long row_stride, int rows_valid,
                                               const typename Tr::Element* safe, int tid) {
    const long long pass_stride = kRowsPerPass * row_stride;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      // The row is needed only for a ragged last pass or a bounds check.
      const int ri = row(tid) + i * kRowsPerPass;
      if (ROWS % kRowsPerPass == 0 || ri < ROWS) {
        const bool real = !kChecked || ri < rows_valid;
#pragma unroll
        for (int j = 0; j < kRowChunks; ++j) {
          typename Tr::Element* to = tile + run.at(j, i * kRowsPerPass);
          if constexpr (kChecked) {
            cp_async<16>(to, real ? src + j * kT * Tr::kChunkElems : safe, real ? 16 : 0);
          } else {
            cp_async<16>(to, src + j * kT * Tr::kChunkElems, 16);
          }
        }
      }
      if (i + 1 < kPasses) src += pass_stride;
    }
  }
};

// This thread's part of the copy of a whole tile, for ROWS rows starting at global row
// row0 of a (batch, head) whose row 0 is `base`; rows at or past row_limit are zero-filled.
template <class Tr, int ROWS>
__device__ __forceinline__ void load_rows_checked(typename Tr::Element* dst,
                                                  const typename Tr::Element* base,
                                                  long long row_stride, int row0,
                                                  int row_limit, int tid) {
  using Copy = RowCopy<Tr, ROWS>;
  const typename Tr::Element* safe = base + Copy::col(tid) * Tr::kChunkElems;
  const typename Tr::Element* src =
      safe + static_cast<long long>(row0 + Copy::row(tid)) * row_stride;
  Copy::template issue<true>(dst, Copy::run(tid), src, row_stride, row_limit - row0, safe,
                             tid);
}

// One stream of key (or value) tiles, walked from the last tile down: this thread's source
// pointer moves by a constant -kBlockN rows per tile, so a tile costs one 64-bit add here
// and one per extra pass of the copy.
template <class Tr>
struct TileStream {
  using Element = typename Tr::Element;
  using Copy = RowCopy<Tr, Tr::kBlockN>;

  const Element* src;     // this thread's first chunk in the tile loaded last
  const Element* safe;    // this thread's chunk of row 0 (readable; zero-fill stand-in)
  long long row_stride;
  long long tile_step;    // -kBlockN rows
  typename Copy::Run run;  // this thread's chunks in a shared tile

  // A stream whose next tile is `tile` (src starts one tile above it and is never read
  // there).
  __device__ __forceinline__ TileStream(const Element* base, long long row_stride_, int tile,
                                        int tid)
      : row_stride(row_stride_), tile_step(-Tr::kBlockN * row_stride_), run(Copy::run(tid)) {
    safe = base + Copy::col(tid) * Tr::kChunkElems;
    src = safe + ((static_cast<long long>(tile) + 1) * Tr::kBlockN + Copy::row(tid)) *
                     row_stride_;
#pragma unroll
    for (int v = 0; v < Copy::Run::kVariants; ++v) run.base[v] = keep_in_register(run.base[v]);
  }

  // Step to the next tile and issue its copies into `dst`. kChecked: the tile may be
  // partial (rows_valid rows exist); only the first tile walked can be.
  template <bool kChecked>
  __device__ __forceinline__ void load(Element* dst, int rows_valid, int tid) {
    src += tile_step;
    Copy::template issue<kChecked>(dst, run, src, row_stride, rows_valid, safe, tid);
  }
};

// Zeros in the columns [RealChunks, LoadChunks) (16-byte chunks) of kRows shared rows of
// the layout Smem from `rows`, shared by the block's kThreads threads.
template <class Smem, int RealChunks, int LoadChunks, int kRows, int kThreads, class Element>
__device__ __forceinline__ void zero_pad_rows(Element* rows, int tid) {
  constexpr int kPad = LoadChunks - RealChunks;
  if constexpr (kPad > 0) {
    uint4 zero;
    zero.x = zero.y = zero.z = zero.w = 0u;
    for (int idx = tid; idx < kRows * kPad; idx += kThreads) {
      const int row = idx / kPad;
      const int c = RealChunks + idx % kPad;
      *reinterpret_cast<uint4*>(rows + Smem::offset(row, c)) = zero;
    }
  }
}

// Write zeros, once per block, into the head-dim columns [kHeadDim, kHeadDimMma) of every
// shared row (Q and all K/V stages): the tensor cores read them, no copy ever writes them,
// and zeros keep them out of Q K^T and P V. Nothing to do when kHeadDim is a multiple of 16.
// With V's head dim split from Q/K's (Tr::kSplitV), V's rows take V's columns
// [kHeadDimV, kHeadDimVMma) in their own layout.
template <class Tr>
__device__ __forceinline__ void zero_pad_columns(typename Tr::Element* smem, int tid) {
  if constexpr (Tr::kSplitV) {
    zero_pad_rows<typename Tr::Smem, Tr::kRealChunks, Tr::kLoadChunks, Tr::kQkRows,
                  Tr::kThreads>(smem, tid);
    zero_pad_rows<typename Tr::VSmem, Tr::kHeadDimV / 8, Tr::kHeadDimVMma / 8,
                  Tr::kNumStages * Tr::kBlockN, Tr::kThreads>(smem + Tr::kVOffset, tid);
  } else {
    zero_pad_rows<typename Tr::Smem, Tr::kRealChunks, Tr::kLoadChunks, Tr::kSmemRows,
                  Tr::kThreads>(smem, tid);
  }
}

// One warp copies its finished rows of O from shared memory to global memory, 128 bits per
// store: shared rows [warp_row0, warp_row0 + kWarpRows) of the tile `smem` go to global rows
// row0 + warp_row0 + r below row_limit, real head-dim columns only.
template <class Tr>
__device__ __forceinline__ void store_warp_rows(typename Tr::Element* base, long long row_stride,
                                                const typename Tr::Element* smem, int warp_row0,
                                                int row0, int row_limit, int lane) {
  constexpr int kChunks = Tr::kWarpRows * Tr::kRealChunks;
  constexpr int kIters = (kChunks + 31) / 32;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int idx = i * 32 + lane;
    const int r = warp_row0 + idx / Tr::kRealChunks;
    const int c = idx % Tr::kRealChunks;
    if ((kChunks % 32 == 0 || idx < kChunks) && row0 + r < row_limit) {
      const uint4 chunk = *reinterpret_cast<const uint4*>(smem + Tr::Smem::offset(r, c));
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
