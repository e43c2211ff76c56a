// FlashAttention forward pass for sm_90a on wgmma: one consumer warpgroup (128 threads) per
// 64 query rows of one (batch, head); kBlockM = 64 or 128 (1 or 2 warpgroups per block).
//
// Per block: Q (kBlockM x D) and a ring of kStages K and V tiles (kBlockN x D each) live in
// shared memory in the 128-byte-swizzled layout wgmma's descriptors read (panels of 64
// columns: row r of a panel is 128 bytes at r * 128, its 16-byte chunk c at c ^ (r % 8)).
// Every thread copies its share of each tile with cp.async and arrives on the stage's full
// mbarrier with cp.async.mbarrier.arrive.noinc (count: all threads), so the phase completes
// once every copy of the tile has landed; each thread waits for it, computes, and arrives on
// the stage's empty mbarrier (count: all threads) when its warpgroup's wgmma reads of the
// stage are complete; a stage is refilled only after its empty phase completed. Q lands with
// the first tile's phase.
//
// Per key tile, in each warpgroup: S = Q K^T by wgmma with both operands in shared memory
// (K-major, D / 16 k-steps of m64 n kBlockN k16), the online softmax of the mma.sync forward
// (softmax.cuh: the wgmma accumulator layout is the m16n8 C pattern repeated over the
// columns, so its fragments serve as they are), P packed from the S accumulators into the
// register-A layout (the same map with N = 16), and O += P V by wgmma with A from registers
// and V from shared memory as an MN-major operand (kBlockN / 16 k-steps of m64 n D k16).
//
// Masking, block order (key tiles from the last one down), GQA, the LSE and the argument list
// are those of the mma.sync forward (flash_fwd.cuh): Q, O (batch, seqlen_q, heads_q, D);
// K, V (batch, seqlen_k, heads_kv, D); strides in elements, last dim contiguous, base pointers
// 16-byte aligned, strides multiples of 8; LSE contiguous float32 (batch, heads_q, seqlen_q);
// the causal diagonal aligned to the bottom-right corner.
#pragma once

#include "flash_fwd.cuh"  // FwdParams (the same arguments) and softmax.cuh
#include "mbarrier.cuh"
#include "wgmma.cuh"

namespace ft {

// Compile-time shape of one variant. The fields named like FwdTraits' are the ones
// softmax.cuh reads (one 16-row m tile per warp).
template <typename Element_, bool IsBf16, int HeadDim, int BlockM, int BlockN, int Stages,
          bool Causal>
struct HopperFwdTraits {
  using Element = Element_;
  using Ops = TensorOps<Element>;
  static constexpr bool kBf16 = IsBf16;
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kStages = Stages;
  static constexpr bool kCausal = Causal;
  // No attention features (the mma.sync forward serves them); softmax.cuh's masks read it.
  static constexpr bool kLocal = false;
  static constexpr int kWarpGroups = BlockM / 64;
  static constexpr int kThreads = 128 * kWarpGroups;
  static constexpr int kMTiles = 1;                 // 16 rows per warp
  static constexpr int kSTiles = BlockN / 8;        // n8 column blocks of S
  static constexpr int kPvSteps = BlockN / 16;      // k16 steps of P V
  static constexpr int kOTiles = HeadDim / 8;       // n8 column blocks of O
  static constexpr int kQkSteps = HeadDim / 16;     // k16 steps of Q K^T
  static constexpr int kPanels = HeadDim / 64;      // 128-byte panels of a row
  static constexpr int kChunks = HeadDim / 8;       // 16-byte chunks of a row
  // Byte offsets from the 1024-byte-aligned base of the tiles.
  static constexpr int kTileBytes = BlockN * HeadDim * 2;
  static constexpr int kQBytes = BlockM * HeadDim * 2;
  static constexpr int kKOffset = kQBytes;
  static constexpr int kVOffset = kKOffset + Stages * kTileBytes;
  static constexpr int kBarOffset = kVOffset + Stages * kTileBytes;
  // Tiles, the 2 x kStages barriers, and up to 1023 bytes to align the base.
  static constexpr int kSmemBytes = kBarOffset + 16 * Stages + 1024;

  static_assert(HeadDim % 64 == 0 && HeadDim <= 256, "head dim: 64, 128 or 256");
  static_assert(BlockM == 64 || BlockM == 128, "block_m: 64 or 128 (warpgroups of 64 rows)");
  static_assert(BlockN == 64 || BlockN == 128 || BlockN == 256, "block_n: 64, 128 or 256");
  static_assert(Stages >= 1 && Stages <= 4, "stages: 1..4");

  // Byte offset of 16-byte chunk c of row r in a swizzled tile of `rows` rows.
  static __device__ __forceinline__ int chunk_offset(int rows, int r, int c) {
    return (c / 8) * rows * 128 + r * 128 + (((c % 8) ^ (r % 8)) * 16);
  }
};

// Copies rows [0, rows) of a tile of kRows rows from global memory into the swizzled layout
// with cp.async; rows at and past `valid` are zero-filled.
template <class Tr, int kRows>
__device__ __forceinline__ void load_tile(unsigned char* dst, const typename Tr::Element* src,
                                          long long row_stride, int valid, int tid) {
  for (int idx = tid; idx < kRows * Tr::kChunks; idx += Tr::kThreads) {
    const int r = idx / Tr::kChunks;
    const int c = idx % Tr::kChunks;
    const bool in = r < valid;
    // An out-of-range row reads nothing (size 0); its address stays inside the tensor.
    const typename Tr::Element* from = src + (in ? r * row_stride : 0) + c * 8;
    cp_async<16>(dst + Tr::chunk_offset(kRows, r, c), from, in ? 16 : 0);
  }
}

// O = 0 and LSE = +inf for rows [row0, min(row0 + kBlockM, seqlen_q)): rows that see no key.
template <class Tr>
__device__ __forceinline__ void store_unseen_rows(typename Tr::Element* o, long long row_stride,
                                                  float* lse, int row0, int seqlen_q, int tid) {
  for (int idx = tid; idx < Tr::kBlockM * Tr::kChunks; idx += Tr::kThreads) {
    const int r = row0 + idx / Tr::kChunks;
    if (r < seqlen_q) {
      uint4 zero;
      zero.x = zero.y = zero.z = zero.w = 0u;
      *reinterpret_cast<uint4*>(o + r * row_stride + (idx % Tr::kChunks) * 8) = zero;
    }
  }
  for (int r = row0 + tid; r < row0 + Tr::kBlockM; r += Tr::kThreads) {
    if (r < seqlen_q) lse[r] = INFINITY;
  }
}

// Whether a step is the block's first tile (no rescale of the all-zero O), as a type.
template <bool kFirst>
struct FirstTile {
  static constexpr bool value = kFirst;
};

// The block of query rows blockIdx.x * kBlockM.. of head blockIdx.y, batch blockIdx.z.
template <class Tr>
__device__ __forceinline__ void hopper_fwd(const FwdParams<typename Tr::Element>& a) {
  using Element = typename Tr::Element;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;
  FT_DYNAMIC_SMEM(unsigned char, raw);
  // 128B swizzle patterns repeat every 1024 bytes of the shared window: align the base.
  const unsigned window = smem_address(raw);
  const unsigned pad = (1024u - (window & 1023u)) & 1023u;
  unsigned char* const smem = raw + pad;
  const unsigned base = window + pad;
  auto* const full = reinterpret_cast<unsigned long long*>(smem + Tr::kBarOffset);
  auto* const empty = full + kStages;

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = lane_id();
  const int warp = warp_id();
  const int group = warp / 4;  // the warpgroup: query rows 64 group ..
  const int m_block = static_cast<int>(blockIdx.x);
  const int head = static_cast<int>(blockIdx.y);
  const int batch = static_cast<int>(blockIdx.z);
  const int seqlen_q = a.seqlen_q;
  const int seqlen_k = a.seqlen_k;
  const int kv_head = head / (a.heads_q / a.heads_kv);
  const Element* q_bh = a.q + batch * a.q_batch_stride + head * a.q_head_stride;
  const Element* k_bh = a.k + batch * a.k_batch_stride + kv_head * a.k_head_stride;
  const Element* v_bh = a.v + batch * a.v_batch_stride + kv_head * a.v_head_stride;
  Element* o_bh = a.o + batch * a.o_batch_stride + head * a.o_head_stride;
  float* lse_bh = a.lse + (static_cast<long long>(batch) * a.heads_q + head) * seqlen_q;

  // Keys [0, n_end) are visible to some row of the block, [0, n_full) to all of them.
  const int m0 = m_block * kBlockM;
  const int m_end = seqlen_q < m0 + kBlockM ? seqlen_q : m0 + kBlockM;
  int n_end = seqlen_k;
  int n_full = seqlen_k;
  if constexpr (Tr::kCausal) {
    const int last_row_end = m_end + seqlen_k - seqlen_q;
    const int first_row_end = m0 + 1 + seqlen_k - seqlen_q;
    n_end = last_row_end < n_end ? last_row_end : n_end;
    n_full = first_row_end < n_full ? first_row_end : n_full;
  }
  if (n_end <= 0) {
    store_unseen_rows<Tr>(o_bh, a.o_row_stride, lse_bh, m0, seqlen_q, tid);
    return;
  }
  const int n_tiles = (n_end + kBlockN - 1) / kBlockN;
  const int first_masked_tile = n_full <= 0 ? 0 : n_full / kBlockN;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], Tr::kThreads);
      mbarrier_init(&empty[s], Tr::kThreads);
    }
    mbarrier_init_fence();
  }
  block_sync();

  // Load j of the ring is key tile n_tiles - 1 - j into stage j % kStages.
  auto load = [&](int j) {
    const int tile = n_tiles - 1 - j;
    const int s = j % kStages;
    const long long row0 = static_cast<long long>(tile) * kBlockN;
    const int valid = seqlen_k - tile * kBlockN;
    load_tile<Tr, kBlockN>(smem + Tr::kKOffset + s * Tr::kTileBytes, k_bh + row0 * a.k_row_stride,
                           a.k_row_stride, valid, tid);
    load_tile<Tr, kBlockN>(smem + Tr::kVOffset + s * Tr::kTileBytes, v_bh + row0 * a.v_row_stride,
                           a.v_row_stride, valid, tid);
    cp_async_mbarrier_arrive(&full[s]);
  };
  load_tile<Tr, kBlockM>(smem, q_bh + m0 * a.q_row_stride, a.q_row_stride, seqlen_q - m0, tid);
  for (int j = 0; j < kStages && j < n_tiles; ++j) load(j);

  float acc_o[1][Tr::kOTiles][4];
#pragma unroll
  for (int dt = 0; dt < Tr::kOTiles; ++dt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc_o[0][dt][i] = 0.0f;
  }
  OnlineSoftmax<Tr> softmax;
  RowLimits<Tr> limits;
  limits.init(m0 + 16 * warp, seqlen_q, seqlen_k, lane);
  const float scale_log2 = a.softmax_scale * 1.44269504088896340736f;
  // wgmma views of the fragments: d[4 nt + e] is fragment element [nt][e].
  auto& o_view = reinterpret_cast<float(&)[Tr::kHeadDim / 2]>(acc_o);
  // Q of this warpgroup: k-step ks is 32 bytes into panel ks / 4.
  const unsigned q_addr = base + group * 64 * 128;

  auto step = [&](int j, auto first, auto mask) {
    const int s = j % kStages;
    const unsigned k_addr = base + Tr::kKOffset + s * Tr::kTileBytes;
    const unsigned v_addr = base + Tr::kVOffset + s * Tr::kTileBytes;
    mbarrier_wait_parity(&full[s], static_cast<unsigned>(j / kStages) & 1u);
    fence_proxy_async();  // the cp.async writes (generic proxy) before wgmma's reads

    float acc_s[1][Tr::kSTiles][4];
    auto& s_view = reinterpret_cast<float(&)[kBlockN / 2]>(acc_s);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < Tr::kQkSteps; ++ks) {
      const unsigned off = (ks % 4) * 32;
      wgmma_ss<kBlockN, Tr::kBf16, false, false>(
          s_view, wgmma_desc(q_addr + (ks / 4) * kBlockM * 128 + off, 16, 1024, kSwizzle128B),
          wgmma_desc(k_addr + (ks / 4) * kBlockN * 128 + off, 16, 1024, kSwizzle128B), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(s_view);

    unsigned p[1][Tr::kPvSteps][4];
    softmax.template update<decltype(first)::value>(acc_s, p, acc_o, scale_log2, mask);

    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Tr::kPvSteps; ++kk) {
      wgmma_rs<Tr::kHeadDim, Tr::kBf16, true>(
          o_view, p[0][kk], wgmma_desc(v_addr + kk * 16 * 128, kBlockN * 128, 1024, kSwizzle128B),
          1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(o_view);
    mbarrier_arrive(&empty[s]);  // this thread's warpgroup has read the stage
    if (j + kStages < n_tiles) {
      mbarrier_wait_parity(&empty[s], static_cast<unsigned>(j / kStages) & 1u);
      load(j + kStages);
    }
  };

  step(0, FirstTile<true>{}, TileMask<Tr, true, Tr::kCausal>(limits, (n_tiles - 1) * kBlockN));
  int j = 1;
  if constexpr (Tr::kCausal) {
    for (; j < n_tiles && n_tiles - 1 - j >= first_masked_tile; ++j)
      step(j, FirstTile<false>{}, TileMask<Tr, false, true>(limits, (n_tiles - 1 - j) * kBlockN));
  }
  for (; j < n_tiles; ++j) step(j, FirstTile<false>{}, NoMask{});

  // Epilogue: O / row sum and the natural-log LSE, straight from the accumulators.
  float inv_sum[1][2];
  float row_lse[1][2];
  softmax.finalize(inv_sum, row_lse);
  const int g = lane / 4;
  const int t = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = m0 + 16 * warp + g + 8 * h;
    if (row < seqlen_q) {
      Element* o_row = o_bh + row * a.o_row_stride + 2 * t;
#pragma unroll
      for (int dt = 0; dt < Tr::kOTiles; ++dt) {
        *reinterpret_cast<unsigned*>(o_row + 8 * dt) =
            Tr::Ops::pack(acc_o[0][dt][2 * h] * inv_sum[0][h],
                          acc_o[0][dt][2 * h + 1] * inv_sum[0][h]);
      }
      if (t == 0) lse_bh[row] = row_lse[0][h];
    }
  }
}

}  // namespace ft
