// Compile-time shape of one split-KV decoding kernel variant (decode_split.cuh): tile sizes,
// warp split, shared-memory layout and the element type's tensor-core operations.
#pragma once

#include "flex_ops.cuh"
#include "fwd_traits.cuh"
#include "smem_layout.cuh"
#include "tensor_ops.cuh"

namespace ft {

// Splits cover whole multiples of this many keys (the contract with
// flashtune.families.decode.splits.SPLIT_ALIGN): split s of a sequence of L keys covers
// [s * P, min((s + 1) * P, L)) with P = ceil(ceil(L / num_splits) / kSplitAlign) *
// kSplitAlign, so a split past the end is empty.
constexpr int kSplitAlign = 16;

// The most splits the combine kernel merges (flashtune.families.decode.splits.MAX_SPLITS).
constexpr int kMaxSplits = 128;

// Error codes the kernels record in status[0] (flashtune.families.decode.status).
constexpr int kErrNegativeLength = 1;   // cache_seqlens[b] < 0
constexpr int kErrBeyondCapacity = 2;   // cache_seqlens[b] + seqlen_new > capacity
constexpr int kErrPageIndex = 3;        // block_table[b, slot] outside [0, num_pages)

// A block mask's granularity in decoding: its key tile ranges arrive per query block of
// this many absolute positions, in key blocks of as many keys (the contract with
// flashtune.api.decode.decode_tile_ranges).
constexpr int kMaskBlock = 16;

// A quiet NaN (NVRTC has no <math.h> NAN): what a block writes where its input was bad.
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// One variant of the split-KV decoding kernel.
//
// Rows are *packed*: a block serves one (batch, kv head) and its rows are the query rows of
// every query head of the group, r = g * seqlen_q + i for head offset g and query position
// i, so one K/V tile in shared memory serves the whole group. Warp w owns packed rows
// [w * kWarpRows, (w + 1) * kWarpRows) of the block, in m16 tiles.
//
// HeadDim is the real head dim (a multiple of 8); HeadDimPadded the compiled tile dim that
// sizes the shared-memory rows; the tensor cores work on HeadDim rounded up to 16.
//
// Shared memory (elements of Element, rows of kRowStride = HeadDimPadded + RowPad: the
// forward's padded layout, smem_layout.cuh), then one 16-byte word of block flags:
//   [ Q: BlockM rows | K: NumStages x BlockN rows | V: NumStages x BlockN rows | flags ]
// The total must equal flashtune.families.decode.space.smem_bytes (the template asserts it).
//
// Attention features (the forward's; each compiled in or out): Local, a sliding window (key
// tiles outside the window of every row of the block are not visited); Softcap (the
// scores' tanh); Alibi (the bias -slope |i + total - seqlen_q - j|, per packed row's head);
// Mods, the declared score modifications (a functor rendered from codegen.score_mods, applied
// to every scaled score after softcap and ALiBi), or NoScoreMods.
template <typename Element_, int HeadDim, int HeadDimPadded, int BlockM, int BlockN,
          int NumWarps, int NumStages, bool Causal, int RowPad, bool Local = false,
          bool Softcap = false, bool Alibi = false, class Mods_ = NoScoreMods>
struct DecodeTraits {
  using Element = Element_;
  using Ops = TensorOps<Element>;
  // The cache's element type: Element (an e4m3 cache: WithE4m3Cache, decode_fp8.cuh).
  using Cache = Element_;
  static constexpr bool kFp8Cache = false;
  // The forward's padded rows, so that its warp GEMMs (warp_gemm.cuh) address the tiles.
  using Smem = PaddedRows<HeadDimPadded / 8>;
  // What the forward's warp GEMMs ask of a kernel's traits beyond the tiling: Q is re-read
  // from shared memory every tile (QFromSmem).
  static constexpr bool kQInRegs = false;

  static constexpr int kHeadDim = HeadDim;
  static constexpr int kHeadDimMma = (HeadDim + 15) / 16 * 16;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kNumWarps = NumWarps;
  static constexpr int kNumStages = NumStages;
  static constexpr bool kCausal = Causal;
  static constexpr bool kLocal = Local;
  static constexpr bool kSoftcap = Softcap;
  static constexpr bool kAlibi = Alibi;
  using Mods = Mods_;
  static_assert(!(Causal && Local), "a causal sliding window is the window (left, 0)");
  static constexpr int kThreads = 32 * NumWarps;

  static constexpr int kWarpRows = BlockM / NumWarps;
  static constexpr int kMTiles = kWarpRows / 16;     // m16 tiles per warp
  static constexpr int kSTiles = BlockN / 8;         // n8 tiles of S (keys)
  static constexpr int kOTiles = kHeadDimMma / 8;    // n8 tiles of O (head dim)
  static constexpr int kQkSteps = kHeadDimMma / 16;  // k16 steps of Q K^T
  static constexpr int kPvSteps = BlockN / 16;       // k16 steps of P V
  // 32-bit registers per thread held by the S and O accumulator fragments.
  static constexpr int kAccumulatorRegisters = kMTiles * (kSTiles + kOTiles) * 4;

  static constexpr int kRowStride = Smem::kRowStride;
  static constexpr int kQElems = BlockM * kRowStride;
  static constexpr int kKvElems = BlockN * kRowStride;
  static constexpr int kKOffset = kQElems;
  static constexpr int kVOffset = kQElems + NumStages * kKvElems;
  static constexpr int kFlagsOffsetBytes =
      (kQElems + 2 * NumStages * kKvElems) * static_cast<int>(sizeof(Element));
  static constexpr int kSmemBytes = kFlagsOffsetBytes + 16;

  // V's (and O's) head dim and rows: Q/K's here (V's tile loads, the appends and the O
  // stores read the kernel's own traits: DecodeV); DecodeWithHeadDimV splits them.
  static constexpr bool kSplitV = false;
  static constexpr int kHeadDimV = HeadDim;
  using VSmem = Smem;
  using VRows = void;
  static constexpr int kVElems = kKvElems;  // one V stage buffer

  // 16-byte chunks per row: copied by cp.async, and real (present in global memory).
  static constexpr int kChunkElems = 8;
  static constexpr int kLoadChunks = kHeadDimMma / kChunkElems;
  static constexpr int kRealChunks = HeadDim / kChunkElems;

  // cp.async groups are committed as K_0 (with Q), V_0, K_1, V_1, ...; before K_j or V_j is
  // used, the 2 * (NumStages - 1) groups committed after it may still be in flight.
  static constexpr int kPipelineWait = 2 * (NumStages - 1);

  static_assert(sizeof(Element) == 2, "elements are 16-bit (fp16 or bf16)");
  static_assert(HeadDim % 8 == 0 && HeadDim >= 8, "head dim must be a multiple of 8");
  static_assert(HeadDim <= HeadDimPadded && HeadDimPadded % 16 == 0,
                "padded head dim must cover the head dim in k16 steps");
  static_assert(RowPad == 8, "padded rows carry one 16-byte chunk of padding");
  static_assert(BlockM % (16 * NumWarps) == 0, "each warp owns whole m16 tiles");
  static_assert(BlockN % 16 == 0, "keys come in k16 steps of P V");
  static_assert(kOTiles % 2 == 0 && kSTiles % 2 == 0, "B operands load two n8 tiles at once");
  static_assert(NumStages >= 1 && NumStages <= 4, "1 to 4 pipeline stages");
  static_assert(kFlagsOffsetBytes % 16 == 0, "the flags word is 16-byte aligned");
};

// The row traits of V's tiles and O's rows at V's head dim (Base: the decoding traits of
// Q/K's head dim): what load_key_tile, store_new_keys and the O stores read.
template <class Base, int HeadDimV, int HeadDimVPadded>
struct DecodeVRows : Base {
  using Smem = PaddedRows<HeadDimVPadded / 8>;
  static constexpr int kHeadDim = HeadDimV;
  static constexpr int kHeadDimMma = (HeadDimV + 15) / 16 * 16;
  static constexpr int kRowStride = Smem::kRowStride;
  static constexpr int kLoadChunks = kHeadDimMma / Base::kChunkElems;
  static constexpr int kRealChunks = HeadDimV / Base::kChunkElems;
};

// Decoding traits with V's (and O's) head dim HeadDimV other than Q/K's (Base: DecodeTraits
// of Q/K's head dim, e.g. 512 beside a V column chunk of 256). Q K^T runs over Q/K's head
// dim as in Base; P V, O's accumulator (kOTiles n8 tiles), the V tiles and the O rows over
// V's, rounded up to the k16 step like Q/K's.
//
// Shared memory: [ Q: BlockM rows | K: NumStages x BlockN rows (Q/K's padded rows) |
//                  V: NumStages x BlockN rows (V's padded rows) | flags ]
// (flashtune.families.decode.space.smem_bytes).
template <class Base, int HeadDimV, int HeadDimVPadded>
struct DecodeWithHeadDimV : Base {
  static constexpr bool kSplitV = true;
  static constexpr int kHeadDimV = HeadDimV;
  using VRows = DecodeVRows<Base, HeadDimV, HeadDimVPadded>;
  using VSmem = typename VRows::Smem;
  static constexpr int kOTiles = VRows::kHeadDimMma / 8;
  static constexpr int kAccumulatorRegisters = Base::kMTiles * (Base::kSTiles + kOTiles) * 4;
  static constexpr int kVElems = Base::kBlockN * VSmem::kRowStride;
  static constexpr int kFlagsOffsetBytes =
      (Base::kQElems + Base::kNumStages * (Base::kKvElems + kVElems)) *
      static_cast<int>(sizeof(typename Base::Element));
  static constexpr int kSmemBytes = kFlagsOffsetBytes + 16;

  static_assert(HeadDimV % 8 == 0 && HeadDimV >= 8, "V's head dim must be a multiple of 8");
  static_assert(HeadDimV <= HeadDimVPadded && HeadDimVPadded % 16 == 0,
                "V's padded head dim must cover it in k16 steps");
  static_assert(kOTiles % 2 == 0, "B operands load two n8 tiles at once");
  static_assert(!Base::kFp8Cache, "an e4m3 cache takes Q/K's head dim for V");
  static_assert(kFlagsOffsetBytes % 16 == 0, "the flags word is 16-byte aligned");
};

// The row traits of V's tiles and O's rows of decoding traits Tr: Tr itself (an e4m3
// cache's wrapper included) unless DecodeWithHeadDimV splits V's head dim from Q/K's.
template <class Tr>
using DecodeV = typename detail::Select<Tr::kSplitV, typename Tr::VRows, Tr>::type;

}  // namespace ft
