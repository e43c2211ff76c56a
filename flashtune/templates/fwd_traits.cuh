// Compile-time shape of one forward kernel variant: tile sizes, warp split, shared-memory
// layout and the element type's tensor-core operations.
#pragma once

#include "flex_ops.cuh"
#include "primitives.cuh"
#include "smem_layout.cuh"
#include "tensor_ops.cuh"

namespace ft {

namespace detail {
__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int ceil_pow2(int x) {
  return x <= 1 ? 1 : 2 * ceil_pow2((x + 1) / 2);
}
__host__ __device__ constexpr int min_int(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int max_int(int a, int b) { return a > b ? a : b; }

template <bool kCond, class A, class B>
struct Select {
  using type = A;
};
template <class A, class B>
struct Select<false, A, B> {
  using type = B;
};

template <int RowChunks, bool Swizzle>
struct Layout {
  using type = PaddedRows<RowChunks>;
};
template <int RowChunks>
struct Layout<RowChunks, true> {
  using type = SwizzledRows<RowChunks>;
};
}  // namespace detail

// One variant of the FlashAttention-2 forward kernel.
//
// HeadDim is the real head dim (a multiple of 8); HeadDimPadded the compiled tile dim that
// sizes the shared-memory rows. The tensor cores work on HeadDim rounded up to 16
// (kHeadDimMma): the columns [HeadDim, kHeadDimMma) are zero-filled once, and the columns
// beyond kHeadDimMma are never touched.
//
// Shared memory (elements of Element, rows of Smem::kRowStride):
//   [ Q: BlockM rows | K: NumStages x BlockN rows | V: NumStages x BlockN rows ]
// in the layout Smem (smem_layout.cuh): rows padded by RowPad elements (one 16-byte chunk),
// or, with Swizzle, unpadded rows whose chunks are XOR-swizzled (RowPad is then unused).
// The total must equal the smem_bytes the template is given (it asserts it).
//
// Structure switches (the template binds them; all default to the plain kernel):
//   QInRegs: Q's ldmatrix fragments are loaded once into registers (kMTiles * kQkSteps * 4
//     of them) instead of being re-read from shared memory every tile.
//   Pipelined: the Q K^T of the next tile is issued before the softmax of this one, so the
//     tensor cores run under the softmax; two S tiles are live (kMTiles * kSTiles * 4 more
//     registers). Needs two or more stages.
//
// Attention features (each compiled in or out; the Problem's switches of the same names):
//   Local: a sliding window (run-time sizes left, right); key tiles outside the window of
//     every row of a block are never visited, the ones crossing its edges are masked;
//   Softcap: scores pass through cap * tanh(scale * s / cap) (run-time cap);
//   Alibi: scores get the bias -slope * |i + Nk - Nq - j| (run-time per-head slopes);
//   Varlen: sequences of run-time lengths packed along the rows (cu_seqlens on the device);
//   Mods: the declared score modifications (a functor rendered from codegen.score_mods,
//     applied to every scaled score after softcap and ALiBi), or NoScoreMods;
//   Sinks: a per-head logit joins each row's softmax denominator (sinks.cuh).
template <typename Element_, int HeadDim, int HeadDimPadded, int BlockM, int BlockN,
          int NumWarps, int NumStages, bool Causal, int RowPad, bool Swizzle = false,
          bool QInRegs = false, bool Pipelined = false, bool Local = false,
          bool Softcap = false, bool Alibi = false, bool Varlen = false,
          class Mods_ = NoScoreMods, bool Sinks = false>
struct FwdTraits {
  using Element = Element_;
  using Mods = Mods_;
  using Ops = TensorOps<Element>;
  // The inputs Q, K, V: Element here; two e4m3 values per 16-bit word in WithFp8
  // (fwd_fp8.cuh), which also replaces Q K^T's mma and its k steps.
  static constexpr bool kFp8 = false;
  using In = Element;
  using QkOps = Ops;
  using Smem = typename detail::Layout<HeadDimPadded / 8, Swizzle>::type;
  static constexpr bool kSwizzle = Swizzle;
  static constexpr bool kQInRegs = QInRegs;
  static constexpr bool kPipelined = Pipelined;

  static constexpr int kHeadDim = HeadDim;
  static constexpr int kHeadDimPadded = HeadDimPadded;
  static constexpr int kHeadDimMma = (HeadDim + 15) / 16 * 16;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kNumWarps = NumWarps;
  static constexpr int kNumStages = NumStages;
  static constexpr bool kCausal = Causal;
  static constexpr bool kLocal = Local;
  static constexpr bool kSoftcap = Softcap;
  static constexpr bool kAlibi = Alibi;
  static constexpr bool kVarlen = Varlen;
  static constexpr bool kSinks = Sinks;
  static constexpr bool kDropout = false;  // on in WithDropout<...> (dropout.cuh)
  // Whether scores are transformed before the softmax (softcap, ALiBi, declared mods).
  static constexpr bool kTransformed = Softcap || Alibi || Mods::kOn;
  static constexpr int kThreads = 32 * NumWarps;

  // Warp tiling: warp w owns query rows [w * kWarpRows, (w + 1) * kWarpRows) of the block.
  static constexpr int kWarpRows = BlockM / NumWarps;
  static constexpr int kMTiles = kWarpRows / 16;        // m16 tiles per warp
  static constexpr int kSTiles = BlockN / 8;            // n8 tiles of S (keys)
  static constexpr int kOTiles = kHeadDimMma / 8;       // n8 tiles of O (head dim)
  static constexpr int kQkSteps = kHeadDimMma / 16;     // k16 steps of Q K^T
  static constexpr int kPvSteps = BlockN / 16;          // k16 steps of P V
  // 32-bit registers per thread held by the S and O accumulator fragments.
  static constexpr int kAccumulatorRegisters = kMTiles * (kSTiles + kOTiles) * 4;

  // Shared-memory layout, in elements.
  static constexpr int kRowStride = Smem::kRowStride;
  static constexpr int kQElems = BlockM * kRowStride;
  static constexpr int kKvElems = BlockN * kRowStride;
  static constexpr int kKOffset = kQElems;
  static constexpr int kVOffset = kQElems + NumStages * kKvElems;
  static constexpr int kSmemRows = BlockM + 2 * NumStages * BlockN;
  static constexpr int kSmemBytes = kSmemRows * kRowStride * static_cast<int>(sizeof(Element));

  // 16-byte chunks per row: copied by cp.async, and real (stored / read from global).
  static constexpr int kChunkElems = 8;
  static constexpr int kLoadChunks = kHeadDimMma / kChunkElems;
  static constexpr int kRealChunks = HeadDim / kChunkElems;

  // The cp.async pipeline. With two or more stages, one block barrier per tile. Plain:
  // one commit group per K/V tile (K_0 with Q); before tile j is used, the groups of the
  // kNumStages - 2 tiles committed after it may still be in flight. Pipelined: one group
  // per K and per V, committed K_0 (with Q), V_0, K_1, V_1, ...; a step needs K of the next
  // tile, after which 2 (kNumStages - 2) groups may be in flight. With one stage, K and V
  // are separate groups and separate barriers (the single K buffer is refilled while V is
  // read).
  static constexpr bool kOneBarrier = NumStages >= 2;
  static constexpr int kPipelineWait =
      !kOneBarrier ? 0 : (Pipelined ? 2 * (NumStages - 2) : NumStages - 2);
  // One stage with the accumulators filling 192 registers: the next K tile is copied after
  // P V rather than before it. Copying it in the middle of the step keeps the softmax
  // statistics live across that barrier, and ptxas then spills them (measured with NVRTC
  // 13 on head dim 160, 128 x 32, sm_80).
  static constexpr bool kLateKLoad = NumStages == 1 && kAccumulatorRegisters >= 192;

  // V's and O's head dim and shared layout: Q/K's here; WithHeadDimV splits them.
  static constexpr bool kSplitV = false;
  static constexpr int kHeadDimV = HeadDim;
  using VSmem = Smem;  // V's stage buffers
  using OSmem = Smem;  // O's rows, staged in Q's before the stores
  static constexpr bool kOStageSync = false;  // O's staging needs a block barrier first
  static constexpr int kVElems = kKvElems;  // one V stage buffer

  static_assert(sizeof(Element) == 2, "elements are 16-bit (fp16 or bf16)");
  static_assert(HeadDim % 8 == 0 && HeadDim >= 8, "head dim must be a multiple of 8");
  static_assert(HeadDim <= HeadDimPadded && HeadDimPadded % 16 == 0,
                "padded head dim must cover the head dim in k16 steps");
  static_assert(Swizzle || RowPad == 8, "padded rows carry one 16-byte chunk of padding");
  static_assert(!Pipelined || NumStages >= 2, "pipelining Q K^T needs two or more stages");
  static_assert(BlockM % (16 * NumWarps) == 0, "each warp owns whole m16 tiles");
  static_assert(BlockN % 16 == 0, "keys come in k16 steps of P V");
  static_assert(kOTiles % 2 == 0 && kSTiles % 2 == 0, "B operands load two n8 tiles at once");
  static_assert(NumStages >= 1 && NumStages <= 4, "1 to 4 pipeline stages");
  static_assert(!(Causal && Local), "a causal sliding window is the window (left, 0)");
};

// A forward's traits with V's (and O's) head dim HeadDimV other than Q/K's (Base: FwdTraits
// of Q/K's head dim; DeepSeek's prefill: 192 / 128). Q K^T runs over Q/K's head dim as in
// Base; P V, O's accumulator (kOTiles n8 tiles) and the O stores over V's, rounded up to the
// k16 step (kHeadDimVMma) like Q/K's.
//
// Shared memory: [ Q | K stages (Q/K's rows) | V stages (rows of VSmem, V's padded dim) ].
// O is staged (OSmem) in Q's rows when V's padded dim fits them (each warp in its own rows,
// as in Base); when V is wider (kOStageSync), the block first waits for every warp to leave
// the main loop and stages O in V's layout from the start of shared memory, which then
// holds at least BlockM rows of it (kSmemBytes).
template <class Base, int HeadDimV, int HeadDimVPadded>
struct WithHeadDimV : Base {
  static constexpr bool kSplitV = true;
  static constexpr int kHeadDimV = HeadDimV;
  static constexpr int kHeadDimVPadded = HeadDimVPadded;
  static constexpr int kHeadDimVMma = (HeadDimV + 15) / 16 * 16;
  using VSmem = typename detail::Layout<HeadDimVPadded / 8, Base::kSwizzle>::type;
  static constexpr bool kOStageSync = HeadDimVPadded > Base::kHeadDimPadded;
  using OSmem = typename detail::Select<kOStageSync, VSmem, typename Base::Smem>::type;
  static constexpr int kOTiles = kHeadDimVMma / 8;
  static constexpr int kAccumulatorRegisters =
      Base::kMTiles * (Base::kSTiles + kOTiles) * 4;
  static constexpr bool kLateKLoad = Base::kNumStages == 1 && kAccumulatorRegisters >= 192;
  static constexpr int kVElems = Base::kBlockN * VSmem::kRowStride;
  static constexpr int kQkRows = Base::kBlockM + Base::kNumStages * Base::kBlockN;
  static constexpr int kLayoutElems =
      kQkRows * Base::kRowStride + Base::kNumStages * kVElems;
  static constexpr int kOStageElems = Base::kBlockM * VSmem::kRowStride;
  static constexpr int kSmemBytes =
      (kLayoutElems > kOStageElems ? kLayoutElems : kOStageElems) *
      static_cast<int>(sizeof(typename Base::Element));

  static_assert(HeadDimV % 8 == 0 && HeadDimV >= 8, "V's head dim must be a multiple of 8");
  static_assert(HeadDimV <= HeadDimVPadded && HeadDimVPadded % 16 == 0,
                "V's padded head dim must cover it in k16 steps");
  static_assert(kOTiles % 2 == 0, "B operands load two n8 tiles at once");
  static_assert(!Base::kFp8, "FP8 inputs take Q/K's head dim for V");
};

// The row traits of V's tiles and O's rows (RowCopy, TileStream and the O stores read
// these): Tr itself unless WithHeadDimV splits V's head dim from Q/K's.
template <class Tr, class Layout>
struct VRowsView {
  using Element = typename Tr::Element;
  using Smem = Layout;
  static constexpr int kThreads = Tr::kThreads;
  static constexpr int kBlockM = Tr::kBlockM;
  static constexpr int kBlockN = Tr::kBlockN;
  static constexpr int kWarpRows = Tr::kWarpRows;
  static constexpr int kChunkElems = 8;
  static constexpr int kRealChunks = Tr::kHeadDimV / 8;
};
template <class Tr>
using VRows =
    typename detail::Select<Tr::kSplitV, VRowsView<Tr, typename Tr::VSmem>, Tr>::type;
template <class Tr>
using ORows =
    typename detail::Select<Tr::kSplitV, VRowsView<Tr, typename Tr::OSmem>, Tr>::type;

}  // namespace ft
