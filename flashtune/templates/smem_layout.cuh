// Shared-memory layouts of the forward kernel's row tiles (Q, K, V: rows of head-dim
// elements, 16-bit), in 16-byte chunks: where chunk c of row r lives, as an element offset
// from the tile.
//
// Both layouts keep the eight 16-byte rows an ldmatrix phase reads (eight consecutive rows,
// one chunk column) in eight distinct bank groups (a bank group: 16 bytes of the 128 that
// one shared-memory wavefront serves), and the chunks one cp.async phase of 8 lanes writes
// too, given the rows RowCopy puts in one phase (phase_row).
//
//   PaddedRows: rows of RowChunks chunks plus one chunk of padding, so consecutive rows
//     start one bank group apart. Costs 16 bytes a row.
//   SwizzledRows: unpadded rows; chunk c of row r is stored at c ^ swz(r) within its
//     aligned group of kGroup chunks (8 when the row has a multiple of 8 chunks, else 4).
//     swz(r) = r mod 8 (group 8); (r / 2) mod 4 (group 4: a row is 64 bytes past a bank
//     line, so the parity of r moves it by 4 bank groups and swz spreads the other 4).
#pragma once

namespace ft {

template <int RowChunks>
struct PaddedRows {
  static constexpr int kRowStride = (RowChunks + 1) * 8;  // elements
  static constexpr bool kLinear = true;  // offset(r, c + d) = offset(r, c) + 8 d
  static constexpr int kGroup = 1;

  static __host__ __device__ constexpr int offset(int r, int c) {
    return r * kRowStride + c * 8;
  }
  // Row of group p (0..7) of a block of 8 rows when kT threads share a row: a phase of 8
  // lanes covers 8 / kT rows, spaced kT apart. Rows of an odd number of bank groups (here
  // RowChunks + 1, RowChunks a multiple of 4: 1 or 5 mod 8) then spread the phase over all
  // 8 bank groups.
  static __host__ __device__ constexpr int phase_row(int p, int t) {
    return (p % (8 / t)) * t + p / (8 / t);
  }
};

template <int RowChunks>
struct SwizzledRows {
  static_assert(RowChunks % 4 == 0, "a swizzled row holds a multiple of 4 chunks");
  static constexpr int kRowStride = RowChunks * 8;
  static constexpr bool kLinear = false;
  static constexpr int kGroup = RowChunks % 8 == 0 ? 8 : 4;

  static __host__ __device__ constexpr int swizzle(int r) {
    return kGroup == 8 ? (r & 7) : ((r >> 1) & 3);
  }
  static __host__ __device__ constexpr int offset(int r, int c) {
    return r * kRowStride + (c ^ swizzle(r)) * 8;
  }
  // Group 8: as PaddedRows (rows kT apart: their swizzles differ in the bits above the
  // kT - 1 chunks a row's threads cover). Group 4: the rows of a phase must differ in
  // parity (4 bank groups) and, with 2 threads a row, in bit 2 (the swizzle's high bit):
  // rows {0, 1} per phase for 4 threads, {0, 1, 4, 5} and {2, 3, 6, 7} for 2.
  static __host__ __device__ constexpr int phase_row(int p, int t) {
    if (kGroup == 8 || t == 1) return PaddedRows<RowChunks>::phase_row(p, t);
    if (t == 4) return p;
    return (p & 1) + ((p >> 1) & 1) * 4 + ((p >> 2) & 1) * 2;
  }
};

// The element offsets one thread uses for a run of chunk columns c0, c0 + Step, ... of row
// r and of the rows r + 8 k (which share r's swizzle): it keeps kVariants offsets (one for
// a linear layout; kGroup / Step for a swizzled one, whose pattern repeats every kGroup
// chunks) and adds constants for the rest, so that each use costs at most an immediate.
template <class Layout, int Step, int Count>
struct ChunkRun {
  static_assert(Layout::kLinear || Layout::kGroup % Step == 0,
                "a swizzle group holds whole steps");
  static constexpr int kPeriod = Layout::kLinear ? 1 : Layout::kGroup / Step;
  static constexpr int kVariants = Count < kPeriod ? Count : kPeriod;
  int base[kVariants];

  __device__ __forceinline__ void init(int r, int c0) {
#pragma unroll
    for (int v = 0; v < kVariants; ++v) base[v] = Layout::offset(r, c0 + v * Step);
  }
  // Offset of chunk c0 + j * step in row r + dr (dr a multiple of 8; j, dr compile-time).
  __device__ __forceinline__ int at(int j, int dr = 0) const {
    return base[j % kVariants] + (j - j % kVariants) * Step * 8 + dr * Layout::kRowStride;
  }
};

}  // namespace ft
