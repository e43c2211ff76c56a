// FlashAttention forward pass for sm_90a, warp-specialised (FlashAttention-3's structure, the
// Hopper notes sections 1.1, 1.2 and 2.5): a producer warpgroup (warps 0..3) and one consumer
// warpgroup per 64 query rows (kBlockM = 64, 128 or 192) of one (batch, head).
//
// Producer (ws_produce): after setmaxnreg.dec it loads Q (kBlockM rows x D, all 128-byte
// panels) on the q_full mbarrier, then walks the key tiles from the last one down, each into
// stage j % kStages of a ring of K and V tiles, waiting until the stage's empty mbarrier
// completed the phase of the previous round (the first round does not wait). Each operand
// comes by TMA or by cp.async (WsLoads, per operand). A TMA operand is one box issued by
// lane 0 of warp 0, which first declares the stage's TMA bytes with arrive.expect_tx; a
// cp.async operand is copied by all 128 producer threads into the same swizzled layout
// (rows past the sequence zero-filled), each arriving with cp.async.mbarrier.arrive.noinc
// once its copies have landed. Every loading thread waits before it exits until the
// consumers released every stage of the last round (FA3's producer tail: no copy, box or
// deferred arrival is left in flight by an exited thread). So a full barrier counts one
// arrival if some operand of the stage comes by TMA and 128 more if some comes by cp.async.
// With TMA alone warps 1..3 return at once and the producer keeps FA3's registers; with
// cp.async it keeps 40 beside two or three consumers (WsRegisters), and the consumers fence
// the proxies after each wait (cp.async writes are generic-proxy ones, wgmma reads
// async-proxy).
// Consumers: after setmaxnreg.inc, each warpgroup waits for Q, then per key tile waits on the
// stage's full barrier, computes S = Q K^T, the online softmax and O += P V by wgmma
// (tile_math of hopper_fwd.cuh, the same math as the cp.async kernel) and releases the stage:
// lane 0 of each consumer warp arrives on the empty barrier (count: 4 per consumer
// warpgroup) once its warp's wgmma reads are complete. The epilogue writes O and the LSE
// from the accumulators.
//
// The tensor maps (built on the host, runtime/families: hopper) view Q (batch, seqlen_q,
// heads_q, D), K and V (batch, seqlen_k, heads_kv, D) as rank-5 tensors (64 elements,
// rows, D / 64 panels, heads, batch) with 128B swizzle, so one box (64, rows, D / 64, 1, 1)
// lands as the panels of 128-byte rows the wgmma descriptors read; rows past the end of the
// sequence are zero-filled and their bytes count as transactions (the full box).
//
// Ping-pong (Tr::kPingPong, two consumer warpgroups): the consumers take turns to issue
// their GEMMs, so one warpgroup's softmax runs while the other's GEMMs do (FA3 section 3.1):
// a turn is Q K^T alone, or with overlap Q K^T of tile j and P V of tile j - 1.
// Warpgroup g waits on named barrier 1 + g (256 threads: its own 128 syncing, the other's 128
// arriving) before it issues Q K^T and arrives on the other's right after; warpgroup 1 gives
// warpgroup 0 the first turn.
//
// Overlap (Tr::kOverlap, FA3 section 3.2, two or more stages), FA3's order with one S set
// plus P: per key tile j a consumer warpgroup issues S_j = Q K_j^T and then O += P_{j-1}
// V_{j-1}, waits for S_j alone (wait_group<1>), runs the softmax of S_j (maxima, sums and the
// probabilities, as floats in S's registers) while P V runs, then waits for P V
// (wait_group<0>), releases tile j - 1's stage, rescales O and packs P_j. The first tile has
// no P V before it; the last tile's P V follows the loop. A second stage is needed: tile j's
// K lands while tile j - 1's V is still read.
//
// Features (Tr::kLocal, kSoftcap, kAlibi, kVarlen, kSinks; hopper_fwd.cuh): the producer walks
// the block's key range from its top tile down to its lowest (tiles below every row's
// window are never loaded), the consumers transform each complete S (softcap, ALiBi) before
// its softmax and mask only the tiles crossing the diagonal or a window edge; with varlen the
// tensor maps' row coordinate starts at the sequence's first packed row (batch coordinate 0).
//
// FT_WS_PLANTED_BUG (tests only; 0 in every rendered kernel) plants one bug for the
// emulator's tests: 1 no expect-tx on the K/V stage (a plain arrive), 2 consumers release a
// stage twice, 3 consumers never release a stage, 4 the consumers' setmaxnreg count not a
// multiple of 8, 5 one consumer warp skips setmaxnreg, 6 (ping-pong) no first turn, 7
// (ping-pong) a hand-over that counts only the handing warpgroup's threads, 8 (three
// consumers) the third consumer warpgroup skips setmaxnreg, 9 (three consumers) the split of
// two consumers (24 / 240), 10 (overlap) no wait for S_j before its first read (after the first tile),
// 11 (overlap) wait_group<1> where <0> is needed (O += P V still in flight), 12 (K or V by
// cp.async) producer warp 0 never arrives on a stage's full barrier, 13 (some operand by
// cp.async) the producer exits with copies in flight (no producer tail).
#pragma once

#include "hopper_fwd.cuh"
#include "tma.cuh"
#include "warpgroup.cuh"

#ifndef FT_WS_PLANTED_BUG
#define FT_WS_PLANTED_BUG 0
#endif

namespace ft {

// How the producer loads each operand: by TMA (one lane issues a box) or by cp.async (the
// whole producer warpgroup copies 16-byte chunks into the same swizzled layout).
template <bool QTma, bool KTma, bool VTma>
struct WsLoads {
  static constexpr bool kQTma = QTma;
  static constexpr bool kKTma = KTma;
  static constexpr bool kVTma = VTma;
  // Whether the producer's threads all load (some operand by cp.async) or one lane does.
  static constexpr bool kWholeWarpgroup = !(QTma && KTma && VTma);
  // A K/V stage's full barrier: one arrival with the TMA boxes' bytes expected, and one per
  // producer thread whose cp.async copies of the stage have landed.
  static constexpr bool kKvByTma = KTma || VTma;
  static constexpr bool kKvByCpAsync = !KTma || !VTma;
  static constexpr int kFullArrivals = (kKvByTma ? 1 : 0) + (kKvByCpAsync ? 128 : 0);
  static constexpr int kQArrivals = QTma ? 1 : 128;
};

// setmaxnreg split (FA3's table): producer / consumer registers per thread for 1, 2 or 3
// consumer warpgroups. A producer that issues TMA from one lane keeps 56, 24 or 32; one whose
// 128 threads run cp.async address arithmetic keeps 40 beside two or three consumers (FA3's
// 40 / 232 for K/V without TMA; 32 spills). The consumers share the rest of the 64 Ki
// registers, in multiples of 8, at most 256. The family's space rules read the same table
// (families/hopper/space.py WS_REGISTERS, which the kernel's bindings assert).
template <int kWarpGroups, bool kCpAsyncProducer = false>
struct WsRegisters {
  static_assert(kWarpGroups >= 1 && kWarpGroups <= 3, "one to three consumer warpgroups");
  static constexpr int kProducer = kWarpGroups == 1 ? 56
                                   : kCpAsyncProducer ? 40
                                   : kWarpGroups == 2 ? 24
                                                      : 32;
  static constexpr int kShare = (65536 / 128 - kProducer) / kWarpGroups / 8 * 8;
  static constexpr int kConsumer = kShare < 256 ? kShare : 256;
  static_assert(128 * (kProducer + kWarpGroups * kConsumer) <= 65536, "register file: 64 Ki");
};

// The ping-pong turn of consumer warpgroup `group` (0 or 1) of two.
struct PingPongSchedule {
  unsigned mine, other;
  __device__ __forceinline__ explicit PingPongSchedule(int group)
      : mine(1u + static_cast<unsigned>(group)), other(2u - static_cast<unsigned>(group)) {}
  __device__ __forceinline__ void before_qk() const { named_barrier_sync(mine, 256); }
  __device__ __forceinline__ void after_qk() const {
    named_barrier_arrive(other, FT_WS_PLANTED_BUG == 7 ? 128 : 256);
  }
};

// The producer warpgroup's loads (FT_WS_PLANTED_BUG 1 aside): Q on q_full, then key tile
// n_tiles - 1 - j into stage j % kStages once the stage's previous round is released. TMA
// operands are issued by thread 0, which declares their bytes on the barrier first; cp.async
// operands are copied by all 128 producer threads (pt), each of which arrives once its own
// copies have landed (cp.async.mbarrier.arrive.noinc, counted in the barrier's init).
template <class Tr, class L>
__device__ __forceinline__ void ws_produce(const HopperBlock<Tr>& b,
                                           const FwdParams<typename Tr::Element>& a,
                                           unsigned long long* q_full, int pt,
                                           const CUtensorMap* tmap_q, const CUtensorMap* tmap_k,
                                           const CUtensorMap* tmap_v) {
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;
  constexpr int kTmaBytes = (L::kKTma ? Tr::kTileBytes : 0) + (L::kVTma ? Tr::kVTileBytes : 0);
  const bool leader = pt == 0;
  if (leader) {
    if constexpr (L::kQTma) prefetch_tensormap(tmap_q);
    if constexpr (L::kKTma) prefetch_tensormap(tmap_k);
    if constexpr (L::kVTma) prefetch_tensormap(tmap_v);
  }
  if constexpr (L::kQTma) {
    if (leader) {
      mbarrier_arrive_expect_tx(q_full, Tr::kQBytes);
      tma_load_5d(b.smem, tmap_q, q_full, 0, b.q_start + b.m0, 0, b.head, b.tma_batch);
    }
  } else {
    load_tile<Tr, Tr::kBlockM, 128>(b.smem, b.q_bh + b.m0 * a.q_row_stride, a.q_row_stride,
                                    b.seqlen_q - b.m0, pt);
    cp_async_mbarrier_arrive(q_full);
  }
  if (!L::kKvByCpAsync && !leader) {
    // Q's copies (and their deferred arrival) are complete before the thread exits.
    if constexpr (!L::kQTma) {
      if (FT_WS_PLANTED_BUG != 13) mbarrier_wait_parity(q_full, 0);
    }
    return;
  }
  const int n_tiles = b.range.n_tiles;
  const int count = b.range.count;  // tiles below the window of every row: never loaded
  for (int j = 0; j < count; ++j) {
    const int s = j % kStages;
    const int tile = n_tiles - 1 - j;
    const int row0 = tile * kBlockN;
    if (j >= kStages)
      mbarrier_wait_parity(&b.empty[s], static_cast<unsigned>(j / kStages - 1) & 1u);
    unsigned char* const k_dst = b.smem + Tr::kKOffset + s * Tr::kTileBytes;
    unsigned char* const v_dst = b.smem + Tr::kVOffset + s * Tr::kVTileBytes;
    if (L::kKvByTma && leader) {
      if (FT_WS_PLANTED_BUG == 1) mbarrier_arrive(&b.full[s]);
      else mbarrier_arrive_expect_tx(&b.full[s], kTmaBytes);
      if constexpr (L::kKTma)
        tma_load_5d(k_dst, tmap_k, &b.full[s], 0, b.k_start + row0, 0, b.kv_head, b.tma_batch);
      if constexpr (L::kVTma)
        tma_load_5d(v_dst, tmap_v, &b.full[s], 0, b.k_start + row0, 0, b.kv_head, b.tma_batch);
    }
    if constexpr (L::kKvByCpAsync) {
      const long long first = static_cast<long long>(row0);
      const int valid = b.seqlen_k - row0;
      if constexpr (!L::kKTma)
        load_tile<Tr, kBlockN, 128>(k_dst, b.k_bh + first * a.k_row_stride, a.k_row_stride,
                                    valid, pt);
      if constexpr (!L::kVTma)
        load_tile<HopperVRows<Tr>, kBlockN, 128>(v_dst, b.v_bh + first * a.v_row_stride, a.v_row_stride,
                                    valid, pt);
      if (FT_WS_PLANTED_BUG != 12 || pt >= 32) cp_async_mbarrier_arrive(&b.full[s]);
    }
  }
  // The producer tail (FA3's): no producer thread exits with a load in flight. A thread whose
  // cp.async copies are tracked by a barrier must not exit before they land and its deferred
  // arrival is made; Q's land when q_full's phase completes, and the consumers release a
  // stage only after waiting on its full barrier, so once every stage of the last round is
  // released no K/V copy or TMA box is in flight. (TMA boxes complete without their issuing
  // thread, but the lane that issued them waits too, as FA3's does.)
  if constexpr (!L::kQTma) {
    if (FT_WS_PLANTED_BUG != 13) mbarrier_wait_parity(q_full, 0);
  }
  if (FT_WS_PLANTED_BUG != 13) {
    for (int j = count > kStages ? count - kStages : 0; j < count; ++j)
      mbarrier_wait_parity(&b.empty[j % kStages], static_cast<unsigned>(j / kStages) & 1u);
  }
}

template <class Tr, class L = WsLoads<true, true, true>>
__device__ __forceinline__ void hopper_fwd_ws(const FwdParams<typename Tr::Element>& a,
                                              const CUtensorMap* tmap_q,
                                              const CUtensorMap* tmap_k,
                                              const CUtensorMap* tmap_v,
                                              const typename Tr::Mods& mods = {}) {
  using Regs = WsRegisters<FT_WS_PLANTED_BUG == 9 ? 2 : Tr::kWarpGroups, L::kWholeWarpgroup>;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kStages = Tr::kStages;
  static_assert(Tr::kWarpSpecialized, "traits of the warp-specialised kernel");
  FT_DYNAMIC_SMEM(unsigned char, raw);
  const HopperBlock<Tr> b(raw, a, mods);
  if (b.unseen(a)) return;
  const int n_tiles = b.range.n_tiles;
  const int count = b.range.count;
  auto* const q_full = b.empty + kStages;

  if (b.tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&b.full[s], L::kFullArrivals);
      mbarrier_init(&b.empty[s], 4 * Tr::kWarpGroups);
    }
    mbarrier_init(q_full, L::kQArrivals);
    mbarrier_init_fence();
  }
  block_sync();

  if (b.warp < 4) {  // the producer warpgroup
    setmaxnreg_dec<Regs::kProducer>();
    // With TMA alone one lane issues every load and warps 1..3 are done.
    if (L::kWholeWarpgroup || b.tid == 0)
      ws_produce<Tr, L>(b, a, q_full, b.tid, tmap_q, tmap_k, tmap_v);
    return;
  }

  // A consumer warpgroup: warp cw of the consumers owns query rows m0 + 16 cw ..
  if constexpr (FT_WS_PLANTED_BUG == 4) setmaxnreg_inc<Regs::kConsumer - 4>();
  else if ((FT_WS_PLANTED_BUG != 5 || b.warp != 5) && (FT_WS_PLANTED_BUG != 8 || b.warp < 12))
    setmaxnreg_inc<Regs::kConsumer>();
  const int cw = b.warp - 4;
  WarpgroupMath<Tr> math(b, a, cw / 4, b.m0 + 16 * cw, mods);
  static_assert(!Tr::kPingPong || Tr::kWarpGroups == 2, "ping-pong: two consumer warpgroups");
  const auto schedule = [&] {
    if constexpr (Tr::kPingPong) return PingPongSchedule(cw / 4);
    else return FreeSchedule{};
  }();
  if constexpr (Tr::kPingPong && FT_WS_PLANTED_BUG != 6) {
    if (cw >= 4) named_barrier_arrive(1, 256);  // warpgroup 0 has the first turn
  }
  mbarrier_wait_parity(q_full, 0);
  // cp.async writes are generic-proxy ones: ordered before wgmma's (async-proxy) reads.
  if constexpr (!L::kQTma) fence_proxy_async();
  // Key tile j's stage has landed.
  auto wait_full = [&](int j) {
    mbarrier_wait_parity(&b.full[j % kStages], static_cast<unsigned>(j / kStages) & 1u);
    if constexpr (L::kKvByCpAsync) fence_proxy_async();
  };
  // The warp's wgmma reads of key tile j's stage are complete: lane 0 releases it.
  auto release = [&](int j) {
    __syncwarp();
    if (b.lane == 0 && !(FT_WS_PLANTED_BUG == 3 && j == 0)) {
      mbarrier_arrive(&b.empty[j % kStages]);
      if (FT_WS_PLANTED_BUG == 2) mbarrier_arrive(&b.empty[j % kStages]);
    }
  };
  if constexpr (!Tr::kOverlap) {
    for_each_key_tile<Tr>(b.range, math.limits, [&](int j, auto first, auto mask) {
      wait_full(j);
      math.template tile<decltype(first)::value>(b, j % kStages, (n_tiles - 1 - j) * kBlockN,
                                                 mask, schedule);
      release(j);  // tile_math waited for its GEMMs
    });
  } else {
    // FA3's intra-warpgroup order with one S set and P: tile j's Q K^T is issued, then
    // O += P_{j-1} V_{j-1}; the softmax of S_j runs while P V does; once P V completes the
    // stage of tile j - 1 is released, O rescaled and P_j packed from S_j. A ping-pong turn
    // spans both issues. The last tile's P V follows the loop.
    using Softmax = OnlineSoftmax<Tr>;
    float acc_s[1][Tr::kSTiles][4];
    unsigned p[1][Tr::kPvSteps][4];
    auto& s_view = reinterpret_cast<float(&)[kBlockN / 2]>(acc_s);
    auto& o_view = reinterpret_cast<float(&)[Tr::kHeadDimV / 2]>(math.acc_o);
    // P is read by an issued wgmma until its group completes: tied after the wait, so its
    // registers are not reused before.
    auto& p_view = reinterpret_cast<float(&)[Tr::kPvSteps * 4]>(p);
    for_each_key_tile<Tr>(b.range, math.limits, [&](int j, auto first, auto mask) {
      constexpr bool kFirst = decltype(first)::value;
      wait_full(j);
      schedule.before_qk();
      math.qk(b, j % kStages, acc_s, FreeSchedule{});
      if constexpr (!kFirst) math.pv(b, (j - 1) % kStages, p);
      schedule.after_qk();
      // S_j (the older group) is complete; O += P_{j-1} V_{j-1} may still run.
      if constexpr (FT_WS_PLANTED_BUG != 10 || kFirst) wgmma_wait<kFirst ? 0 : 1>();
      wgmma_fence_operands(s_view);
      math.transform_scores(acc_s, (n_tiles - 1 - j) * kBlockN);
      const auto rescale = math.softmax.template exponentiate<kFirst>(acc_s, math.scale_log2,
                                                                      mask);
      if constexpr (!kFirst) {
        // O += P_{j-1} V_{j-1} complete: its stage is released, O rescaled and P rewritten.
        wgmma_wait<FT_WS_PLANTED_BUG == 11 ? 1 : 0>();
        wgmma_fence_operands(o_view);
        wgmma_fence_operands(p_view);
        release(j - 1);
        Softmax::rescale(math.acc_o, rescale);
      }
      Softmax::pack(acc_s, p);
      math.drop(p, (n_tiles - 1 - j) * kBlockN);
    });
    schedule.before_qk();
    math.pv(b, (count - 1) % kStages, p);
    schedule.after_qk();
    wgmma_wait<0>();
    wgmma_fence_operands(o_view);
    release(count - 1);
  }
  math.store(b, a.o_row_stride);
}

}  // namespace ft
