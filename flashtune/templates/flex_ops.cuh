// The helpers traced score and mask modifications call (codegen.trace renders expressions
// of the scaled score with these, the CUDA math functions and C++ operators only).
//
// Integer // and % follow Python's (and torch's) floor semantics, not C's truncation, so
// that a traced expression means on the device what it meant in the user's function.
// A captured tensor is read with an index per dim: a negative index counts from the end,
// as in torch, and an index past either end is clamped into the tensor (the kernel also
// evaluates positions past the sequences' ends, whose scores it then hides).
#pragma once

namespace ft {

// No declared score modifications (the kernel applies none).
struct NoScoreMods {
  static constexpr bool kOn = false;
  static constexpr bool kTileRanges = false;  // no block mask's key tile ranges
  static constexpr bool kGrad = false;        // no backward hook (grad)
};

namespace flex {

__device__ __forceinline__ int floordiv(int a, int b) {
  const int q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

__device__ __forceinline__ int mod(int a, int b) {
  const int r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

__device__ __forceinline__ float fmodpy(float a, float b) {
  const float r = fmodf(a, b);
  return (r != 0.0f && ((r < 0.0f) != (b < 0.0f))) ? r + b : r;
}

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ int iabs(int a) { return a < 0 ? -a : a; }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Index i of a dim of n elements: from the end when negative, then clamped to [0, n).
__device__ __forceinline__ long long at(int i, int n) {
  const int j = i < 0 ? i + n : i;
  return j < 0 ? 0 : (j >= n ? n - 1 : j);
}

template <class T>
__device__ __forceinline__ T load1(const T* p, int i0, int n0) {
  return p[at(i0, n0)];
}
template <class T>
__device__ __forceinline__ T load2(const T* p, int i0, int n0, int i1, int n1) {
  return p[at(i0, n0) * n1 + at(i1, n1)];
}
template <class T>
__device__ __forceinline__ T load3(const T* p, int i0, int n0, int i1, int n1, int i2,
                                   int n2) {
  return p[(at(i0, n0) * n1 + at(i1, n1)) * n2 + at(i2, n2)];
}
template <class T>
__device__ __forceinline__ T load4(const T* p, int i0, int n0, int i1, int n1, int i2, int n2,
                                   int i3, int n3) {
  return p[((at(i0, n0) * n1 + at(i1, n1)) * n2 + at(i2, n2)) * n3 + at(i3, n3)];
}

// A block mask's key tiles for query tile m of (b, h): ranges is int32 (nb, nh, nm, 4), nb
// and nh 1 when the mask does not vary with the batch or the head; per query tile the key
// tiles [lo, hi) it walks and [full_lo, full_hi), those whose every key every row sees.
__device__ __forceinline__ void tile_range(const int* ranges, int nb, int nh, int nm, int b,
                                           int h, int m, int& lo, int& hi, int& full_lo,
                                           int& full_hi) {
  const long long at_bhm =
      (static_cast<long long>(b < nb ? b : nb - 1) * nh + (h < nh ? h : nh - 1)) * nm +
      (m < nm ? m : nm - 1);
  lo = ranges[4 * at_bhm];
  hi = ranges[4 * at_bhm + 1];
  full_lo = ranges[4 * at_bhm + 2];
  full_hi = ranges[4 * at_bhm + 3];
}

// A block mask's hook in the backward's column form (api.block_mask): of key tile n_block's
// query tiles [m_first, m_end), only those in the union over the group's query heads
// (kv_head * group ..) of the tiles holding a row that sees one of its keys remain; the
// others are never loaded or computed.
template <class Mods>
__device__ __forceinline__ void clip_query_tiles(const Mods& mods, int batch, int kv_head,
                                                 int group, int n_block, int m_blocks,
                                                 int& m_first, int& m_end) {
  int lo = m_blocks;
  int hi = 0;
  for (int g = 0; g < group; ++g) {
    int g_lo = 0;
    int g_hi = 0;
    int full_lo = 0;
    int full_hi = 0;
    mods.tile_range(batch, kv_head * group + g, n_block, g_lo, g_hi, full_lo, full_hi);
    if (g_hi > g_lo) {
      lo = g_lo < lo ? g_lo : lo;
      hi = g_hi > hi ? g_hi : hi;
    }
  }
  m_first = m_first > lo ? m_first : lo;
  m_end = m_end < hi ? m_end : hi;
}

// Whether query tile m_block of head is one of key tile n_block's partial tiles (its mask
// evaluated; a full tile, every row seeing every key, skips it).
template <class Mods>
__device__ __forceinline__ bool partial_query_tile(const Mods& mods, int batch, int head,
                                                   int n_block, int m_block) {
  int lo = 0;
  int hi = 0;
  int full_lo = 0;
  int full_hi = 0;
  mods.tile_range(batch, head, n_block, lo, hi, full_lo, full_hi);
  return m_block < full_lo || m_block >= full_hi;
}

}  // namespace flex
}  // namespace ft
