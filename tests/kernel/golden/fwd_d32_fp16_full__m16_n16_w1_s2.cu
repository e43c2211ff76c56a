// flashtune <version> generated kernel
// problem: fwd_d32_fp16_full  config: m16_n16_w1_s2
// entry: flashtune_fwd_d32_fp16_full_m16_n16_w1_s2  dynamic smem: 6400 B  threads: 32
// digest: <digest>
// FlashAttention-2 forward kernel: parameter bindings and entry point only; the kernel
// logic is in flash_fwd.cuh and fwd_mainloop.cuh.
//
// Structure knobs, each optional (unset: the plain kernel); names and values are valid
// KernelConfig extras (switches 0 or 1):
//   swizzle: XOR-swizzled shared-memory rows instead of padded ones;
//   qregs: Q's fragments held in registers instead of re-read from shared memory;
//   pipeline: Q K^T of the next tile issued before the softmax of this one;
//   minblocks: __launch_bounds__ minimum resident blocks per SM (caps registers at
//     65536 / (minblocks * threads)); 0: none;
//   order: "plain", "headsinner" or "longest" (block order, see flash_fwd.cuh);
//   persistent: blocks walk the query blocks of their head (the grid may be smaller).
#include "flash_fwd.cuh"

namespace {

using Element = __half;
constexpr int kHeadDim = 32;
constexpr int kHeadDimPadded = 32;
constexpr int kBlockM = 16;
constexpr int kBlockN = 16;
constexpr int kNumWarps = 1;
constexpr int kNumStages = 2;
constexpr bool kCausal = false;
constexpr int kSmemRowPad = 8;
constexpr bool kSwizzle = false;
constexpr bool kQInRegs = false;
constexpr bool kPipelineQk = false;
constexpr ft::BlockOrder kBlockOrder = ft::BlockOrder::kPlain;
constexpr bool kPersistent = false;

using Traits = ft::FwdTraits<Element, kHeadDim, kHeadDimPadded, kBlockM, kBlockN, kNumWarps,
                             kNumStages, kCausal, kSmemRowPad, kSwizzle, kQInRegs,
                             kPipelineQk>;
static_assert(Traits::kSmemBytes == 6400,
              "shared-memory layout differs from the smem_bytes the kernel is launched with");

}  // namespace

extern "C" __global__ void __launch_bounds__(32)
flashtune_fwd_d32_fp16_full_m16_n16_w1_s2(
    const Element* __restrict__ q, const Element* __restrict__ k,
    const Element* __restrict__ v, Element* __restrict__ o, float* __restrict__ lse,
    int seqlen_q, int seqlen_k, int heads_q, int heads_kv,
    long long q_batch_stride, long long q_row_stride, long long q_head_stride,
    long long k_batch_stride, long long k_row_stride, long long k_head_stride,
    long long v_batch_stride, long long v_row_stride, long long v_head_stride,
    long long o_batch_stride, long long o_row_stride, long long o_head_stride,
    float softmax_scale) {
  const ft::FwdParams<Element> params{
      q, k, v, o, lse, seqlen_q, seqlen_k, heads_q, heads_kv,
      q_batch_stride, q_row_stride, q_head_stride,
      k_batch_stride, k_row_stride, k_head_stride,
      v_batch_stride, v_row_stride, v_head_stride,
      o_batch_stride, o_row_stride, o_head_stride, softmax_scale};
  ft::flash_fwd<Traits, kBlockOrder, kPersistent>(params);
}
