// Compile-time shape of one attention backward kernel variant (flash_bwd.cuh): tile sizes,
// the three warp layouts of its products, the shared-memory layout and the element type's
// tensor-core operations.
#pragma once

#include "tensor_ops.cuh"

namespace ft {

__host__ __device__ constexpr int const_min(int a, int b) { return a < b ? a : b; }

// One variant of the backward kernel.
//
// Each block owns BlockN keys (of one kv head) at a time and steps over query tiles of
// BlockM rows (of every query head of the kv head's group). Per step:
//   1. S = Q K^T and dP = dO V^T: warp w owns query rows [w kWarpRows, (w+1) kWarpRows) and
//      every key of the tile; P = exp(S scale - LSE) and dS = P (dP - D) are rounded to
//      16 bits into shared memory (sP, sdS, [query][key]).
//   2. dV += P^T dO and dK += dS^T Q: warps split the keys (kWarpsN) and the head dim
//      (kWarpsD); the accumulators live in registers for the whole key tile (for head
//      dims 512 and 576, one output column chunk of them: WithBwdColumnChunks).
//   3. dQ = dS K for the warp's own query rows, kDqChunk head-dim columns at a time, added
//      to a float32 accumulator in global memory.
//
// HeadDim is the real head dim (a multiple of 8); the tensor cores work on it rounded up to
// 16 (kHeadDimMma), the extra columns zero-filled on load and never stored.
//
// Shared memory, in 16-bit elements then floats:
//   [ K | V : BlockN rows each | Q | dO : NumStages x BlockM rows each | P | dS : BlockM rows
//     of kPRowStride | LSE | D : NumStages x BlockM floats each ]
// Row strides are padded by RowPad elements (16 bytes) so that the eight rows of an ldmatrix
// phase fall in distinct bank groups. The total must equal the family's smem_bytes (the
// template asserts it).
//
// Attention features (the forward's, flash_fwd.cuh; each compiled in or out): Local, a
// sliding window (query tiles outside the window of every key of a tile are not visited);
// Softcap (the scores' tanh, and its derivative in dS); Alibi (the forward's bias); Varlen
// (sequences packed along the rows, cu_seqlens on the device: a block's batch index is its
// sequence, and every mask and length is that sequence's).
template <typename Element_, int HeadDim, int BlockM, int BlockN, int NumWarps,
          int NumStages, bool Causal, bool DqSplit, int RowPad, bool Local = false,
          bool Softcap = false, bool Alibi = false, bool Varlen = false>
struct BwdTraits {
  using Element = Element_;
  using Ops = TensorOps<Element>;
  // The type of Q, K and V in global memory: Element, or FP8 bytes in WithFp8Inputs<...>.
  using In = Element_;
  static constexpr bool kFp8 = false;

  static constexpr int kHeadDim = HeadDim;
  static constexpr int kHeadDimMma = (HeadDim + 15) / 16 * 16;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kNumWarps = NumWarps;
  static constexpr int kThreads = 32 * NumWarps;
  static constexpr int kNumStages = NumStages;
  static constexpr bool kCausal = Causal;
  static constexpr bool kLocal = Local;
  static constexpr bool kSoftcap = Softcap;
  static constexpr bool kAlibi = Alibi;
  static constexpr bool kVarlen = Varlen;
  static constexpr bool kDropout = false;  // on in WithDropout<...> (dropout.cuh)
  static_assert(!(Causal && Local), "a causal sliding window is the window (left, 0)");
  // dQ: true = each block adds into its own float32 slice in a fixed order (deterministic),
  // false = float32 atomics into one accumulator.
  static constexpr bool kDqSplit = DqSplit;

  // Steps 1 and 3: warp w owns kWarpRows query rows.
  static constexpr int kWarpRows = BlockM / NumWarps;
  static constexpr int kMTiles = kWarpRows / 16;
  static constexpr int kKeyTiles = BlockN / 8;          // n8 tiles of S over the keys
  static constexpr int kDimTiles = kHeadDimMma / 8;     // n8 tiles over the head dim
  // Step 3 works on at most 8 head-dim tiles (64 columns) at a time.
  static constexpr int kDqChunk = const_min(kDimTiles, 8);
  // Step 2: warps split keys first (16 rows each at least), then the head dim.
  static constexpr int kWarpsN = const_min(NumWarps, BlockN / 16);
  static constexpr int kWarpsD = NumWarps / kWarpsN;
  static constexpr int kWarpKeys = BlockN / kWarpsN;
  static constexpr int kKvTiles = kWarpKeys / 16;       // m16 tiles of dK, dV per warp
  static constexpr int kKvDimTiles = kDimTiles / kWarpsD;  // n8 tiles of dK, dV per warp
  // Output column chunks (WithBwdColumnChunks splits them): a block accumulates dK, dQ
  // over kChunkCols of Q/K's columns and dV over kChunkColsV of V's, chunk blockIdx.y /
  // heads_kv; here one chunk, the whole head dims.
  static constexpr int kChunks = 1;
  static constexpr int kChunkCols = HeadDim;
  static constexpr int kChunkColsV = HeadDim;
  static constexpr int kChunkTiles = kDimTiles;  // n8 tiles of a chunk of dK and dQ

  // Shared-memory layout (elements of Element, then floats).
  static constexpr int kRowStride = kHeadDimMma + RowPad;
  static constexpr int kPRowStride = BlockN + RowPad;
  static constexpr int kKvElems = BlockN * kRowStride;
  static constexpr int kQElems = BlockM * kRowStride;
  static constexpr int kPElems = BlockM * kPRowStride;
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKvElems;
  static constexpr int kQOffset = 2 * kKvElems;
  static constexpr int kDoOffset = kQOffset + NumStages * kQElems;
  static constexpr int kPOffset = kDoOffset + NumStages * kQElems;
  static constexpr int kDsOffset = kPOffset + kPElems;
  static constexpr int kElems = kDsOffset + kPElems;
  static constexpr int kStatsBytes = 2 * NumStages * BlockM * 4;
  static constexpr int kSmemBytes = kElems * 2 + kStatsBytes;

  // 16-byte chunks of a row: loaded (zero-filled up to kHeadDimMma) and real.
  static constexpr int kChunkElems = 8;
  static constexpr int kLoadChunks = kHeadDimMma / kChunkElems;
  static constexpr int kRealChunks = HeadDim / kChunkElems;

  // V's (and dO's, dV's) head dim: Q/K's here; WithBwdHeadDimV splits it.
  static constexpr bool kSplitV = false;
  static constexpr int kHeadDimV = HeadDim;
  static constexpr int kHeadDimVMma = kHeadDimMma;
  static constexpr int kVRowStride = kRowStride;  // V's and dO's shared rows
  static constexpr int kDoElems = kQElems;        // one dO buffer
  static constexpr int kKvDimTilesV = kKvDimTiles;  // n8 tiles of dV per warp

  static_assert(sizeof(Element) == 2, "elements are 16-bit (fp16 or bf16)");
  static_assert(HeadDim % 8 == 0 && HeadDim >= 8 &&
                    (HeadDim <= 256 || HeadDim == 512 || HeadDim == 576),
                "head dim must be a multiple of 8 up to 256, or 512 or 576");
  static_assert(RowPad % 8 == 0, "row pad must keep rows 16-byte aligned");
  static_assert(BlockM % (16 * NumWarps) == 0, "each warp owns whole m16 tiles of queries");
  static_assert(BlockN % 16 == 0 && BlockN >= 16, "keys come in k16 steps");
  static_assert(kWarpsN * kWarpsD == NumWarps && BlockN % (16 * kWarpsN) == 0,
                "warps split the keys in m16 tiles");
  static_assert(kDimTiles % kWarpsD == 0, "warps split the head dim in whole n8 tiles");
  static_assert(NumStages == 1 || NumStages == 2, "one or two Q/dO buffers");
};

// A backward's traits with V's head dim HeadDimV other than Q/K's (Base: BwdTraits of
// Q/K's). S = Q K^T, dK and dQ run over Q/K's head dim; dP = dO V^T over V's (its k steps),
// dV += P^T dO over V's n8 tiles (split over the same kWarpsD warps as dK's). V's tile and
// the dO buffers take rows of V's padded dim:
//   [ K | V | Q : NumStages | dO : NumStages | P | dS | LSE | D ].
template <class Base, int HeadDimV>
struct WithBwdHeadDimV : Base {
  static constexpr bool kSplitV = true;
  static constexpr int kHeadDimV = HeadDimV;
  static constexpr int kHeadDimVMma = (HeadDimV + 15) / 16 * 16;
  static constexpr int kVRowStride = kHeadDimVMma + (Base::kRowStride - Base::kHeadDimMma);
  static constexpr int kDoElems = Base::kBlockM * kVRowStride;
  static constexpr int kKvDimTilesV = kHeadDimVMma / 8 / Base::kWarpsD;
  static constexpr int kChunkColsV = HeadDimV;
  static constexpr int kQOffset = Base::kKvElems + Base::kBlockN * kVRowStride;
  static constexpr int kDoOffset = kQOffset + Base::kNumStages * Base::kQElems;
  static constexpr int kPOffset = kDoOffset + Base::kNumStages * kDoElems;
  static constexpr int kDsOffset = kPOffset + Base::kPElems;
  static constexpr int kElems = kDsOffset + Base::kPElems;
  static constexpr int kSmemBytes = kElems * 2 + Base::kStatsBytes;

  static_assert(HeadDimV % 8 == 0 && HeadDimV >= 8 &&
                    (HeadDimV <= 256 || (HeadDimV == 512 && Base::kHeadDim >= 512)),
                "V's head dim must be a multiple of 8 up to 256, or 512 beside Q/K's 512 or 576");
  static_assert((kHeadDimVMma / 8) % Base::kWarpsD == 0,
                "warps split V's head dim in whole n8 tiles");
  static_assert(!Base::kFp8, "FP8 inputs take Q/K's head dim for V");
};

// A backward's traits whose blocks each accumulate one of Chunks output column chunks
// (Base: BwdTraits, or WithBwdHeadDimV of it): the head dims above 256 (512, 576), whose
// dK and dV of a whole key tile outgrow a thread's registers. S = Q K^T and dP = dO V^T
// still run over the full head dims (Q, K, V and dO tiles stay full width in shared
// memory, the layout unchanged), so every chunk's block recomputes them; it then adds only
// dK[:, c] += dS^T Q[:, c], dV[:, c] += P^T dO[:, c] and dQ[:, c] += dS K[:, c], columns
// c = [chunk kChunkCols, (chunk + 1) kChunkCols) of Q/K's head dim (kChunkColsV of V's).
// The chunk is blockIdx.y / heads_kv (the grid's y is heads_kv x Chunks); chunks write
// disjoint columns of dK, dV and the dQ accumulator, so the dQ modes keep their order.
template <class Base, int Chunks>
struct WithBwdColumnChunks : Base {
  static constexpr int kChunks = Chunks;
  static constexpr int kChunkCols = Base::kHeadDim / Chunks;
  static constexpr int kChunkColsV = Base::kHeadDimV / Chunks;
  static constexpr int kChunkTiles = kChunkCols / 8;
  static constexpr int kKvDimTiles = kChunkTiles / Base::kWarpsD;
  static constexpr int kKvDimTilesV = kChunkColsV / 8 / Base::kWarpsD;
  static constexpr int kDqChunk = const_min(kChunkTiles, 8);

  static_assert(Chunks >= 2, "one chunk is the plain traits");
  static_assert(Base::kHeadDim % (Chunks * 8 * Base::kWarpsD) == 0 &&
                    Base::kHeadDimV % (Chunks * 8 * Base::kWarpsD) == 0,
                "each chunk of either head dim splits over the warps in whole n8 tiles");
  static_assert(!Base::kFp8, "FP8 inputs take head dims up to 256");
};

// The row traits of V's tile, dO's buffers and dV's stores (copy_tile_async,
// load_input_tile, store_fragments read these): Tr itself unless WithBwdHeadDimV splits
// V's head dim from Q/K's.
template <class Tr>
struct BwdVRowsView {
  using Element = typename Tr::Element;
  using In = typename Tr::Element;
  using Ops = typename Tr::Ops;
  static constexpr bool kFp8 = false;
  static constexpr int kThreads = Tr::kThreads;
  static constexpr int kHeadDim = Tr::kHeadDimV;
  static constexpr int kRowStride = Tr::kVRowStride;
  static constexpr int kChunkElems = 8;
  static constexpr int kLoadChunks = Tr::kHeadDimVMma / 8;
  static constexpr int kRealChunks = Tr::kHeadDimV / 8;
};
template <bool kSplit, class Tr>
struct BwdVRowsOf {
  using type = Tr;
};
template <class Tr>
struct BwdVRowsOf<true, Tr> {
  using type = BwdVRowsView<Tr>;
};
template <class Tr>
using BwdVRows = typename BwdVRowsOf<Tr::kSplitV, Tr>::type;

// A backward's traits with FP8 Q, K and V of one Format (fp8.cuh; Base: BwdTraits of the
// 16-bit type of dO, dK, dV and dQ). The FP8 rows are dequantised as they are loaded into
// the 16-bit shared tiles (exactly: every e4m3 and e5m2 value is an fp16 and a bf16 value),
// and every product runs on them as in the 16-bit kernel; the descale factors are folded
// into the softmax scale (S), dP, dK's and dQ's scaling (flash_bwd.cuh). P and dS stay
// 16-bit: rounding them to FP8 costs several times the 16-bit backward's error
// (benchmarks/fp8_backward_error.py).
template <class Base, class Format>
struct WithFp8Inputs : Base {
  using In = unsigned char;
  using Fp8Format = Format;
  static constexpr bool kFp8 = true;
  static_assert(Base::kHeadDim % 32 == 0, "FP8 head dims are multiples of 32");
};

}  // namespace ft
