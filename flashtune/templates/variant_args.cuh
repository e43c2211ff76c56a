// The run-time values of the attention features (sliding window, softcap, ALiBi, varlen,
// sinks, dropout) that the forward and backward kernels take, in one struct.
#pragma once

namespace ft {

// The run-time values of the features a kernel is compiled with (an entry point passes
// those of its Problem's switches; the others keep these values and are never read).
struct VariantArgs {
  int window_left = -1;   // keys visible before a row's diagonal; -1 (or > seqlen_k): all
  int window_right = -1;  // keys visible after it; -1 (or > seqlen_q): all
  float softcap = 0.0f;   // the cap (> 0)
  const float* alibi_slopes = nullptr;  // float32 slopes of (batch, heads_q) or (heads_q)
  long long alibi_batch_stride = 0;     // 0: one slope per head for every batch
  // Varlen: sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of the packed Q and O
  // (and likewise for K, V); seqlen_q and seqlen_k of FwdParams are then the total rows of
  // the packed tensors, and the LSE is (heads_q, total rows of Q).
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  int max_seqlen_q = 0;  // the longest query sequence (sizes the grid)
  // Sinks: float32 (heads_q,), one logit per query head joined to every row's softmax
  // denominator (sinks.cuh).
  const float* sinks = nullptr;
  // Dropout (dropout.cuh): the generator's seed and offset, and the probability p (< 1).
  long long dropout_seed = 0;
  long long dropout_offset = 0;
  float dropout_p = 0.0f;

  // The window's sizes with "all" as the largest size that can matter (so that row and key
  // arithmetic stays in 32 bits): left = seqlen_k, right = seqlen_q.
  __device__ __forceinline__ int left(int seqlen_k) const {
    return window_left < 0 || window_left > seqlen_k ? seqlen_k : window_left;
  }
  __device__ __forceinline__ int right(int seqlen_q) const {
    return window_right < 0 || window_right > seqlen_q ? seqlen_q : window_right;
  }
};

}  // namespace ft
