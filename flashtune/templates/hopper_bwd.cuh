// FlashAttention backward main kernel for sm_90a on wgmma: dK, dV and the float32 dQ
// accumulator, with the mma.sync backward's arguments and contract (flash_bwd.cuh): the
// preprocess (D = rowsum(dO O), accumulator zeroed) and the convert (slices summed in a
// fixed order, scaled by softmax_scale, rounded) are the same row kernels.
//
// One block owns kBlockN keys of one (batch, kv head): one warpgroup (128 threads) per 64 of
// them, kBlockN = 64 or 128, times kDimGroups: at head dims over 128, dK and dV of 64 keys
// (head_dim / 2 float32 registers each per thread) do not fit one warpgroup's registers, so
// two warpgroups share each 64 keys, each owning half of the head dim of dK and dV (both
// compute the 64-key S^T and dP^T, over the whole head dim: the price of keeping P^T and
// dS^T in registers as the A of dV and dK). It steps over the query tiles of kBlockM = 64 rows, of every
// query head of the group, that can see its keys (causal: from the tile holding the first
// row at or below the bottom-right-aligned diagonal). K and V are loaded once; per step,
// every thread copies its share of Q, dO (cp.async) and of the LSE and D rows; then, in each
// warpgroup, for its 64 keys:
//   S^T  = K Q^T    wgmma SS, A = K (K-major), B = Q (K-major), N = kBlockM
//   dP^T = V dO^T   wgmma SS, A = V, B = dO, N = kBlockM
//   P^T  = exp2(S^T scale log2(e) - LSE log2(e)), 0 where masked; dS^T = P^T (dP^T - D)
//   dV  += P^T dO   wgmma RS, A = P^T from the accumulators, B = dO (MN-major), N = D / G
//   dK  += dS^T Q   wgmma RS, A = dS^T, B = Q (MN-major), N = D / G (G = kDimGroups)
// dK and dV stay in float32 registers across the whole query loop. dS is written to shared
// memory transposed (queries x keys, the K-major A layout), and after a block barrier each
// warpgroup computes its D / kWarpGroups columns of dQ = dS K (wgmma SS, A = dS, B = K
// MN-major, K = all kBlockN keys) and adds them to the accumulator: float32 atomics into
// slice 0 (kDqSplit false), or, deterministic, plain adds into the block's own slice (the
// grid then has one block per slice, each visiting key tiles blockIdx.x, + gridDim.x, ...:
// the sum into an element happens in a fixed order whatever order the blocks run in).
//
// Tiles are 128-byte swizzled (panels of 64 columns: row r of a panel at r * 128, 16-byte
// chunk c at c ^ (r % 8)) from a 1024-byte boundary. Loads are by all threads with cp.async
// and a block barrier (no producer warpgroup, no TMA and no stage ring in this version).
// dK is scaled by softmax_scale at the end, dQ by the convert kernel.
//
// Features (the mma.sync backward's, VariantArgs): a sliding window (Local: key j visible
// to row i when i + Nk - Nq - left <= j <= i + Nk - Nq + right; query tiles that see none of
// the block's keys are never visited) and softcap (the score is cap tanh(scale s / cap); dS
// carries the tanh's derivative 1 - tanh^2), and varlen (the mma.sync backward's packed
// layout, flash_bwd.cuh: the grid's batch index is the sequence, rows cu_seqlens_q[b] ..
// of the packed Q and dO and cu_seqlens_k[b] .. of K, V, dK and dV, LSE, D and accumulator
// rows q_start .. of each head's total_q; blocks past a sequence's last key tile do nothing,
// a sequence without query rows stores dK = dV = 0).
//
// FT_HOPPER_BWD_PLANTED_BUG (tests only; 0 in every rendered kernel): 1 leaves out the block
// barrier between the dS stores and the dQ wgmma that reads every warpgroup's dS rows.
#pragma once

#include "hopper_fwd.cuh"  // load_tile (swizzled cp.async rows), wgmma.cuh
#include "variant_args.cuh"

#ifndef FT_HOPPER_BWD_PLANTED_BUG
#define FT_HOPPER_BWD_PLANTED_BUG 0
#endif

namespace ft {

template <typename Element_, bool IsBf16, int HeadDim, int BlockN, bool Causal, bool DqSplit,
          bool Local = false, bool Softcap = false, bool Varlen = false,
          class Mods_ = NoScoreMods>
struct HopperBwdTraits {
  using Element = Element_;
  using Ops = TensorOps<Element>;
  // Declared score modifications (codegen.score_mods' functor, with its derivative): P is
  // recomputed from the modified score and dS carries the slope, as in flash_bwd.cuh; a
  // block mask's tile ranges (in their column form) narrow each key tile's query tiles and
  // its mask is evaluated on the partial ones only.
  using Mods = Mods_;
  static constexpr bool kBf16 = IsBf16;
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = BlockN;
  static constexpr bool kCausal = Causal;
  static constexpr bool kDqSplit = DqSplit;
  static constexpr bool kLocal = Local;
  static constexpr bool kSoftcap = Softcap;
  static constexpr bool kVarlen = Varlen;
  static constexpr int kKeyGroups = BlockN / 64;   // 64 keys each
  // Head-dim halves of dK and dV: over head dim 128, and at 128 with declared score
  // modifications (their functor and the dscore stores need the registers of half of dK
  // and dV).
  static constexpr int kDimGroups = HeadDim > 128 || (Mods::kOn && HeadDim == 128) ? 2 : 1;
  static constexpr int kWarpGroups = kKeyGroups * kDimGroups;
  static constexpr int kDkvCols = HeadDim / kDimGroups;  // dK and dV columns of a warpgroup
  static constexpr int kThreads = 128 * kWarpGroups;
  static constexpr int kChunks = HeadDim / 8;      // 16-byte chunks of a row (load_tile)
  static constexpr int kDimSteps = HeadDim / 16;   // k16 steps of S^T and dP^T
  static constexpr int kQSteps = kBlockM / 16;     // k16 steps of dV and dK
  static constexpr int kKeySteps = BlockN / 16;    // k16 steps of dQ
  static constexpr int kDqCols = HeadDim / kWarpGroups;  // dQ columns of one warpgroup
  // dQ columns per wgmma: 64 when dK and dV are split (registers), else all of them.
  static constexpr int kDqChunk = kDimGroups > 1 ? 64 : kDqCols;
  // Byte offsets from the 1024-byte-aligned base.
  static constexpr int kKvBytes = BlockN * HeadDim * 2;
  static constexpr int kQBytes = kBlockM * HeadDim * 2;
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKOffset + kKvBytes;
  static constexpr int kQOffset = kVOffset + kKvBytes;
  static constexpr int kDoOffset = kQOffset + kQBytes;
  static constexpr int kDsOffset = kDoOffset + kQBytes;
  static constexpr int kStatsOffset = kDsOffset + kBlockM * BlockN * 2;
  // Tiles, LSE and D rows, up to 1023 bytes to align the base.
  static constexpr int kSmemBytes = kStatsOffset + 2 * kBlockM * 4 + 1024;

  static_assert(HeadDim == 64 || HeadDim == 128 || HeadDim == 256, "head dim: 64, 128 or 256");
  static_assert(BlockN == 64 || BlockN == 128, "block_n: 64 or 128 (one warpgroup per 64 keys)");
  static_assert(kDqCols % 16 == 0, "a warpgroup's dQ columns: the N of a wgmma");

  // Byte offset of 16-byte chunk c of row r in a swizzled tile of `rows` rows.
  static __device__ __forceinline__ int chunk_offset(int rows, int r, int c) {
    return (c / 8) * rows * 128 + r * 128 + (((c % 8) ^ (r % 8)) * 16);
  }
};

// The four registers of the RS A operand for k-step kk from a 64 x N accumulator: the
// register-A map is the accumulator map with N = 16, so they are its values 8 kk .. 8 kk + 7
// packed in pairs.
template <class Tr, int R>
__device__ __forceinline__ void pack_a(const float (&d)[R], int kk, unsigned (&a)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = Tr::Ops::pack(d[8 * kk + 2 * i], d[8 * kk + 2 * i + 1]);
}

// acc (64 x N) += A B over kSteps k16 steps, both K-major in shared memory (A at a_addr with
// a_rows rows per panel, B at b_addr with b_rows), one commit group it does not wait for.
template <class Tr, int N, int kSteps>
__device__ __forceinline__ void issue_ss_kmajor(float (&acc)[N / 2], unsigned a_addr, int a_rows,
                                                unsigned b_addr, int b_rows, bool accumulate) {
  const unsigned long long a_desc = wgmma_desc(a_addr, 16, 1024, kSwizzle128B);
  const unsigned long long b_desc = wgmma_desc(b_addr, 16, 1024, kSwizzle128B);
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    const unsigned off = (ks % 4) * 32;
    wgmma_ss<N, Tr::kBf16, false, false>(
        acc, wgmma_desc_add(a_desc, (ks / 4) * a_rows * 128 + off),
        wgmma_desc_add(b_desc, (ks / 4) * b_rows * 128 + off), accumulate || ks > 0);
  }
}

// acc (64 x kDkvCols) += A B over kSteps k16 steps, A from registers (a[kk]), B MN-major in
// shared memory at b_addr (its first column; rows of D columns, b_rows rows per panel).
template <class Tr, int kSteps>
__device__ __forceinline__ void issue_rs(float (&acc)[Tr::kDkvCols / 2],
                                         const unsigned (&a)[kSteps][4], unsigned b_addr,
                                         int b_rows) {
  const unsigned long long b_desc = wgmma_desc(b_addr, b_rows * 128, 1024, kSwizzle128B);
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    wgmma_rs<Tr::kDkvCols, Tr::kBf16, true>(acc, a[kk], wgmma_desc_add(b_desc, kk * 16 * 128),
                                            1);
  }
}

// Stores a warpgroup's 64 x kDkvCols float32 accumulator (rows row0.. of the tensor, from
// the column `out` points at, times scale) in the element type; rows at and past `rows` are
// not written.
template <class Tr>
__device__ __forceinline__ void store_rows_scaled(typename Tr::Element* out, long long row_stride,
                                                  const float (&acc)[Tr::kDkvCols / 2], int row0,
                                                  int rows, float scale, int warp, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 16 * warp + lane / 4 + 8 * h;
    if (row >= rows) continue;
    typename Tr::Element* dst = out + row * row_stride + 2 * (lane % 4);
#pragma unroll
    for (int nt = 0; nt < Tr::kDkvCols / 8; ++nt) {
      *reinterpret_cast<unsigned*>(dst + 8 * nt) =
          Tr::Ops::pack(acc[4 * nt + 2 * h] * scale, acc[4 * nt + 2 * h + 1] * scale);
    }
  }
}

// The main kernel's arguments (the mma.sync backward's, flash_bwd.cu.jinja without features).
template <typename Element>
struct BwdParams {
  const Element* __restrict__ q;
  const Element* __restrict__ k;
  const Element* __restrict__ v;
  const Element* __restrict__ dout;
  const float* __restrict__ lse;
  const float* __restrict__ dsum;
  Element* __restrict__ dk;
  Element* __restrict__ dv;
  float* __restrict__ dq_accum;
  int seqlen_q, seqlen_k, heads_q, heads_kv;
  long long q_batch_stride, q_row_stride, q_head_stride;
  long long k_batch_stride, k_row_stride, k_head_stride;
  long long v_batch_stride, v_row_stride, v_head_stride;
  long long do_batch_stride, do_row_stride, do_head_stride;
  long long dk_batch_stride, dk_row_stride, dk_head_stride;
  long long dv_batch_stride, dv_row_stride, dv_head_stride;
  float softmax_scale;
  VariantArgs var;  // the features' values (those of Local, Softcap and Varlen are read)
};

// The key tiles blockIdx.x, + gridDim.x, ... of kv head blockIdx.y, batch blockIdx.z.
template <class Tr>
__device__ __forceinline__ void hopper_bwd(const BwdParams<typename Tr::Element>& a,
                                           const typename Tr::Mods& mods = {},
                                           float* __restrict__ dscore = nullptr,
                                           int dscore_rows = 0, int dscore_cols = 0) {
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kD = Tr::kHeadDim;
  constexpr float kLog2e = 1.44269504088896340736f;

  FT_DYNAMIC_SMEM(unsigned char, raw);
  const unsigned window = smem_address(raw);
  const unsigned pad = (1024u - (window & 1023u)) & 1023u;
  unsigned char* const smem = raw + pad;
  const unsigned base = window + pad;
  float* const slse = reinterpret_cast<float*>(smem + Tr::kStatsOffset);
  float* const sdsum = slse + kBlockM;

  const int kv_head = static_cast<int>(blockIdx.y);
  const int batch = static_cast<int>(blockIdx.z);
  const int group = a.heads_q / a.heads_kv;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int wg = tid / 128;            // this warpgroup: dQ columns kDqCols wg ..
  // Keys 64 wg_key .. of the tile; dK and dV columns kDkvCols wg_dim .. (constants where
  // the head dim is not split: fewer live registers).
  const int wg_key = Tr::kDimGroups > 1 ? wg % Tr::kKeyGroups : wg;
  const int wg_dim = Tr::kDimGroups > 1 ? wg / Tr::kKeyGroups : 0;
  // Its first column of dO and Q (B of dV and dK): panel kDkvCols wg_dim / 64 of 64 rows.
  const unsigned dkv_col_bytes = ((Tr::kDkvCols * wg_dim) / 64) * kBlockM * 128;
  const int warp = (tid % 128) / 32;   // warp within the warpgroup: accumulator rows 16 warp..
  const float scale_log2 = a.softmax_scale * kLog2e;
  const long long bh_rows = (Tr::kVarlen ? 1LL : static_cast<long long>(gridDim.z)) *
                            a.heads_q * a.seqlen_q;
  float* const dq_slice = a.dq_accum + (Tr::kDqSplit ? blockIdx.x : 0) * bh_rows * kD;

  // This sequence: its lengths and row 0 in the (packed or batched) tensors. The LSE, D and
  // accumulator rows of query head h start at stats_row0 + h * stats_rows.
  int seqlen_q = a.seqlen_q;
  int seqlen_k = a.seqlen_k;
  long long q_row0 = batch * a.q_batch_stride;
  long long do_row0 = batch * a.do_batch_stride;
  long long k_row0 = batch * a.k_batch_stride;
  long long v_row0 = batch * a.v_batch_stride;
  long long dk_row0 = batch * a.dk_batch_stride;
  long long dv_row0 = batch * a.dv_batch_stride;
  long long stats_row0 = static_cast<long long>(batch) * a.heads_q * a.seqlen_q;
  const long long stats_rows = a.seqlen_q;  // the whole pack's rows per head when varlen
  if constexpr (Tr::kVarlen) {
    const int q_start = a.var.cu_seqlens_q[batch];
    const int k_start = a.var.cu_seqlens_k[batch];
    seqlen_q = a.var.cu_seqlens_q[batch + 1] - q_start;
    seqlen_k = a.var.cu_seqlens_k[batch + 1] - k_start;
    q_row0 = q_start * a.q_row_stride;
    do_row0 = q_start * a.do_row_stride;
    k_row0 = k_start * a.k_row_stride;
    v_row0 = k_start * a.v_row_stride;
    dk_row0 = k_start * a.dk_row_stride;
    dv_row0 = k_start * a.dv_row_stride;
    stats_row0 = q_start;
  }

  using Element = typename Tr::Element;
  const Element* k_bh = a.k + k_row0 + kv_head * a.k_head_stride;
  const Element* v_bh = a.v + v_row0 + kv_head * a.v_head_stride;
  const int n_blocks = (seqlen_k + kBlockN - 1) / kBlockN;
  const int m_blocks = (seqlen_q + kBlockM - 1) / kBlockM;
  // The window's clamped sizes (causal alone: right 0; neither: unused).
  const int right = Tr::kLocal ? a.var.right(seqlen_q) : 0;
  const int left = Tr::kLocal ? a.var.left(seqlen_k) : 0;
  const float tanh_scale = Tr::kSoftcap ? a.softmax_scale / a.var.softcap : 0.0f;

  // Shared-window addresses: this warpgroup's 64 K and V rows (A of S^T and dP^T), the
  // whole K tile, Q, dO and dS.
  const unsigned k_addr = base + Tr::kKOffset;
  const unsigned v_addr = base + Tr::kVOffset;
  const unsigned q_addr = base + Tr::kQOffset;
  const unsigned do_addr = base + Tr::kDoOffset;
  const unsigned ds_addr = base + Tr::kDsOffset;

  for (int n_block = static_cast<int>(blockIdx.x); n_block < n_blocks;
       n_block += static_cast<int>(gridDim.x)) {
    const int n0 = n_block * kBlockN;
    // The query tiles [m_first, m_end) hold the rows that see some key of this tile: rows
    // i >= j - (Nk - Nq) - right (causal, local) and, local, i <= j - (Nk - Nq) + left.
    int m_first = 0;
    int m_end = m_blocks;
    if constexpr (Tr::kCausal || Tr::kLocal) {
      const int first_row = n0 - (seqlen_k - seqlen_q) - right;
      m_first = first_row > 0 ? first_row / kBlockM : 0;
    }
    if constexpr (Tr::kLocal) {
      const int last_row = n0 + kBlockN - 1 - (seqlen_k - seqlen_q) + left;
      const int end = last_row < 0 ? 0 : last_row / kBlockM + 1;
      m_end = end < m_blocks ? end : m_blocks;
    }
    if constexpr (Tr::Mods::kTileRanges) {
      flex::clip_query_tiles(mods, batch, kv_head, group, n_block, m_blocks, m_first, m_end);
    }
    const int m_count = m_end > m_first ? m_end - m_first : 0;
    const int steps = group * m_count;

    block_sync();  // every warpgroup is done with the previous key tile's K and V
    const long long key_row = n0;
    load_tile<Tr, kBlockN>(smem + Tr::kKOffset, k_bh + key_row * a.k_row_stride, a.k_row_stride,
                           seqlen_k - n0, tid);
    load_tile<Tr, kBlockN>(smem + Tr::kVOffset, v_bh + key_row * a.v_row_stride, a.v_row_stride,
                           seqlen_k - n0, tid);

    float acc_dk[Tr::kDkvCols / 2];
    float acc_dv[Tr::kDkvCols / 2];
#pragma unroll
    for (int i = 0; i < Tr::kDkvCols / 2; ++i) acc_dk[i] = acc_dv[i] = 0.0f;

    // This thread's keys (accumulator rows of S^T, dK, dV): key0 and key0 + 8.
    const int key0 = n0 + 64 * wg_key + 16 * warp + lane / 4;

    for (int s = 0; s < steps; ++s) {
      const int head = kv_head * group + s / m_count;
      const int m0 = (m_first + s % m_count) * kBlockM;
      const long long stats = stats_row0 + head * stats_rows;
      if (s > 0) block_sync();  // every warpgroup is done with the previous Q, dO and dS
      load_tile<Tr, kBlockM>(smem + Tr::kQOffset,
                             a.q + q_row0 + head * a.q_head_stride +
                                 static_cast<long long>(m0) * a.q_row_stride,
                             a.q_row_stride, seqlen_q - m0, tid);
      load_tile<Tr, kBlockM>(smem + Tr::kDoOffset,
                             a.dout + do_row0 + head * a.do_head_stride +
                                 static_cast<long long>(m0) * a.do_row_stride,
                             a.do_row_stride, seqlen_q - m0, tid);
      cp_async_commit();
      if (tid < kBlockM) {
        // A row past seqlen_q sees no key: LSE +inf makes its P 0 before the mask does.
        const bool in = m0 + tid < seqlen_q;
        slse[tid] = in ? a.lse[stats + m0 + tid] * kLog2e : INFINITY;
        sdsum[tid] = in ? a.dsum[stats + m0 + tid] : 0.0f;
      }
      cp_async_wait<0>();
      fence_proxy_async();  // this thread's cp.async writes (generic proxy) before wgmma reads
      block_sync();

      // A block mask's full tiles (every row sees every key) skip the mask's evaluation.
      [[maybe_unused]] bool partial = true;
      if constexpr (Tr::Mods::kTileRanges) {
        partial = flex::partial_query_tile(mods, batch, head, n_block, m0 / kBlockM);
      }
      float acc_s[kBlockM / 2];
      float acc_dp[kBlockM / 2];
      wgmma_fence();
      issue_ss_kmajor<Tr, kBlockM, Tr::kDimSteps>(acc_s, k_addr + 64 * wg_key * 128, kBlockN, q_addr,
                                                  kBlockM, false);
      issue_ss_kmajor<Tr, kBlockM, Tr::kDimSteps>(acc_dp, v_addr + 64 * wg_key * 128, kBlockN,
                                                  do_addr, kBlockM, false);
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operands(acc_s);
      wgmma_fence_operands(acc_dp);

      // P^T and dS^T in place of S^T and dP^T: element e is key key0 + 8 ((e >> 1) & 1),
      // query m0 + 8 (e >> 2) + 2 (lane % 4) + (e & 1).
#pragma unroll
      for (int e = 0; e < kBlockM / 2; ++e) {
        const int key = key0 + 8 * ((e >> 1) & 1);
        const int col = 8 * (e >> 2) + 2 * (lane % 4) + (e & 1);
        const int row = m0 + col;
        bool seen = key < seqlen_k && row < seqlen_q;
        if constexpr (Tr::kCausal || Tr::kLocal) {
          seen = seen && key <= row + seqlen_k - seqlen_q + right;
        }
        if constexpr (Tr::kLocal) seen = seen && key >= row + seqlen_k - seqlen_q - left;
        if constexpr (Tr::Mods::kTileRanges) {
          seen = seen && (!partial || mods.keep(batch, head, row, key));
        }
        float p;
        float dtanh = 1.0f;  // the derivative of the capped score by the scaled one
        if constexpr (Tr::Mods::kOn) {
          // The score in natural-log units (after softcap), then the modifications: P of
          // the modified score, dS times their slope; the gradient by the modified score
          // into dscore (the reduction of captured tensors' gradients reads it).
          float x;
          if constexpr (Tr::kSoftcap) {
            const float th = tanhf(acc_s[e] * tanh_scale);
            x = a.var.softcap * th;
            dtanh = 1.0f - th * th;
          } else {
            x = acc_s[e] * a.softmax_scale;
          }
          const float slope = seen ? mods.grad(x, batch, head, row, key) : 0.0f;
          x = mods(x, batch, head, row, key);
          p = seen ? exp2f_fast(x * kLog2e - slse[col]) : 0.0f;
          const float dmod = p * (acc_dp[e] - sdsum[col]);
          if (dscore != nullptr && seen) {
            dscore[((static_cast<long long>(batch) * a.heads_q + head) * dscore_rows + row) *
                       dscore_cols + key] = dmod;
          }
          acc_s[e] = p;
          acc_dp[e] = p == 0.0f ? 0.0f : dmod * slope * dtanh;  // hidden: nothing passes
        } else {
          if constexpr (Tr::kSoftcap) {
            const float th = tanhf(acc_s[e] * tanh_scale);
            p = seen ? exp2f_fast(a.var.softcap * th * kLog2e - slse[col]) : 0.0f;
            dtanh = 1.0f - th * th;
          } else {
            p = seen ? exp2f_fast(acc_s[e] * scale_log2 - slse[col]) : 0.0f;
          }
          acc_s[e] = p;
          acc_dp[e] = p * (acc_dp[e] - sdsum[col]) * dtanh;
        }
      }
      unsigned a_p[Tr::kQSteps][4];
      unsigned a_ds[Tr::kQSteps][4];
#pragma unroll
      for (int kk = 0; kk < Tr::kQSteps; ++kk) {
        pack_a<Tr>(acc_s, kk, a_p[kk]);
        pack_a<Tr>(acc_dp, kk, a_ds[kk]);
      }
      wgmma_fence();
      issue_rs<Tr, Tr::kQSteps>(acc_dv, a_p, do_addr + dkv_col_bytes, kBlockM);
      issue_rs<Tr, Tr::kQSteps>(acc_dk, a_ds, q_addr + dkv_col_bytes, kBlockM);
      wgmma_commit();

      // dS (queries x keys) into shared memory, the K-major A layout of dQ = dS K (by the
      // first of the warpgroups that hold the same keys).
#pragma unroll
      for (int e = 0; e < kBlockM / 2; ++e) {
        if (wg_dim != 0) break;
        const int key = 64 * wg_key + 16 * warp + lane / 4 + 8 * ((e >> 1) & 1);
        const int col = 8 * (e >> 2) + 2 * (lane % 4) + (e & 1);
        // The low half of a rounded pair is the element (its row neighbour is in another row).
        *reinterpret_cast<unsigned short*>(
            smem + Tr::kDsOffset + Tr::chunk_offset(kBlockM, col, key / 8) + (key % 8) * 2) =
            static_cast<unsigned short>(Tr::Ops::pack(acc_dp[e], 0.0f) & 0xFFFFu);
      }
      fence_proxy_async();  // this thread's dS stores (generic proxy) before wgmma reads
      if constexpr (FT_HOPPER_BWD_PLANTED_BUG != 1) block_sync();  // the whole dS tile is written

      if constexpr (Tr::kDimGroups > 1) {
        // dK and dV of the step first: their A fragments are free before dQ's accumulators
        // are live (a thread's dK and dV leave no room for both).
        wgmma_wait<0>();
        wgmma_fence_operands(acc_dv);
        wgmma_fence_operands(acc_dk);
      }
      // This warpgroup's dQ columns (kDqCols wg ..) in chunks of kDqChunk columns, one
      // accumulator at a time.
#pragma unroll
      for (int chunk = 0; chunk < Tr::kDqCols / Tr::kDqChunk; ++chunk) {
        const int col = Tr::kDqCols * wg + Tr::kDqChunk * chunk;
        float acc_dq[Tr::kDqChunk / 2];
        wgmma_fence();
        {
          const unsigned long long a_desc = wgmma_desc(ds_addr, 16, 1024, kSwizzle128B);
          // Column col of K's rows: panel col / 64, 128 bytes a row, plus 2 bytes a column
          // inside the panel.
          const unsigned b_start = k_addr + (col / 64) * kBlockN * 128 + (col % 64) * 2;
          const unsigned long long b_desc =
              wgmma_desc(b_start, kBlockN * 128, 1024, kSwizzle128B);
#pragma unroll
          for (int ks = 0; ks < Tr::kKeySteps; ++ks) {
            wgmma_ss<Tr::kDqChunk, Tr::kBf16, false, true>(
                acc_dq, wgmma_desc_add(a_desc, (ks / 4) * kBlockM * 128 + (ks % 4) * 32),
                wgmma_desc_add(b_desc, ks * 16 * 128), ks > 0);
          }
        }
        wgmma_commit();
        wgmma_wait<0>();  // dQ, and dV and dK of this step
        wgmma_fence_operands(acc_dq);
        wgmma_fence_operands(acc_dv);
        wgmma_fence_operands(acc_dk);

        float* dq_head = dq_slice + (stats + m0) * kD + col;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = 16 * warp + lane / 4 + 8 * h;
          if (m0 + row >= seqlen_q) continue;
          float* dst = dq_head + row * kD + 2 * (lane % 4);
#pragma unroll
          for (int nt = 0; nt < Tr::kDqChunk / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float value = acc_dq[4 * nt + 2 * h + e];
              if constexpr (Tr::kDqSplit) {
                // This block owns its slice and adds its key tiles one after another.
                dst[8 * nt + e] += value;
              } else {
                atomic_add_f32(dst + 8 * nt + e, value);
              }
            }
          }
        }
      }
    }
    cp_async_wait_all();  // nothing in flight (also when there were no steps)

    const int key_row0 = n0 + 64 * wg_key;
    const int col0 = Tr::kDkvCols * wg_dim;
    store_rows_scaled<Tr>(a.dk + dk_row0 + kv_head * a.dk_head_stride + col0,
                          a.dk_row_stride, acc_dk, key_row0, seqlen_k, a.softmax_scale, warp,
                          lane);
    store_rows_scaled<Tr>(a.dv + dv_row0 + kv_head * a.dv_head_stride + col0,
                          a.dv_row_stride, acc_dv, key_row0, seqlen_k, 1.0f, warp, lane);
  }
}

}  // namespace ft
