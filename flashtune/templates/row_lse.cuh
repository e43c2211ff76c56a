// Row-wise log-sum-exp of attention scores: LSE[b, h, i] = log(sum_j exp(scale * q_i . k_j))
// over the keys row i sees (causal: j <= i + seqlen_k - seqlen_q), +inf for a row that sees
// no key. The small second kernel family: scalar FP32 dot products, no tensor cores.
//
// One block per kBlockM query rows of one (batch, head). The block's Q rows are staged in
// shared memory once; K tiles of kBlockN keys are staged one at a time. Warp w owns rows
// w, w + kNumWarps, ...; lane l scores keys l, l + 32, ... of each tile and keeps a running
// (max, sum) per row in the log2 domain; the warp combines its lanes' pairs at the end.
//
// Tensors: Q (batch, seqlen_q, heads_q, dim), K (batch, seqlen_k, heads_kv, dim), strides in
// elements with a contiguous last dim; LSE contiguous float32 (batch, heads_q, seqlen_q).
#pragma once

#include "primitives.cuh"

namespace ft {

template <class Element>
__device__ __forceinline__ float to_float(Element x);
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <class Element, int kHeadDim, int kBlockM, int kBlockN, int kNumWarps, bool kCausal>
__device__ __forceinline__ void row_lse(
    const Element* __restrict__ q, const Element* __restrict__ k, float* __restrict__ lse,
    int seqlen_q, int seqlen_k, int heads_q, int heads_kv,
    long long q_batch_stride, long long q_row_stride, long long q_head_stride,
    long long k_batch_stride, long long k_row_stride, long long k_head_stride,
    float softmax_scale) {
  constexpr int kThreads = 32 * kNumWarps;
  constexpr int kRowsPerWarp = kBlockM / kNumWarps;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;

  const int m0 = static_cast<int>(blockIdx.x) * kBlockM;
  const long long head = blockIdx.y;
  const long long batch = blockIdx.z;
  const long long kv_head = head / (heads_q / heads_kv);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();
  const float scale_log2 = softmax_scale * kLog2e;

  const Element* q_bh = q + batch * q_batch_stride + head * q_head_stride;
  const Element* k_bh = k + batch * k_batch_stride + kv_head * k_head_stride;
  float* lse_bh = lse + (batch * heads_q + head) * seqlen_q;

  FT_DYNAMIC_SMEM(unsigned char, smem);
  float* const sq = reinterpret_cast<float*>(smem);  // kBlockM x kHeadDim
  float* const sk = sq + kBlockM * kHeadDim;         // kBlockN x kHeadDim

  // Stage the block's Q rows (rows past seqlen_q are never read).
  for (int idx = tid; idx < kBlockM * kHeadDim; idx += kThreads) {
    const int r = idx / kHeadDim;
    const int c = idx % kHeadDim;
    if (m0 + r < seqlen_q) sq[idx] = to_float(q_bh[(m0 + r) * q_row_stride + c]);
  }

  // Keys [0, n_end) are visible to some row of the block.
  const int m_end = seqlen_q < m0 + kBlockM ? seqlen_q : m0 + kBlockM;
  int n_end = seqlen_k;
  if constexpr (kCausal) {
    const int last = m_end + seqlen_k - seqlen_q;
    n_end = last < n_end ? last : n_end;
  }

  float run_max[kRowsPerWarp];  // max of scale_log2 * score, -inf before any key
  float run_sum[kRowsPerWarp];  // sum of exp2(scaled score - run_max) over the lane's keys
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    run_max[i] = -INFINITY;
    run_sum[i] = 0.f;
  }

  for (int n0 = 0; n0 < n_end; n0 += kBlockN) {
    block_sync();  // the previous tile is no longer read (and Q is staged, first time)
    for (int idx = tid; idx < kBlockN * kHeadDim; idx += kThreads) {
      const int r = idx / kHeadDim;
      const int c = idx % kHeadDim;
      if (n0 + r < seqlen_k) sk[idx] = to_float(k_bh[(n0 + r) * k_row_stride + c]);
    }
    block_sync();
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp + i * kNumWarps;
      const int row = m0 + r;
      if (row >= seqlen_q) continue;
      int row_end = seqlen_k;
      if constexpr (kCausal) {
        const int last = row + 1 + seqlen_k - seqlen_q;
        row_end = last < row_end ? last : row_end;
      }
      for (int j = lane; j < kBlockN && n0 + j < row_end; j += 32) {
        float dot = 0.f;
#pragma unroll 8
        for (int c = 0; c < kHeadDim; ++c) dot += sq[r * kHeadDim + c] * sk[j * kHeadDim + c];
        const float s = dot * scale_log2;
        const float m_new = s > run_max[i] ? s : run_max[i];
        run_sum[i] = run_sum[i] * exp2f_fast(run_max[i] - m_new) + exp2f_fast(s - m_new);
        run_max[i] = m_new;
      }
    }
  }

  // Combine the lanes' (max, sum) pairs of each row and write its LSE (natural log).
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int row = m0 + warp + i * kNumWarps;
    float m = run_max[i];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = shfl_xor(m, offset);
      m = other > m ? other : m;
    }
    // A lane that saw no key has run_max = -inf and run_sum = 0: it adds nothing.
    float l = run_max[i] == -INFINITY ? 0.f : run_sum[i] * exp2f_fast(run_max[i] - m);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) l += shfl_xor(l, offset);
    if (lane == 0 && row < seqlen_q) {
      lse_bh[row] = m == -INFINITY ? INFINITY : m * kLn2 + logf(l);
    }
  }
}

}  // namespace ft
