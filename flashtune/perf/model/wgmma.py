"""The cost model's wgmma path (``WgmmaPath``, one strategy of strategy.py, chosen by
paths.py for a forward family whose target arch is sm_90a): what wgmma, TMA and warp
specialisation change in a PREDICTION, and the assumptions it rests on. A family's
``Design`` is read from what it declares: whether it has a producer warpgroup (the
warp-specialised family), how its config loads K/V and whether its consumers take
ping-pong turns.

The per-tile structure is the forward's (costmodel.py): instructions per warp per K/V tile
from the main loop's SASS, rounds of all resident blocks on a sub-partition, exposed memory
latency, shared-memory writes, the grid's schedule, DRAM and L2 traffic. The wgmma path
differs in:

- Tensor rate: wgmma (HGMMA) runs at the datasheet dense rate (H100 SXM5: 989.4 TFLOP/s,
  4096 FLOP/clk/SM; reference/hopper.md §1.4), where mma.sync reaches only
  ``GpuSpec.mma_sync_fraction`` of it. A warp's share of one HGMMA m64nNk16 (its 16 of the
  64 rows) keeps its sub-partition's tensor core busy 2*16*N*16 / 1024 cycles.
- Overlap: a wgmma is asynchronous, so a warp's tensor time and its other pipes' time
  (softmax: MUFU, FP32, issue slots) overlap; what the dependency chain S -> softmax -> P ->
  P V leaves to overlap is an ASSUMPTION per design (``Design.overlap``), not a fit:
  * without ping-pong (each consumer warpgroup waits for its own GEMMs): the share
    of the shorter of the two a second warp on the sub-partition hides is the forward's
    ``overlap`` parameter (fitted to FA2's table for mma.sync warps; reused, not refitted);
  * with ping-pong: named barriers make the two consumer warpgroups take turns, one's
    softmax under the other's GEMMs (FA3 paper §3.1), assumed to hide all of the shorter.
- Loads: without a producer warpgroup the consumer warps issue their cp.async copies
  (their address arithmetic is in the main loop's SASS, so it is charged); the
  warp-specialised family's producer warpgroup issues TMA copies, and its few
  instructions per tile are not charged. Where the
  load knobs make it copy with cp.async its instructions are not charged either (they are
  not in the consumers' main loop): an optimistic assumption, said in the prediction. All
  see the same memory latency, hidden by ``num_stages - 1`` tiles of prefetch.
- Shared memory: the wgmma operand reads from shared memory are charged beside the K/V
  tile writes (``operand_smem_bytes``), at the shared-memory bandwidth of 128 B/clk per SM
  and conflict-free (the operands are swizzled): an ASSUMPTION that they share the one
  port ldmatrix uses. Each consumer warpgroup reads its 64 rows of Q and the whole K tile
  for S = Q K^T (both operands from shared memory, as FA3 keeps Q) and the whole V tile
  for O += P V (P from registers). S's reads per FLOP grow as the key tile narrows
  (4096 / block_n + 64 bytes per cycle of tensor time at the datasheet rate): at
  block_n 64 they equal the bandwidth, at 32 (the wide head dims' tiles) they exceed it
  by half, so narrow key tiles are bound by shared memory, not by the tensor rate.

Nothing here was calibrated on a GPU: ``CALIBRATION`` says so in every wgmma prediction,
and ``flashtune profile`` prints the ratio to the published FA3 / FA2 figures
(perf.model.baselines) as a sanity check, never fitted.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from flashtune import families
from flashtune.codegen.arch import SUBPARTITIONS_PER_SM
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.errors import InvalidConfig, InvalidProblem
from flashtune.families.base import KernelFamily
from flashtune.families.hopper import HopperForwardFamily, space
from flashtune.families.hopper.ws import PRODUCER_THREADS, HopperWsForwardFamily
from flashtune.families.registers import mma_head_dim, mma_v_head_dim
from flashtune.perf.model.algorithm import TileMix, analytic_tile_mix
from flashtune.perf.model.gpus import GpuSpec
from flashtune.perf.model.occupancy import Occupancy
from flashtune.perf.model.params import ModelParams
from flashtune.perf.model.strategy import TileRound

MODEL_NAME = "fa3-wgmma-1"
#: Said in every wgmma prediction.
CALIBRATION = ("uncalibrated: no sm_90a kernel has been timed on a GPU; the wgmma rate is "
               "the datasheet's and the overlap shares are assumptions")
#: Share of the shorter of tensor and non-tensor time hidden under ping-pong (assumed).
PINGPONG_OVERLAP = 1.0
#: How a design's K/V tiles reach shared memory.
LOADS = ("cp.async", "TMA")


@dataclass(frozen=True)
class Design:
    """How one sm_90a family loads and schedules, as the cost model sees it."""

    op: str
    loads: str                 # "cp.async" (some operand) or "TMA" (all), by the producer
    #                            warpgroup if there is one, else by the consumer warps
    producer_threads: int      # threads of the producer warpgroup (0: none)
    pingpong: bool

    def __post_init__(self) -> None:
        if self.loads not in LOADS:
            raise InvalidConfig(f"Design {self.op}: loads={self.loads!r}, expected one of "
                                f"{LOADS}")
        if self.producer_threads < 0 or self.producer_threads % 128:
            raise InvalidConfig(f"Design {self.op}: producer_threads={self.producer_threads} "
                                "must be 0 or whole warpgroups (multiples of 128)")
        if self.pingpong and not self.producer_threads:
            raise InvalidConfig(f"Design {self.op}: ping-pong consumers need a producer "
                                "warpgroup (the warp-specialised kernel)")

    @property
    def warp_specialized(self) -> bool:
        return self.producer_threads > 0

    @property
    def consumers_copy(self) -> bool:
        """Whether the consumer warps issue cp.async copies (charged in their main loop)."""
        return self.loads == "cp.async" and not self.warp_specialized

    def overlap(self, fitted: float) -> float:
        """Share of the shorter of a warp's tensor and non-tensor time that other consumer
        warps on its sub-partition hide (``fitted``: the forward's ``overlap`` parameter)."""
        return PINGPONG_OVERLAP if self.pingpong else fitted

    def assumptions(self, fitted: float) -> tuple[str, ...]:
        """The stated assumptions of a prediction of this design."""
        share = self.overlap(fitted)
        schedule = ("ping-pong: the two consumer warpgroups take turns (named barriers), "
                    f"hiding {share:.0%} of the shorter of tensor and softmax time (assumed)"
                    if self.pingpong else
                    f"a second consumer warp per sub-partition hides {share:.0%} of the "
                    "shorter of tensor and softmax time (the mma.sync forward's fitted "
                    "overlap, reused: assumed, not fitted to wgmma)")
        if not self.warp_specialized:
            loads = ("K/V by cp.async from the consumer warps (their copies and address "
                     "arithmetic charged from the SASS)")
        elif self.loads == "TMA":
            loads = "K/V by TMA from a producer warpgroup (its instructions not charged)"
        else:
            loads = ("some operands by cp.async from a producer warpgroup (its copies and "
                     "address arithmetic not charged: optimistic)")
        overlap = (("the overlap knob (intra-warpgroup overlap) is not modelled",)
                   if self.warp_specialized else ())
        return ("wgmma at the datasheet dense tensor rate", schedule, loads, *overlap,
                "wgmma shared-memory operand reads (Q, K, V per consumer warpgroup) at the "
                "shared-memory bandwidth, 128 B/clk per SM (assumed: ldmatrix's port)",
                CALIBRATION)


def design_of(problem: Problem, config: KernelConfig) -> Design | None:
    """The Design of ``config`` of ``problem``'s family when it is an sm_90a forward family
    (ping-pong from the config's knob), else None."""
    family = families.of(problem)
    return design_of_family(family, config) if isinstance(family, HopperForwardFamily) else None


def design_of_family(family: HopperForwardFamily, config: KernelConfig) -> Design:
    """The Design of ``config`` of an sm_90a forward family: a warp-specialised family
    (its producer warpgroup) loads by TMA unless a load knob asks for cp.async, and takes
    ping-pong turns as the family or the config says; the other loads by cp.async from
    its consumer warps."""
    if isinstance(family, HopperWsForwardFamily):
        loads = "cp.async" if space.cp_async_producer(config) else "TMA"
        return Design(family.op, loads, PRODUCER_THREADS, family.pingpong_on(config))
    return Design(family.op, "cp.async", 0, False)


@dataclass(frozen=True)
class WgmmaPath:
    """The cost model's sm_90a strategy (``strategy.ModelPath``) for one Design."""

    design: Design
    #: Registers beyond the accumulators when no compiled resources are given.
    register_overhead: int
    name: str = "wgmma"
    model_name: str = MODEL_NAME

    @staticmethod
    def models(family: KernelFamily) -> bool:
        """Whether this path has a model of ``family``: the 16-bit sm_90a forwards (the FP8
        sm_90a forward's k32 steps, V transpose and P rounding are not modelled)."""
        return isinstance(family, HopperForwardFamily)

    @classmethod
    def of(cls, family: KernelFamily, problem: Problem, config: KernelConfig,
           register_overhead: int) -> WgmmaPath:
        """The path of ``config`` of an sm_90a forward family (InvalidProblem for another
        family: this path has no model of it)."""
        if not isinstance(family, HopperForwardFamily):
            raise InvalidProblem(f"the wgmma path models the sm_90a forward kernels; the "
                                 f"{family.op!r} family of {problem.key()} is not one")
        return cls(design_of_family(family, config), register_overhead)

    def analytic_mix(self, problem: Problem, config: KernelConfig) -> TileMix:
        return analytic_tile_mix_wgmma(problem, config, self.design)

    def block_threads(self, config: KernelConfig) -> int:
        """The config's threads plus the producer warpgroup's, if there is one."""
        return config.threads + self.design.producer_threads

    def estimated_registers(self, problem: Problem, config: KernelConfig,
                            gpu: GpuSpec) -> int:
        regs = min(gpu.arch_spec.max_regs_per_thread,
                   space.accumulator_registers(problem, config) + self.register_overhead)
        # Every sm_90a forward launches with __launch_bounds__(threads, 1): ptxas keeps a
        # thread within one block's share of the register file (a 192-row tile of the
        # cp.async family: 384 threads, 168 registers), and the warp-specialised kernel's
        # setmaxnreg moves registers within that share.
        return min(regs, launch_registers(gpu.arch_spec.regs_per_sm, self.block_threads(config)))

    def tile_round(self, tensor: float, other: float, occ: Occupancy,
                   config: KernelConfig, params: ModelParams) -> TileRound:
        # wgmma is asynchronous: tensor and softmax time overlap; only the consumer warps
        # compute (a producer warpgroup's are not counted).
        warps_per_partition = consumer_warps_per_partition(occ.blocks_per_sm, config,
                                                           SUBPARTITIONS_PER_SM)
        warp, round_ = compute_round(tensor, other, warps_per_partition,
                                     self.design.overlap(params.overlap))
        return TileRound(warps_per_partition, warp, round_)

    def operand_smem_bytes(self, problem: Problem, config: KernelConfig) -> float:
        """Per K/V tile: each consumer warpgroup reads its 64 rows of Q and the whole K
        tile (S = Q K^T, both from shared memory) and the whole V tile (P V's B operand):
        Q's block_m rows once, K and V once per warpgroup."""
        d, dv = mma_head_dim(problem), mma_v_head_dim(problem)
        q, kv = problem.dtypes.q.itemsize, problem.dtypes.kv.itemsize
        return (config.block_m * d * q
                + space.warpgroups(config) * config.block_n * (d + dv) * kv)

    def assumptions(self, params: ModelParams) -> tuple[str, ...]:
        return self.design.assumptions(params.overlap)


def launch_registers(regs_per_sm: int, threads: int) -> int:
    """Registers per thread an sm_90a forward launches with: one block's share of the SM
    (in the allocation unit of 8; 168 at 384 threads, as NVRTC 13 gives these kernels),
    which a warp-specialised kernel's ``setmaxnreg`` then moves from the producer to the
    consumers."""
    return regs_per_sm // threads // 8 * 8


def analytic_tile_mix_wgmma(problem: Problem, config: KernelConfig, design: Design) -> TileMix:
    """Per-warp, per-K/V-tile counts without the SASS: the forward's softmax counts (the
    same per score), its tensor FLOPs as wgmma, no ldmatrix, one issue slot per HGMMA
    (d/16 for S, block_n/16 for P V) and per wgmma fence, wait and mbarrier operation, and
    the cp.async copies with the forward's address estimate only when the consumers load.
    An approximation: the SASS path (``flashtune profile``) replaces it; the compiled
    cp.async loop issues several times more integer instructions than it estimates."""
    fa2 = analytic_tile_mix(problem, config)
    d, dv = mma_head_dim(problem), mma_v_head_dim(problem)
    hgmma = d / 16 + config.block_n / 16
    syncs = 4 + (4 if design.consumers_copy else 2)
    ldgsts = (config.block_n * (d + dv) * 2 / 16 / config.threads if design.consumers_copy
              else 0.0)
    integer = 2 * ldgsts + 60
    return dataclasses.replace(fa2, wgmma_flops=fa2.mma_flops, ldsm_bytes=0.0,
                               issue_only=hgmma + syncs + ldgsts + 2 + integer)


def compute_round(tensor: float, other: float, warps_per_partition: int,
                  overlap: float) -> tuple[float, float]:
    """(one warp's cycles per tile, a sub-partition's round of ``warps_per_partition``
    consumer warps): the longer of the summed tensor and non-tensor time, plus the part of
    the shorter not hidden, and never less than one warp's own chain (tensor + other: each
    warpgroup waits for its own GEMMs, so a warp alone on its sub-partition hides
    nothing)."""
    hidden = overlap * min(1.0, warps_per_partition - 1.0)
    t, o = warps_per_partition * tensor, warps_per_partition * other
    round_ = max(max(t, o) + (1.0 - hidden) * min(t, o), tensor + other)
    return round_ / max(1, warps_per_partition), round_


def consumer_warps_per_partition(blocks_per_sm: int, config: KernelConfig,
                                 subpartitions: int) -> int:
    """Consumer warps (the config's, not a producer's) per sub-partition."""
    return max(1, math.ceil(blocks_per_sm * config.num_warps / subpartitions))
