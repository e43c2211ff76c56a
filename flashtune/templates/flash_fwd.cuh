// FlashAttention-2 forward pass (sm_80 and newer): one thread block per kBlockM query rows
// of one (batch, head).
//
// Per block: Q is copied to shared memory once; K and V tiles of kBlockN keys stream through
// rings of kNumStages shared buffers fed by cp.async; each warp computes S = Q K^T for its
// rows on tensor cores, masks it, folds it into an online softmax held in registers, and
// accumulates O += P V with P taken straight from the S registers. At the end O is
// normalised, staged through the warp's own (no longer needed) Q rows and written with
// 128-bit stores, with the natural-log LSE of each row.
//
// Tensors: Q, O (batch, seqlen_q, heads_q, dim); K, V (batch, seqlen_k, heads_kv, dim);
// strides in elements, the last dim contiguous; base pointers 16-byte aligned and strides
// multiples of 8 elements. LSE: contiguous float32 (batch, heads_q, seqlen_q). GQA/MQA:
// heads_q is a multiple of heads_kv and query head h reads kv head h / (heads_q / heads_kv).
// seqlen_q, seqlen_k >= 1. softmax_scale must be positive (the running max is taken over
// unscaled scores).
#pragma once

#include "fwd_traits.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"
#include "warp_gemm.cuh"

namespace ft {

template <class Tr>
__device__ __forceinline__ void flash_fwd(
    const typename Tr::Element* __restrict__ q, const typename Tr::Element* __restrict__ k,
    const typename Tr::Element* __restrict__ v, typename Tr::Element* __restrict__ o,
    float* __restrict__ lse, int seqlen_q, int seqlen_k, int heads_q, int heads_kv,
    long long q_batch_stride, long long q_row_stride, long long q_head_stride,
    long long k_batch_stride, long long k_row_stride, long long k_head_stride,
    long long v_batch_stride, long long v_row_stride, long long v_head_stride,
    long long o_batch_stride, long long o_row_stride, long long o_head_stride,
    float softmax_scale) {
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kNumStages;

  const int m_block = static_cast<int>(blockIdx.x);
  const int head = static_cast<int>(blockIdx.y);
  const int batch = static_cast<int>(blockIdx.z);
  const int kv_head = head / (heads_q / heads_kv);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();

  // Row 0 of this (batch, head) in each tensor.
  const Element* q_bh = q + batch * q_batch_stride + head * q_head_stride;
  const Element* k_bh = k + batch * k_batch_stride + kv_head * k_head_stride;
  const Element* v_bh = v + batch * v_batch_stride + kv_head * v_head_stride;
  Element* o_bh = o + batch * o_batch_stride + head * o_head_stride;
  float* lse_bh = lse + (static_cast<long long>(batch) * heads_q + head) * seqlen_q;

  // Keys [0, n_end) are visible to some row of the block; the causal diagonal is aligned to
  // the bottom-right corner: row i sees key j iff j <= i + seqlen_k - seqlen_q.
  const int m0 = m_block * kBlockM;
  const int m_end = seqlen_q < m0 + kBlockM ? seqlen_q : m0 + kBlockM;
  int n_end = seqlen_k;
  // Keys [0, n_full) are visible to every row of the block: tiles inside need no mask.
  int n_full = seqlen_k;
  if constexpr (Tr::kCausal) {
    const int last_row_end = m_end + seqlen_k - seqlen_q;
    const int first_row_end = m0 + 1 + seqlen_k - seqlen_q;
    n_end = last_row_end < n_end ? last_row_end : n_end;
    n_full = first_row_end < n_full ? first_row_end : n_full;
  }
  if (n_end <= 0) {  // no row of the block sees any key
    store_empty_rows<Tr>(o_bh, o_row_stride, lse_bh, m0, seqlen_q, tid);
    return;
  }
  const int n_tiles = (n_end + kBlockN - 1) / kBlockN;
  const int first_masked_tile = n_full <= 0 ? 0 : n_full / kBlockN;

  FT_DYNAMIC_SMEM(unsigned char, smem);
  Element* const sq = reinterpret_cast<Element*>(smem);
  Element* const sk = sq + Tr::kKOffset;
  Element* const sv = sq + Tr::kVOffset;

  // The pipeline walks the tiles from the last one down, so the tiles that need a mask come
  // first; step j works on tile n_tiles - 1 - j, in buffer j % kStages. One cp.async group
  // per copy, committed in the order K_0 (with Q), V_0, K_1, V_1, ... (indices are steps);
  // a step past the last tile commits an empty group, which keeps the wait counts uniform.
  auto load_k = [&](int step) {
    if (step < n_tiles) {
      load_rows_async<Tr, kBlockN>(sk + (step % kStages) * Tr::kKvElems, k_bh, k_row_stride,
                                   (n_tiles - 1 - step) * kBlockN, seqlen_k, tid);
    }
    cp_async_commit();
  };
  auto load_v = [&](int step) {
    if (step < n_tiles) {
      load_rows_async<Tr, kBlockN>(sv + (step % kStages) * Tr::kKvElems, v_bh, v_row_stride,
                                   (n_tiles - 1 - step) * kBlockN, seqlen_k, tid);
    }
    cp_async_commit();
  };

  load_rows_async<Tr, kBlockM>(sq, q_bh, q_row_stride, m0, seqlen_q, tid);
  load_k(0);
#pragma unroll
  for (int step = 0; step + 1 < kStages; ++step) {
    load_v(step);
    load_k(step + 1);
  }

  float acc_o[Tr::kMTiles][Tr::kOTiles][4];
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < Tr::kOTiles; ++dt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_o[mt][dt][i] = 0.0f;
    }
  }
  OnlineSoftmax<Tr> softmax;
  softmax.init();
  const float scale_log2 = softmax_scale * 1.44269504088896340736f;
  const int warp_row0 = warp * Tr::kWarpRows;
  const Element* const sq_warp = sq + warp_row0 * Tr::kRowStride;

  for (int j = 0; j < n_tiles; ++j) {
    const int tile = n_tiles - 1 - j;
    const int buf = j % kStages;

    // K_j has landed for every thread; every warp is done with step j-1 (its V buffer is
    // the one refilled next).
    cp_async_wait<Tr::kPipelineWait>();
    block_sync();
    load_v(j + kStages - 1);

    float s[Tr::kMTiles][Tr::kSTiles][4];
    gemm_qk<Tr>(s, sq_warp, sk + buf * Tr::kKvElems, lane);
    if (tile >= first_masked_tile) {
      apply_mask<Tr>(s, m0 + warp_row0, tile * kBlockN, seqlen_q, seqlen_k, lane);
    }

    // V_j has landed for every thread; every warp is done reading K_j's buffer.
    cp_async_wait<Tr::kPipelineWait>();
    block_sync();
    load_k(j + kStages);

    softmax.update(s, acc_o, scale_log2);
    gemm_pv<Tr>(acc_o, s, sv + buf * Tr::kKvElems, lane);
  }
  cp_async_wait_all();  // only empty groups remain; leave none behind

  // Epilogue. Every warp passed the last barrier after its last read of Q, and only this
  // warp reads its own Q rows, so they are free to stage this warp's output rows.
  float inv_sum[Tr::kMTiles][2];
  float row_lse[Tr::kMTiles][2];
  softmax.finalize(inv_sum, row_lse);
  Element* const so_warp = sq + warp_row0 * Tr::kRowStride;
  const int g = lane / 4;
  const int t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mt * 16 + g + 8 * h;
#pragma unroll
      for (int dt = 0; dt < Tr::kOTiles; ++dt) {
        *reinterpret_cast<unsigned*>(so_warp + r * Tr::kRowStride + dt * 8 + 2 * t) =
            Tr::Ops::pack(acc_o[mt][dt][2 * h] * inv_sum[mt][h],
                          acc_o[mt][dt][2 * h + 1] * inv_sum[mt][h]);
      }
      const int row = m0 + warp_row0 + r;
      if (t == 0 && row < seqlen_q) lse_bh[row] = row_lse[mt][h];
    }
  }
  warp_sync();
  store_warp_rows<Tr>(o_bh, o_row_stride, so_warp, m0 + warp_row0, seqlen_q, lane);
}

}  // namespace ft
