// Attention dropout as FlashAttention-2 defines it: each element of the softmax matrix P is
// kept with probability 1 - p and the kept ones are scaled by 1 / (1 - p), after the softmax
// denominator (the LSE is that of the undropped softmax). The kept mask is never stored: a
// counter-based generator (Philox 4x32-10, as FA2 and torch use) draws it from the call's
// (seed, offset) and each element's position, so the backward draws the same mask again.
//
// The mask of element (batch b, query head h, row i, key j), i and j within the sequence:
//   key     = (seed mod 2^32, seed div 2^32)
//   counter = (j / 2, (i / 16) * 8 + i mod 8, lo32(s), hi32(s)),  s = offset + b heads_q + h
//   x       = Philox4x32-10(key, counter)
//   kept    iff x[2 ((i / 8) mod 2) + j mod 2] >= floor(p 2^32)
// One call covers the four elements a lane of an m16n8 accumulator fragment holds: rows i and
// i + 8 (i mod 16 < 8) at keys j and j + 1 (j even). The definition depends on positions
// only, never on tile sizes or warps, so every kernel config (and the forward and the
// backward) draws the same mask, and a host implementation can draw it too
// (flashtune.families.fwd.dropout). A call consumes batch * heads_q values of s: the API
// advances the generator's offset by that much, so consecutive calls draw different masks.
//
// Plain C++ (64-bit products for the 32-bit high halves), so the GPU and the emulator's g++
// build run the same code.
#pragma once

namespace ft {

// Philox 4x32 with 10 rounds (Salmon et al., SC'11; the Random123 constants) on counter c.
// The rounds stay a loop: unrolled, ptxas interleaves the calls of a whole tile and spills
// (NVRTC 13, head dim 64, 128 x 128 tiles, sm_80: 516 bytes unrolled, 72 as a loop).
__device__ __forceinline__ void philox4x32_10(unsigned key0, unsigned key1, unsigned (&c)[4]) {
#pragma unroll 1
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key0 += 0x9E3779B9u;
      key1 += 0xBB67AE85u;
    }
    const unsigned long long p0 = 0xD2511F53ull * c[0];
    const unsigned long long p1 = 0xCD9E8D57ull * c[2];
    const unsigned hi0 = static_cast<unsigned>(p0 >> 32);
    const unsigned hi1 = static_cast<unsigned>(p1 >> 32);
    const unsigned next0 = hi1 ^ c[1] ^ key0;
    const unsigned next2 = hi0 ^ c[3] ^ key1;
    c[1] = static_cast<unsigned>(p1);
    c[3] = static_cast<unsigned>(p0);
    c[0] = next0;
    c[2] = next2;
  }
}

// The dropout state of one lane for one (batch, query head): the generator's key and stream,
// the keep threshold and the scale of the kept elements.
struct DropoutSite {
  unsigned key0 = 0;
  unsigned key1 = 0;
  unsigned long long stream = 0;  // offset + batch * heads_q + head
  unsigned threshold = 0;         // floor(p 2^32): x >= threshold is kept
  float scale = 1.0f;             // 1 / (1 - p)

  __device__ __forceinline__ void init(long long seed, long long offset, float p) {
    const unsigned long long s = static_cast<unsigned long long>(seed);
    key0 = static_cast<unsigned>(s);
    key1 = static_cast<unsigned>(s >> 32);
    stream = static_cast<unsigned long long>(offset);
    // p < 1 (the API refuses 1): the product is below 2^32 and exact in double.
    threshold = static_cast<unsigned>(static_cast<double>(p) * 4294967296.0);
    scale = 1.0f / (1.0f - p);
  }

  // The (batch, query head) whose elements are drawn.
  __device__ __forceinline__ void at(unsigned long long base, int batch, int heads_q,
                                     int head) {
    stream = base + static_cast<unsigned long long>(batch) * heads_q + head;
  }

  // Kept bits of rows (row, row + 8) at keys (col, col + 1): bit 2 h + e for row + 8 h, key
  // col + e. row mod 16 < 8, col even (a fragment lane's first row and column).
  __device__ __forceinline__ unsigned kept(int row, int col) const {
    unsigned c[4] = {static_cast<unsigned>(col) >> 1,
                     (static_cast<unsigned>(row) >> 4) * 8u + (static_cast<unsigned>(row) & 7u),
                     static_cast<unsigned>(stream), static_cast<unsigned>(stream >> 32)};
    philox4x32_10(key0, key1, c);
    return (c[0] >= threshold ? 1u : 0u) | (c[1] >= threshold ? 2u : 0u) |
           (c[2] >= threshold ? 4u : 0u) | (c[3] >= threshold ? 8u : 0u);
  }
};

// The forward's hook on the packed probabilities of one tile (P's A fragments of P V, see
// OnlineSoftmax::update): the dropped elements become 0, after their row sums were taken.
// The kept ones are scaled by 1 / (1 - p) with the row's 1 / sum at the end (scale_rows).
template <class Tr>
struct FwdDropout {
  DropoutSite site;
  int row0;      // the lane's first row (its row of m16 tile 0, h = 0) within the sequence
  int col_lane;  // the lane's first key column within a tile

  template <int kMTiles, int kPvSteps>
  __device__ __forceinline__ void apply(unsigned (&p)[kMTiles][kPvSteps][4], int col0) const {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int nt = 0; nt < 2 * kPvSteps; ++nt) {
        const unsigned bits = site.kept(row0 + mt * 16, col0 + col_lane + nt * 8);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // The packed pair's low half is key col (e = 0), its high half key col + 1.
          const unsigned keep = ((bits >> (2 * h)) & 1u ? 0x0000FFFFu : 0u) |
                                ((bits >> (2 * h + 1)) & 1u ? 0xFFFF0000u : 0u);
          p[mt][nt / 2][2 * (nt % 2) + h] &= keep;
        }
      }
    }
  }

  template <int kMTiles>
  __device__ __forceinline__ void scale_rows(float (&inv_sum)[kMTiles][2]) const {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      inv_sum[mt][0] *= site.scale;
      inv_sum[mt][1] *= site.scale;
    }
  }
};

// No dropout: nothing to hold.
struct NoFwdDropout {};

// The traits of a kernel with dropout compiled in: Base's, with kDropout on.
template <class Base>
struct WithDropout : Base {
  static constexpr bool kDropout = true;
};

}  // namespace ft
