// The row-wise kernels around the backward main kernel: the preprocess (D = rowsum(dO * O)
// and zeroed dQ accumulator slices) and the dQ convert (the slices summed in a fixed order,
// scaled and rounded to the input type). Both are memory-bound: one block per BlockM query
// rows of one (batch, head), 16-byte accesses.
//
// Tensors: O, dO, dQ (batch, seqlen_q, heads_q, dim) with a contiguous last dim, 16-byte
// aligned base and row strides that are multiples of 8 elements; D contiguous float32
// (batch, heads_q, seqlen_q); dQ accumulator contiguous float32 (slices, batch, heads_q,
// seqlen_q, dim).
#pragma once

#include "bwd_traits.cuh"

namespace ft {

__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }


// Element offset of row 0 of (slice, batch, head) in a (slices, batch, heads, seqlen, dim)
// float32 accumulator; `batches` is the batch size.
__device__ __forceinline__ long long accum_row0(int slice, int batch, int batches, int head,
                                                int heads, int seqlen, int dim) {
  return ((static_cast<long long>(slice) * batches + batch) * heads + head) *
         static_cast<long long>(seqlen) * dim;
}

// D[b, h, i] = sum_d dO[b, i, h, d] O[b, i, h, d] (float32 products of 16-bit values are
// exact; the sum runs per lane over its 8 columns, then a fixed xor-shuffle tree), and every
// slice of the dQ accumulator set to 0 on the block's rows.
template <class Element, int HeadDim, int BlockM, int NumWarps>
__device__ __forceinline__ void bwd_preprocess(
    const Element* __restrict__ o, const Element* __restrict__ dout, float* __restrict__ dsum,
    float* __restrict__ dq_accum, int seqlen_q, int heads_q, int dq_slices,
    long long o_batch_stride, long long o_row_stride, long long o_head_stride,
    long long do_batch_stride, long long do_row_stride, long long do_head_stride) {
  constexpr int kChunks = HeadDim / 8;
  static_assert(HeadDim % 8 == 0 && kChunks <= 32, "one 16-byte chunk per lane");
  const int m0 = static_cast<int>(blockIdx.x) * BlockM;
  const int head = static_cast<int>(blockIdx.y);
  const int batch = static_cast<int>(blockIdx.z);
  const int batches = static_cast<int>(gridDim.z);
  const int lane = lane_id();
  const int warp = warp_id();
  const int tid = static_cast<int>(threadIdx.x);
  const int rows = seqlen_q - m0 < BlockM ? seqlen_q - m0 : BlockM;

  const Element* o_bh = o + batch * o_batch_stride + head * o_head_stride;
  const Element* do_bh = dout + batch * do_batch_stride + head * do_head_stride;
  float* d_bh = dsum + (static_cast<long long>(batch) * heads_q + head) * seqlen_q;
  for (int r = warp; r < rows; r += NumWarps) {  // warp-uniform: every lane shuffles
    const int row = m0 + r;
    float acc = 0.0f;
    if (lane < kChunks) {
      const uint4 a = *reinterpret_cast<const uint4*>(o_bh + row * o_row_stride + lane * 8);
      const uint4 b = *reinterpret_cast<const uint4*>(do_bh + row * do_row_stride + lane * 8);
      const Element* ea = reinterpret_cast<const Element*>(&a);
      const Element* eb = reinterpret_cast<const Element*>(&b);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc += widen(ea[i]) * widen(eb[i]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) acc += shfl_xor(acc, offset);
    if (lane == 0) d_bh[row] = acc;
  }

  const int quads = rows * HeadDim / 4;  // HeadDim is a multiple of 8: rows of whole float4s
  float4 zero;
  zero.x = zero.y = zero.z = zero.w = 0.0f;
  for (int s = 0; s < dq_slices; ++s) {
    float4* out = reinterpret_cast<float4*>(
        dq_accum + accum_row0(s, batch, batches, head, heads_q, seqlen_q, HeadDim) +
        static_cast<long long>(m0) * HeadDim);
    for (int i = tid; i < quads; i += 32 * NumWarps) out[i] = zero;
  }
}

// dQ[b, i, h, :] = softmax_scale * (slice 0 + slice 1 + ... ) of the accumulator, summed in
// slice order (the same order on every run), rounded to the element type.
template <class Element, int HeadDim, int BlockM, int NumWarps>
__device__ __forceinline__ void bwd_dq_convert(
    const float* __restrict__ dq_accum, Element* __restrict__ dq, int seqlen_q, int heads_q,
    int dq_slices, long long dq_batch_stride, long long dq_row_stride,
    long long dq_head_stride, float softmax_scale) {
  constexpr int kChunks = HeadDim / 8;
  const int m0 = static_cast<int>(blockIdx.x) * BlockM;
  const int head = static_cast<int>(blockIdx.y);
  const int batch = static_cast<int>(blockIdx.z);
  const int batches = static_cast<int>(gridDim.z);
  const int tid = static_cast<int>(threadIdx.x);
  const int rows = seqlen_q - m0 < BlockM ? seqlen_q - m0 : BlockM;
  Element* dq_bh = dq + batch * dq_batch_stride + head * dq_head_stride;
  const long long slice_elems =
      static_cast<long long>(batches) * heads_q * seqlen_q * HeadDim;
  const float* acc_rows = dq_accum + accum_row0(0, batch, batches, head, heads_q, seqlen_q,
                                                HeadDim) + static_cast<long long>(m0) * HeadDim;
  for (int idx = tid; idx < rows * kChunks; idx += 32 * NumWarps) {
    const int r = idx / kChunks;
    const int c = idx % kChunks;
    const float* src = acc_rows + r * HeadDim + c * 8;
    float sum[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) sum[i] = 0.0f;
    for (int s = 0; s < dq_slices; ++s) {
      const float4 lo = *reinterpret_cast<const float4*>(src + s * slice_elems);
      const float4 hi = *reinterpret_cast<const float4*>(src + s * slice_elems + 4);
      sum[0] += lo.x; sum[1] += lo.y; sum[2] += lo.z; sum[3] += lo.w;
      sum[4] += hi.x; sum[5] += hi.y; sum[6] += hi.z; sum[7] += hi.w;
    }
    using Ops = TensorOps<Element>;
    uint4 out;
    out.x = Ops::pack(sum[0] * softmax_scale, sum[1] * softmax_scale);
    out.y = Ops::pack(sum[2] * softmax_scale, sum[3] * softmax_scale);
    out.z = Ops::pack(sum[4] * softmax_scale, sum[5] * softmax_scale);
    out.w = Ops::pack(sum[6] * softmax_scale, sum[7] * softmax_scale);
    *reinterpret_cast<uint4*>(dq_bh + (m0 + r) * dq_row_stride + c * 8) = out;
  }
}

}  // namespace ft
