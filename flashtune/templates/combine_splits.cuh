// The combine kernel of split-KV decoding: merges the float32 partial results of the splits
// (decode_split.cuh) into O and the LSE, each split weighted by exp(LSE_s - LSE):
//
//   LSE = log(sum_s exp(LSE_s)),   O = sum_s exp(LSE_s - LSE) O_s.
//
// A split with LSE_s = -inf (empty, or no visible key) has weight 0; a row whose splits are
// all -inf saw no key at all and gets O = 0 and LSE = +inf (as in the forward); a row with a
// NaN partial LSE (a split that refused a bad input) gets NaN, so it is never a silent
// wrong answer.
//
// Sinks (kSinks; sinks.cuh): the head's sink joins every row's denominator here, where the
// final O and LSE are written (a split's partial LSE leaves it out): LSE = log(exp(sink) +
// sum_s exp(LSE_s)), and a row whose splits are all empty gets O = 0 and LSE = sink.
//
// Rows are (batch, head, query position), row = (b * heads_q + h) * seqlen_q + i, the
// layout of the LSE. Warp w of a block combines rows block_row0 + w, + kNumWarps, ...;
// lane l holds the LSE of splits l, l + 32, ... (up to kMaxSplits) and columns
// 4 l + 128 p of O.
//
// Tensors: o_part (num_splits, rows, HeadDim) and lse_part (num_splits, rows) contiguous
// float32; O (batch, seqlen_q, heads_q, HeadDim) with element strides (last dim contiguous,
// 16-byte aligned rows); LSE contiguous float32 (batch, heads_q, seqlen_q).
#pragma once

#include "decode_traits.cuh"

namespace ft {

template <class Element>
__device__ __forceinline__ unsigned pack_pair(float lo, float hi);
template <>
__device__ __forceinline__ unsigned pack_pair<__half>(float lo, float hi) {
  return pack_half2(lo, hi);
}
template <>
__device__ __forceinline__ unsigned pack_pair<__nv_bfloat16>(float lo, float hi) {
  return pack_bf162(lo, hi);
}

template <class Element, int HeadDim, int BlockM, int NumWarps, bool kSinks = false>
__device__ __forceinline__ void combine_splits(
    const float* __restrict__ o_part, const float* __restrict__ lse_part,
    Element* __restrict__ o, float* __restrict__ lse, int num_splits, int rows, int heads_q,
    int seqlen_q, long long o_batch_stride, long long o_row_stride, long long o_head_stride,
    const float* __restrict__ sinks = nullptr) {
  constexpr int kSplitRegs = kMaxSplits / 32;
  constexpr int kColumnPasses = (HeadDim + 127) / 128;
  static_assert(HeadDim % 4 == 0, "each lane combines 4 columns at a time");
  const int lane = lane_id();
  const int block_row0 = static_cast<int>(blockIdx.x) * BlockM;

  for (int r = warp_id(); r < BlockM; r += NumWarps) {
    const int row = block_row0 + r;
    if (row >= rows) break;  // rows only grow with r: the warp is done
    float part_lse[kSplitRegs];
    float row_max = -INFINITY;
    float bad = 0.0f;
#pragma unroll
    for (int k = 0; k < kSplitRegs; ++k) {
      const int s = 32 * k + lane;
      part_lse[k] = s < num_splits ? __ldg(lse_part + static_cast<long long>(s) * rows + row)
                                   : -INFINITY;
      if (part_lse[k] != part_lse[k]) {
        bad = 1.0f;
      } else {
        row_max = fmaxf(row_max, part_lse[k]);
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      row_max = fmaxf(row_max, shfl_xor(row_max, offset));
      bad = fmaxf(bad, shfl_xor(bad, offset));
    }
    float sink = -INFINITY;
    if constexpr (kSinks) {  // the sink is one more term of the row's sum, with no value
      sink = sinks[(row / seqlen_q) % heads_q];
      row_max = fmaxf(row_max, sink);
    }
    const bool empty = row_max == -INFINITY;
    // Weights exp(LSE_s - LSE); with no key (or a bad split) every weight is 0.
    float sum = kSinks && lane == 0 && !empty ? expf(sink - row_max) : 0.0f;
#pragma unroll
    for (int k = 0; k < kSplitRegs; ++k) {
      sum += empty || part_lse[k] == -INFINITY ? 0.0f : expf(part_lse[k] - row_max);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += shfl_xor(sum, offset);
    const float row_lse = empty ? INFINITY : row_max + logf(sum);
    float weight[kSplitRegs];
#pragma unroll
    for (int k = 0; k < kSplitRegs; ++k) {
      weight[k] = empty || bad != 0.0f || part_lse[k] == -INFINITY
                      ? 0.0f : expf(part_lse[k] - row_lse);
    }

    const int i = row % seqlen_q;
    const int head = (row / seqlen_q) % heads_q;
    const int batch = row / seqlen_q / heads_q;
    Element* const o_row = o + batch * o_batch_stride + i * o_row_stride + head * o_head_stride;
#pragma unroll
    for (int pass = 0; pass < kColumnPasses; ++pass) {
      const int col = 128 * pass + 4 * lane;
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int k = 0; k < kSplitRegs; ++k) {
        if (32 * k >= num_splits) break;
        for (int lane_s = 0; lane_s < 32 && 32 * k + lane_s < num_splits; ++lane_s) {
          const float w = shfl_sync(0xffffffffu, weight[k], lane_s);
          if (w != 0.0f && col < HeadDim) {
            const float4 part = __ldg(reinterpret_cast<const float4*>(
                o_part + (static_cast<long long>(32 * k + lane_s) * rows + row) * HeadDim +
                col));
            acc[0] += w * part.x;
            acc[1] += w * part.y;
            acc[2] += w * part.z;
            acc[3] += w * part.w;
          }
        }
      }
      if (col < HeadDim) {
        if (bad != 0.0f) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[e] = quiet_nan();
        }
        uint2 packed;
        packed.x = pack_pair<Element>(acc[0], acc[1]);
        packed.y = pack_pair<Element>(acc[2], acc[3]);
        *reinterpret_cast<uint2*>(o_row + col) = packed;
      }
    }
    if (lane == 0) lse[row] = bad != 0.0f ? quiet_nan() : row_lse;
  }
}

}  // namespace ft
