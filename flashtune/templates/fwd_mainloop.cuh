// The main loop of the forward kernel: the per-thread state of one block and its steps, one
// step per K/V tile. Steps are named by their key tile, counted down from the last one to 0
// (the first step walks the last tile).
//
// Per step, without pipelining: wait for the tile's K and V, Q K^T, the online softmax
// (with the step's mask), P V. With pipelining (Tr::kPipelined), a step runs Q K^T of the
// next tile first and the softmax and P V of this one on the scores the previous step (or
// the prologue) computed, so the tensor cores have work while the softmax runs.
//
// Copies (cp.async, see Tr::kPipelineWait for the commit groups):
//   one stage: V of this tile while Q K^T and the softmax run; K of the next tile while
//     P V runs (Tr::kLateKLoad: after it); a block barrier before each;
//   two or more, plain: the tile kNumStages - 1 ahead, at the top of the step, after the
//     one barrier (it goes into the buffers of the previous step);
//   pipelined: V of the tile kNumStages - 1 ahead and K of the tile kNumStages ahead (K
//     runs one tile ahead of V, since a step reads K of the next tile).
#pragma once

#include "dropout.cuh"
#include "fwd_traits.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"
#include "warp_gemm.cuh"

namespace ft {

// The FP8 forward's copy traits of Q and K and its V stream (fwd_fp8.cuh, included by the
// kernels that use them).
template <class Tr>
struct Fp8RowsView;
template <class Tr>
struct Fp8VStream;

// The copy traits of Q's and K's rows, and the stream of V tiles, of traits Tr.
template <class Tr>
using InRows = typename detail::Select<Tr::kFp8, Fp8RowsView<Tr>, Tr>::type;
template <class Tr>
using VStream =
    typename detail::Select<Tr::kFp8, Fp8VStream<Tr>, TileStream<VRows<Tr>>>::type;

// Whether a pipelined step computes Q K^T of a next tile: always, never (the last tile) or
// when there is one (steps that may or may not be the last).
enum class Next { kAlways, kNever, kIfAny };

template <class Tr>
struct FwdMainloop {
  using Element = typename Tr::Element;
  using In = typename Tr::In;
  static constexpr int kStages = Tr::kNumStages;

  In* sk;                      // K stage buffers
  Element* sv;                 // V stage buffers
  QOperand<Tr> q;              // the A operand of Q K^T (shared memory or registers)
  LaneOffsets<Tr> lanes;
  TileStream<InRows<Tr>> k_in;
  VStream<Tr> v_in;
  int tid;
  int stage;                   // element offset of the stage buffers of the previous step
  float scale_log2;
  RowLimits<Tr> limits;        // the keys the lane's rows may see
  OnlineSoftmax<Tr> softmax;
  float acc_o[Tr::kMTiles][Tr::kOTiles][4];
  float s_next[Tr::kMTiles][Tr::kSTiles][4];  // pipelined: scores of the next step's tile
  ScoreTransform<Tr> transform;  // softcap, ALiBi (Tr::kTransformed)
  int low_tile;  // local, a block mask's tile ranges: the lowest key tile walked (0 otherwise)
  typename detail::Select<Tr::kDropout, FwdDropout<Tr>, NoFwdDropout>::type dropout;

  // The lowest key tile walked: no copy or Q K^T goes below it.
  __device__ __forceinline__ int low() const {
    if constexpr (Tr::kLocal || Tr::Mods::kTileRanges) {
      return low_tile;
    } else {
      return 0;
    }
  }

  // Stage buffer offsets rotate through 0, kKvElems, ..., (kStages - 1) * kKvElems.
  static __device__ __forceinline__ int next_stage(int off) {
    if constexpr (kStages == 1) {
      return 0;
    } else if constexpr (kStages == 2) {
      return Tr::kKvElems - off;
    } else {
      return off == (kStages - 1) * Tr::kKvElems ? 0 : off + Tr::kKvElems;
    }
  }

  // The V stage buffer of the K stage buffer at element offset k_off (the same offset
  // unless V's rows differ from K's: WithHeadDimV).
  static __device__ __forceinline__ int v_stage(int k_off) {
    if constexpr (Tr::kVElems == Tr::kKvElems) {
      return k_off;
    } else {
      return k_off / Tr::kKvElems * Tr::kVElems;
    }
  }

  // Copies before the loop: Q and the first tile walked (bounds-checked: first_rows of its
  // rows exist), then the next (whole) tiles up to the pipeline depth; first_tile is the
  // first tile's index. Pipelined, it also computes the first tile's scores.
  __device__ __forceinline__ void prologue(In* sq, const In* q_bh,
                                           long long q_row_stride, int m0, int seqlen_q,
                                           int first_tile, int first_rows) {
    load_rows_checked<InRows<Tr>, Tr::kBlockM>(sq, q_bh, q_row_stride, m0, seqlen_q, tid);
    k_in.template load<true>(sk, first_rows, tid);
    if constexpr (Tr::kPipelined) {
      // K_0 (with Q), V_0, K_1, V_1, ..., V_{S-2}, K_{S-1}: one group each.
      cp_async_commit();
      v_in.template load<true>(sv, first_rows, tid);
      cp_async_commit();
#pragma unroll
      for (int t = 1; t < kStages; ++t) {
        if (first_tile - t >= low()) {
          k_in.template load<false>(sk + t * Tr::kKvElems, Tr::kBlockN, tid);
        }
        cp_async_commit();
        if (t + 1 < kStages) {
          if (first_tile - t >= low()) {
            v_in.template load<false>(sv + t * Tr::kVElems, Tr::kBlockN, tid);
          }
          cp_async_commit();
        }
      }
      cp_async_wait<2 * kStages - 2>();  // K_0 and Q landed (2 S - 2 groups after them)
      block_sync();
      q.prepare(lanes);
      gemm_qk<Tr>(s_next, q, sk, lanes);
    } else if constexpr (Tr::kOneBarrier) {
      v_in.template load<true>(sv, first_rows, tid);
      cp_async_commit();
#pragma unroll
      for (int t = 1; t + 1 < kStages; ++t) {
        if (first_tile - t >= low()) {
          k_in.template load<false>(sk + t * Tr::kKvElems, Tr::kBlockN, tid);
          v_in.template load<false>(sv + t * Tr::kVElems, Tr::kBlockN, tid);
        }
        cp_async_commit();
      }
    } else {
      cp_async_commit();
    }
    stage = (kStages - 1) * Tr::kKvElems;
  }

  // The step of key tile `tile`. kFirst: the first step, whose tile alone can be partial
  // (first_rows of its rows exist); kMasked: the tile may hold keys some row may not see.
  template <bool kFirst, bool kMasked, Next kNext = Next::kIfAny>
  __device__ __forceinline__ void step(int tile, int first_rows = Tr::kBlockN) {
    const int prev = stage;
    const int cur = next_stage(prev);
    stage = cur;
    float s[Tr::kMTiles][Tr::kSTiles][4];
    if constexpr (Tr::kPipelined) {
      // K of the next tile (and V of this one) landed for every thread; every warp is done
      // with the previous step: its V buffer and this tile's K buffer are free.
      cp_async_wait<Tr::kPipelineWait>();
      block_sync();
      if (tile - low() >= kStages - 1) {
        v_in.template load<false>(sv + v_stage(prev), Tr::kBlockN, tid);
      }
      cp_async_commit();
      if (tile - low() >= kStages) k_in.template load<false>(sk + cur, Tr::kBlockN, tid);
      cp_async_commit();
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < Tr::kSTiles; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) s[mt][nt][i] = s_next[mt][nt][i];
        }
      }
      if constexpr (kNext == Next::kAlways) {
        gemm_qk<Tr>(s_next, q, sk + next_stage(cur), lanes);
      } else if constexpr (kNext == Next::kIfAny) {
        if (tile - low() >= 1) gemm_qk<Tr>(s_next, q, sk + next_stage(cur), lanes);
      }
    } else {
      if constexpr (Tr::kOneBarrier) {
        // This tile has landed for every thread, and every warp is done with the previous
        // step, whose buffers take the tile kStages - 1 steps ahead.
        cp_async_wait<Tr::kPipelineWait>();
        block_sync();
        if (tile - low() >= kStages - 1) {
          k_in.template load<false>(sk + prev, Tr::kBlockN, tid);
          v_in.template load<false>(sv + v_stage(prev), Tr::kBlockN, tid);
        }
        cp_async_commit();
      } else {
        cp_async_wait<0>();
        block_sync();  // K landed; every warp is done reading the previous V
        v_in.template load<kFirst>(sv, first_rows, tid);
        cp_async_commit();
      }
      if constexpr (kFirst) q.prepare(lanes);
      gemm_qk<Tr>(s, q, sk + cur, lanes);
    }
    if constexpr (Tr::kTransformed) transform.apply(s, limits, tile * Tr::kBlockN);
    unsigned p[Tr::kMTiles][Tr::kPvSteps][4];
    if constexpr (kMasked) {
      const TileMask<Tr, kFirst, Tr::kCausal || Tr::kLocal> mask(limits, tile * Tr::kBlockN);
      softmax.template update<kFirst>(s, p, acc_o, scale_log2, mask);
    } else {
      softmax.template update<kFirst>(s, p, acc_o, scale_log2, NoMask());
    }
    if constexpr (Tr::kDropout) dropout.apply(p, tile * Tr::kBlockN);
    if constexpr (!Tr::kOneBarrier) {
      cp_async_wait<0>();
      block_sync();  // V landed; every warp is done reading K
      if constexpr (!Tr::kLateKLoad) load_next_k(tile);
    }
    gemm_pv<Tr>(acc_o, p, sv + v_stage(cur), lanes);
    if constexpr (!Tr::kOneBarrier && Tr::kLateKLoad) load_next_k(tile);
  }

  // One stage: the K tile after `tile`, into the one K buffer (free: every warp has passed
  // the barrier after its Q K^T).
  __device__ __forceinline__ void load_next_k(int tile) {
    if (tile - low() >= 1) k_in.template load<false>(sk, Tr::kBlockN, tid);
    cp_async_commit();
  }
};

}  // namespace ft
