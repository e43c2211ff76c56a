// The FP8 forward on sm_90a wgmma (FA3's FP8 forward): e4m3 (or e5m2) Q, K and V with
// descale factors per (batch, KV head), a 16-bit O and the float32 LSE. One consumer
// warpgroup per 64 query rows of one (batch, head), kBlockM 64 or 128.
//
// Per block: Q (kBlockM rows) and a ring of kStages K and V tiles (kBlockN rows) land in
// shared memory by cp.async, in the 128-byte-swizzled layout of hopper_fwd.cuh with FP8
// bytes (a row of D values is D bytes; head dim 64 takes half of a 128-byte row), guarded by
// full / empty mbarriers as there. Per key tile, in this order:
//   * every thread transposes its share of the stage's V into one of two V^T buffers
//     (hopper_fp8.cuh: the K-major B operand FP8 wgmma requires, keys in P's register
//     order), on chip: V is read from global memory once, by the stage's copy;
//   * one block barrier publishes V^T (fence.proxy.async first) and, with two buffers,
//     proves every warpgroup done with the tile before last, whose buffer is written next;
//   * S = Q K^T by wgmma m64nNk32 from shared memory (both K-major);
//   * the online softmax of the 16-bit kernels (softmax.cuh) in the log2 domain with the
//     scale softmax_scale * q_descale * k_descale (scores, LSE: those of the dequantised Q
//     and K), its probabilities times 2^8 (FA3's offset: P in [0, 256] uses e4m3's range;
//     exact, a power of two) rounded to FP8 by cvt.rn.satfinite into the A registers of P V;
//   * O += P V^T by wgmma m64nNk32 with P from registers;
// and at the end O times v_descale / 2^8 / row sum, rounded to O's type.
//
// Masking, block order, GQA, the LSE and the unseen rows are hopper_fwd.cuh's
// (key_range, for_each_key_tile, store_rows). Contract beyond the forward's: q, k, v are FP8
// bytes with strides in values, multiples of 16; base pointers 16-byte aligned; descales
// float32 (batch, heads_kv) contiguous, positive and finite.
#pragma once

#include "fwd_fp8.cuh"  // Fp8Scales
#include "hopper_fp8.cuh"
#include "hopper_fwd.cuh"

namespace ft {

// The FP8 kernel's shape: hopper_fwd.cuh's traits of O's type (the softmax, masks and
// epilogue read them), with the tiles in FP8 bytes.
template <typename Element_, bool IsBf16, bool E5M2, int HeadDim, int BlockM, int BlockN,
          int Stages, bool Causal>
struct HopperFp8Traits : HopperFwdTraits<Element_, IsBf16, HeadDim,
                                         BlockM, BlockN, Stages, Causal> {
  static constexpr bool kE5M2 = E5M2;
  // Overrides of the base's 16-bit tile shape.
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kOTiles = HeadDim / 8;
  static constexpr int kChunks = HeadDim / 8;       // O's 16-byte chunks (16-bit values)
  static constexpr int kInChunks = HeadDim / 16;    // an FP8 row's 16-byte chunks
  static constexpr int kQkSteps = HeadDim / 32;     // k32 steps of Q K^T
  static constexpr int kPvSteps32 = BlockN / 32;    // k32 steps of P V
  static constexpr int kRowBytes = HeadDim < 128 ? 128 : HeadDim;  // whole 128-byte panels
  static constexpr int kVtPanels = (BlockN + 127) / 128;  // V^T: rows of BlockN key bytes
  static constexpr int kQBytes = BlockM * kRowBytes;
  static constexpr int kTileBytes = BlockN * kRowBytes;
  static constexpr int kVtBytes = HeadDim * 128 * kVtPanels;
  static constexpr int kKOffset = kQBytes;
  static constexpr int kVOffset = kKOffset + Stages * kTileBytes;
  static constexpr int kVtOffset = kVOffset + Stages * kTileBytes;
  static constexpr int kBarOffset = kVtOffset + 2 * kVtBytes;
  static constexpr int kSmemBytes = kBarOffset + 16 * Stages + 1024;
  // P's scale before rounding (FA3's Max_offset 8) and its inverse, folded into O's.
  static constexpr float kPScale = 256.0f;
  static constexpr float kInvPScale = 1.0f / 256.0f;

  static_assert(HeadDim == 64 || HeadDim == 128 || HeadDim == 256, "head dim: 64, 128, 256");
  static_assert(BlockM == 64 || BlockM == 128, "block_m: 64 or 128 (one or two warpgroups)");
  static_assert(BlockN % 32 == 0, "block_n: whole k32 steps of P V");
};

// Q, K and V rows as load_tile copies them: 16-bit words (two FP8 values), D / 16 chunks of
// 16 bytes per row, chunk c of row r at byte 16 c of the swizzled row.
template <class Tr>
struct Fp8TileView {
  using Element = unsigned short;
  static constexpr int kThreads = Tr::kThreads;
  static constexpr int kChunks = Tr::kInChunks;
  static __device__ __forceinline__ int chunk_offset(int rows, int r, int c) {
    return swizzled_byte(rows, r, 16 * c);
  }
};

template <class Tr>
using Fp8FwdParams = FwdParams<typename Tr::Element, NoScoreMods, unsigned char, Fp8Scales>;

// S = Q K^T (FP8, both operands K-major) into s, waited for and tied.
template <class Tr>
__device__ __forceinline__ void fp8_qk(unsigned q_addr, unsigned k_addr,
                                       float (&s)[Tr::kBlockN / 2]) {
  const unsigned long long q_desc = wgmma_desc(q_addr, 16, 1024, kSwizzle128B);
  const unsigned long long k_desc = wgmma_desc(k_addr, 16, 1024, kSwizzle128B);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < Tr::kQkSteps; ++ks) {
    const unsigned off = (ks % 4) * 32;  // 32 bytes a k32 step, 4 steps a 128-byte panel
    wgmma_ss_fp8<Tr::kBlockN, Tr::kE5M2>(
        s, wgmma_desc_add(q_desc, (ks / 4) * Tr::kBlockM * 128 + off),
        wgmma_desc_add(k_desc, (ks / 4) * Tr::kBlockN * 128 + off), ks > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operands(s);
}

// O += P V^T (P from registers, V^T at vt_addr), waited for and tied.
template <class Tr>
__device__ __forceinline__ void fp8_pv(unsigned vt_addr, const unsigned (&p)[Tr::kPvSteps32][4],
                                       float (&o)[Tr::kHeadDim / 2]) {
  const unsigned long long vt_desc = wgmma_desc(vt_addr, 16, 1024, kSwizzle128B);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Tr::kPvSteps32; ++kk) {
    wgmma_rs_fp8<Tr::kHeadDim, Tr::kE5M2>(
        o, p[kk], wgmma_desc_add(vt_desc, (kk / 4) * Tr::kHeadDim * 128 + (kk % 4) * 32), 1);
  }
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operands(o);
}

// The block of query rows blockIdx.x * kBlockM.. of head blockIdx.y, batch blockIdx.z.
template <class Tr>
__device__ __forceinline__ void hopper_fwd_fp8(const Fp8FwdParams<Tr>& a) {
  using Element = typename Tr::Element;
  using View = Fp8TileView<Tr>;
  using Word = unsigned short;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;
  FT_DYNAMIC_SMEM(unsigned char, raw);
  const unsigned window = smem_address(raw);
  const unsigned pad = (1024u - (window & 1023u)) & 1023u;
  unsigned char* smem = raw + pad;
  const unsigned base = window + pad;
  auto* full = reinterpret_cast<unsigned long long*>(smem + Tr::kBarOffset);
  unsigned long long* empty = full + kStages;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();
  const int head = static_cast<int>(blockIdx.y);
  const int batch = static_cast<int>(blockIdx.z);
  const int kv_head = head / (a.heads_q / a.heads_kv);
  const int m0 = static_cast<int>(blockIdx.x) * Tr::kBlockM;
  // Rows as 16-bit words: strides in FP8 values are even (multiples of 16).
  const Word* q_bh = reinterpret_cast<const Word*>(a.q + batch * a.q_batch_stride +
                                                   head * a.q_head_stride);
  const Word* k_bh = reinterpret_cast<const Word*>(a.k + batch * a.k_batch_stride +
                                                   kv_head * a.k_head_stride);
  const Word* v_bh = reinterpret_cast<const Word*>(a.v + batch * a.v_batch_stride +
                                                   kv_head * a.v_head_stride);
  Element* o_bh = a.o + batch * a.o_batch_stride + head * a.o_head_stride;
  float* lse_bh = a.lse + (static_cast<long long>(batch) * a.heads_q + head) * a.seqlen_q;
  const KeyRange range = key_range<Tr>(m0, a.seqlen_q, a.seqlen_k, 0, 0);
  if (range.n_end <= range.n_begin || m0 >= a.seqlen_q) {
    store_unseen_rows<Tr>(o_bh, a.o_row_stride, lse_bh, m0, a.seqlen_q, tid, INFINITY);
    return;
  }
  const int n_tiles = range.n_tiles;
  const int count = range.count;
  const int scale_index = batch * a.heads_kv + kv_head;

  // Strides in 16-bit words (FP8 strides are even: multiples of 16).
  const CpAsyncRing<Tr, View> ring{smem, full, empty, k_bh, v_bh, a.k_row_stride / 2,
                                   a.v_row_stride / 2, n_tiles, a.seqlen_k, tid};
  ring.init();
  auto load = [&](int j) { ring.load(j); };
  load_tile<View, Tr::kBlockM>(smem, q_bh + m0 * (a.q_row_stride / 2), a.q_row_stride / 2,
                               a.seqlen_q - m0, tid);
  for (int j = 0; j < kStages && j < count; ++j) load(j);

  // Warp w of warpgroup w / 4 owns query rows m0 + 16 w ..
  const int group = warp / 4;
  const int row0 = m0 + 16 * warp;
  const unsigned q_addr = base + group * 64 * 128;
  float acc_o[1][Tr::kOTiles][4];
#pragma unroll
  for (int dt = 0; dt < Tr::kOTiles; ++dt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc_o[0][dt][i] = 0.0f;
  }
  auto& o_view = reinterpret_cast<float(&)[Tr::kHeadDim / 2]>(acc_o);
  OnlineSoftmax<Tr> softmax;
  RowLimits<Tr> limits;
  limits.init(row0, a.seqlen_q, a.seqlen_k, lane, 0, 0);
  // The dequantised scores' scale: the descales join the softmax scale (fp32).
  const float scale_log2 = a.softmax_scale * a.scales.q[scale_index] *
                           a.scales.k[scale_index] * 1.44269504088896340736f;

  for_each_key_tile<Tr>(range, limits, [&](int j, auto first, auto mask) {
    const int s = j % kStages;
    mbarrier_wait_parity(&full[s], static_cast<unsigned>(j / kStages) & 1u);
    const int vt = Tr::kVtOffset + (j % 2) * Tr::kVtBytes;
    transpose_v_fp8<kBlockN, Tr::kHeadDim, Tr::kThreads>(
        smem + Tr::kVOffset + s * Tr::kTileBytes, smem + vt, tid);
    fence_proxy_async();  // cp.async's and the transpose's writes before wgmma's reads
    block_sync();
    float acc_s[1][Tr::kSTiles][4];
    auto& s_view = reinterpret_cast<float(&)[kBlockN / 2]>(acc_s);
    fp8_qk<Tr>(q_addr, base + Tr::kKOffset + s * Tr::kTileBytes, s_view);
    const auto r = softmax.template exponentiate<decltype(first)::value>(acc_s, scale_log2, mask);
    if constexpr (!decltype(first)::value) softmax.rescale(acc_o, r);
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) s_view[i] *= Tr::kPScale;
    unsigned p[Tr::kPvSteps32][4];
    fp8_p_registers<kBlockN, Tr::kE5M2>(s_view, p);
    fp8_pv<Tr>(base + vt, p, o_view);
    mbarrier_arrive(&empty[s]);  // this thread is done with the stage (V^T holds V)
    if (j + kStages < count) {
      mbarrier_wait_parity(&empty[s], static_cast<unsigned>(j / kStages) & 1u);
      load(j + kStages);
    }
  });
  const float o_scale = a.scales.v[scale_index] * Tr::kInvPScale;
#pragma unroll
  for (int i = 0; i < Tr::kHeadDim / 2; ++i) o_view[i] *= o_scale;
  store_rows<Tr>(softmax, acc_o, o_bh, a.o_row_stride, lse_bh, row0, a.seqlen_q, lane);
}

}  // namespace ft
