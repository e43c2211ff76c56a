// The FP8 forward on mma.sync (sm_89 and later): e4m3 or e5m2 Q, K and V, a 16-bit O. What
// differs from the 16-bit forward, as traits and copy streams the main loop picks up
// (WithFp8):
//
//   Q K^T on mma.sync m16n8k32 of the Format (e4m3 or e5m2; exact products, fp32 sums). Q
//     and K are copied to shared memory as they are (bytes, by cp.async); an FP8 row of D
//     values is D / 2 16-bit words, so the 16-bit copy and ldmatrix recipes run unchanged on
//     words: an ldmatrix of a 16-byte half of an FP8 row yields exactly the m16n8k32 A and B
//     fragments (primitives.cuh). Q and K rows take the first half of the shared rows the
//     16-bit kernel of head dim D lays out.
//   P V in the 16-bit type of O (Element), with V dequantised on chip: each thread loads 16
//     FP8 values of a V row from global memory, converts them exactly (every e4m3 and e5m2
//     value is an fp16 and a bf16 value) and stores them to the V stage buffer in the 16-bit
//     layout, where the 16-bit P V (ldmatrix .trans, m16n8k16) reads them. P is rounded to Element,
//     as in the 16-bit kernel. (FP8 P V would need V transposed on chip: ldmatrix .trans has
//     no 8-bit form before sm_100.)
//   Descale factors (float32 (batch, heads_kv), as FA3's q_descale / k_descale / v_descale):
//     q_descale * k_descale joins the softmax scale (the scores and the LSE are those of the
//     dequantised Q and K), v_descale multiplies O with the row's 1 / sum, all in fp32.
//     They must be positive and finite (the running max is taken over unscaled scores).
//
// Contract beyond the forward's (flash_fwd.cuh): q, k, v are FP8 bytes passed as 16-bit
// words (two values each); their strides are in words (the entry halves the element
// strides), so every stride is a multiple of 16 values and the head dim a multiple of 32.
#pragma once

#include "fp8.cuh"
#include "fwd_mainloop.cuh"

namespace ft {

// The descale factors of one launch: float32 (batch, heads_kv), contiguous.
struct Fp8Scales {
  const float* __restrict__ q;
  const float* __restrict__ k;
  const float* __restrict__ v;
};

// A forward's traits with FP8 Q, K and V of one Format (Base: FwdTraits of the 16-bit O type
// and the head dim D).
template <class Base, class Format = E4m3Format>
struct WithFp8 : Base {
  static constexpr bool kFp8 = true;
  using In = unsigned short;  // two FP8 values
  using QkOps = Format;
  using Fp8Format = Format;
  static constexpr int kQkSteps = Base::kHeadDimMma / 32;  // k32 steps of Q K^T
  static_assert(Base::kHeadDim % 32 == 0, "FP8 head dims are multiples of 32");
};

// The copy traits of Q and K rows as 16-bit words: D / 16 chunks of 16 bytes per row, in
// the shared layout of the 16-bit rows (RowCopy, TileStream, load_rows_checked read these).
template <class Tr>
struct Fp8RowsView {
  using Element = typename Tr::In;
  using Smem = typename Tr::Smem;
  static constexpr int kThreads = Tr::kThreads;
  static constexpr int kBlockN = Tr::kBlockN;
  static constexpr int kChunkElems = 8;
  static constexpr int kRealChunks = Tr::kHeadDim / 16;
};

// The stream of V tiles, walked from the last tile down like TileStream: each tile's FP8
// rows are read from global memory and stored dequantised (Element) into a V stage buffer.
// The stores are plain shared-memory stores: the block barrier that publishes a stage's
// cp.async copies before P V reads it publishes them too.
template <class Tr>
struct Fp8VStream {
  using Element = typename Tr::Element;
  static constexpr int kChunks = Tr::kHeadDim / 16;  // 16 FP8 values (16 bytes) per chunk

  const unsigned char* rows;  // row 0 of the tile loaded last
  long long row_bytes;        // the row stride in bytes (FP8 values)

  // A stream whose next tile is `tile` (rows starts one tile above it).
  __device__ __forceinline__ Fp8VStream(const typename Tr::In* base, long long row_stride,
                                        int tile, int)
      : rows(reinterpret_cast<const unsigned char*>(base) +
             (static_cast<long long>(tile) + 1) * Tr::kBlockN * 2 * row_stride),
        row_bytes(2 * row_stride) {}

  // Step to the next tile and store it into `dst`. kChecked: rows at or past rows_valid do
  // not exist and are stored as zeros.
  template <bool kChecked>
  __device__ __forceinline__ void load(Element* dst, int rows_valid, int tid) {
    rows -= Tr::kBlockN * row_bytes;
    // Not unrolled: the step's accumulators already hold most registers.
#pragma unroll 1
    for (int idx = tid; idx < Tr::kBlockN * kChunks; idx += Tr::kThreads) {
      const int r = idx / kChunks;
      const int c = idx % kChunks;
      uint4 raw;
      raw.x = raw.y = raw.z = raw.w = 0u;
      if (!kChecked || r < rows_valid) {
        raw = *reinterpret_cast<const uint4*>(rows + r * row_bytes + 16 * c);
      }
      const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
      unsigned out[8];
      dequantise_words<typename Tr::Fp8Format, typename Tr::Ops>(words, out);
      uint4 first, second;
      first.x = out[0], first.y = out[1], first.z = out[2], first.w = out[3];
      second.x = out[4], second.y = out[5], second.z = out[6], second.w = out[7];
      *reinterpret_cast<uint4*>(dst + Tr::Smem::offset(r, 2 * c)) = first;
      *reinterpret_cast<uint4*>(dst + Tr::Smem::offset(r, 2 * c + 1)) = second;
    }
  }
};

}  // namespace ft
