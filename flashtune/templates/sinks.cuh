// Attention sinks (gpt-oss): the softmax-denominator update of the variant seam.
//
// A sink is one logit per query head that joins every row's softmax denominator and
// contributes no value:
//
//   O = sum_j exp(s_j - m) v_j / (exp(sink - m) + sum_j exp(s_j - m)),
//   LSE = log(exp(sink) + sum_j exp(s_j)).
//
// The sink is a raw logit (not multiplied by the softmax scale, not capped, no bias). It
// enters where a kernel finalises a row: its running max and sum become those of the row
// with the sink appended, so that O's normaliser and the LSE include it. A row that saw no
// key gets O = 0 and LSE = sink (finite: the backward's P = exp(s - LSE) stays 0 there).
#pragma once

#include "primitives.cuh"

namespace ft {

// Join the sink `sink_log2` (the sink times log2(e)) to a row's softmax statistics in the
// log2 domain: its running max `max_log2` (any finite value below every score, or -inf,
// when the row saw no key) and its sum `sum` of exp2(x - max_log2) (0 for no key). Gives
// the factor O's accumulator (scaled by max_log2) is multiplied with, and the natural-log
// LSE of the row with the sink.
__device__ __forceinline__ void join_sink(float max_log2, float sum, float sink_log2,
                                          float& o_factor, float& lse) {
  constexpr float kLn2 = 0.693147180559945309f;
  const float m = fmaxf(max_log2, sink_log2);
  // exp2(max_log2 - m) underflows to 0 for a row with no key (sum is 0 there anyway).
  const float old = exp2f(max_log2 - m);
  const float total = sum * old + exp2f(sink_log2 - m);  // >= 1: one term is exp2(0)
  o_factor = old / total;
  lse = m * kLn2 + logf(total);
}

// The sink of query head `head` in the log2 domain (sinks: float32 (heads_q,)).
__device__ __forceinline__ float sink_log2_of(const float* sinks, int head) {
  return sinks[head] * 1.44269504088896340736f;
}

// OnlineSoftmax::finalize (softmax.cuh) with the sink joined: each of the lane's rows gets
// 1 / (its denominator with the sink) in inv_sum (O's accumulator is scaled by the row's
// running max) and its LSE with the sink.
template <class Softmax, int MTiles>
__device__ __forceinline__ void finalize_with_sink(const Softmax& softmax, float sink_log2,
                                                   float (&inv_sum)[MTiles][2],
                                                   float (&lse)[MTiles][2]) {
#pragma unroll
  for (int mt = 0; mt < MTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = softmax.sum[mt][h];
      l += shfl_xor(l, 1);
      l += shfl_xor(l, 2);
      join_sink(softmax.max_scaled[mt][h], l, sink_log2, inv_sum[mt][h], lse[mt][h]);
    }
  }
}

}  // namespace ft
