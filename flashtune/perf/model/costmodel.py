"""A cost model of the forward kernel: PREDICTED time and TFLOP/s of one call on a named GPU.

The model, per K/V tile (one iteration of the kernel's main loop):

1. Each warp's instructions (from the main loop's SASS when given, else from the
   algorithm, see workload.py) cost cycles on its sub-partition's pipes: mma.sync at the
   GPU's mma.sync rate, MUFU and FP32 at their per-SM rates (CUDA C Programming Guide),
   shuffles, local-memory accesses, and one issue slot for everything else. A warp runs
   its tensor work and the rest mostly in sequence (the softmax needs the scores, the next
   MMA needs the probabilities); ``overlap`` is the share of the non-tensor cycles other
   warps on the same sub-partition hide (none when a warp is alone on it).
2. The resident blocks (occupancy) share the sub-partitions: a round in which each block
   advances one tile takes the longest of their summed compute, one block's compute plus
   the memory latency its pipeline wait exposes (``exposed_latency_ns``, less what
   ``num_stages - 1`` tiles of prefetch hide), and the shared-memory traffic at 128 B/clk
   (times the bank-conflict factor when counters give one).
3. Each block also moves its Q and O tiles and its first K/V tiles at its share of DRAM
   bandwidth; blocks are dispatched greedily to SM slots in launch order (wave
   quantisation and the causal tail, grid.py).
4. The call takes the longest of that schedule, its DRAM traffic and its L2 traffic at the
   achievable bandwidth, plus a fixed launch overhead.

Free parameters (ModelParams) are few and physical. ``overlap`` and
``exposed_latency_ns`` are least-squares fits (log time) to the published FlashAttention-2
H100 forward table for FA2's own tiles (reference/attention-baselines.md), so the model's
agreement with that table is by construction; the others come from datasheets or are
assumed (PARAM_SOURCES; every prediction lists them). ``calibrate`` refits them from
measurements.

With the kernel's SASS the model charges, per tile, the instructions each main loop
EXECUTES (loopcost.py): the masked and unmasked loops by how many tiles of each a query
block has, the O rescale a warp vote can skip by its chance of running. Every instruction
also takes an issue slot: a sub-partition issues one per cycle.

The sm_90a families (wgmma) are predicted on their own path, labelled ``path="wgmma"`` and
by their own model name, with the assumptions of perf/model/wgmma.py listed in the prediction.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Protocol

from flashtune import families
from flashtune.codegen.arch import SUBPARTITIONS_PER_SM
from flashtune.codegen.spec import KernelConfig, Problem, ShapeLike
from flashtune.errors import InvalidInput, OutOfResources
from flashtune.families.base import timing_window
from flashtune.families.registers import mma_head_dim, mma_v_head_dim
from flashtune.perf.model.algorithm import (
    TileMix,
    Traffic,
    Window,
    analytic_traffic,
    block_tiles,
    check_shape,
    sass_tile_mix,
)
from flashtune.perf.model.gpus import MMA_M16N8K16_FLOPS, GpuSpec, get_gpu
from flashtune.perf.model.grid import makespan
from flashtune.perf.model.loopcost import (
    KernelLoops,
    block_tile_mixes,
    kernel_loops,
    mean_rescale_probability,
)
from flashtune.perf.model.occupancy import Occupancy, occupancy
from flashtune.perf.model.params import DEFAULT_PARAMS as DEFAULT_PARAMS
from flashtune.perf.model.params import FA2_TABLE_FIT, parameter_sources
from flashtune.perf.model.params import MODEL_NAME as MODEL_NAME
from flashtune.perf.model.params import PARAM_SOURCES as PARAM_SOURCES
from flashtune.perf.model.params import ModelParams as ModelParams
from flashtune.perf.model.paths import model_path
from flashtune.perf.model.paths import model_version as model_version
from flashtune.perf.model.strategy import ModelPath, tensor_cycles, versioned
from flashtune.perf.sass.loops import main_loop, nested_loops
from flashtune.perf.sass.parse import InstructionMix, SassFunction


class ResourcesLike(Protocol):
    """Compiled resource usage (flashtune.toolchain.resources.Resources satisfies this)."""

    @property
    def registers(self) -> int: ...
    @property
    def spill_stores(self) -> int: ...
    @property
    def spill_loads(self) -> int: ...
    @property
    def static_smem(self) -> int: ...
    @property
    def dynamic_smem(self) -> int: ...


@dataclass(frozen=True)
class TrafficCounters:
    """Measured memory behaviour of one call of the predicted shape (e.g. from the CPU
    emulator). Absent fields fall back to the algorithm's analytic figures."""

    global_read_bytes: int | None = None
    global_write_bytes: int | None = None
    smem_bank_conflict_factor: float = 1.0  # shared-memory wavefronts per ideal wavefront

    def __post_init__(self) -> None:
        for name in ("global_read_bytes", "global_write_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise InvalidInput(f"TrafficCounters.{name}={value!r} must be a "
                                   "non-negative int or None")
        if not self.smem_bank_conflict_factor >= 1.0:
            raise InvalidInput("TrafficCounters.smem_bank_conflict_factor must be >= 1 "
                               f"(1 = conflict-free), got {self.smem_bank_conflict_factor}")


@dataclass(frozen=True)
class TileCycles:
    """Cycles of one K/V tile: per warp, and per round of all resident blocks."""

    tensor: float          # one warp's mma.sync cycles
    other: float           # one warp's non-tensor pipe cycles (before overlap)
    warp: float            # one warp's total after overlap
    compute_round: float   # busiest sub-partition, all resident blocks
    issue_round: float     # its issue slots: one instruction per cycle per sub-partition
    latency_round: float   # one block's compute plus its exposed memory latency
    smem_round: float      # shared-memory bandwidth, all resident blocks
    per_tile: float        # the longest of the four: each resident block's time per tile

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 1) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Prediction:
    """A PREDICTED (never measured) time of one forward call; ``bound`` is what limits it."""

    time_ms: float
    tflops: float
    bound: str
    model_version: str
    gpu: str
    occupancy: Occupancy
    cycles: TileCycles
    mix: TileMix
    traffic: Traffic
    waves: float
    utilisation: float
    schedule_ms: float
    dram_ms: float
    l2_ms: float
    notes: tuple[str, ...] = field(default=())
    parameters: tuple[tuple[str, float, str], ...] = field(default=())
    #: "mma.sync" (the forward, fitted to FA2's table) or "wgmma" (the sm_90a families)
    path: str = "mma.sync"
    #: The stated assumptions of the path (the wgmma path's; perf/model/wgmma.py)
    assumptions: tuple[str, ...] = field(default=())

    kind = "PREDICTED"

    def summary(self) -> str:
        return (f"PREDICTED {self.time_ms:.4g} ms, {self.tflops:.1f} TFLOP/s on {self.gpu} "
                f"({self.bound}-bound; model {self.model_version})")

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind, "time_ms": self.time_ms, "tflops": self.tflops,
            "bound": self.bound, "model_version": self.model_version, "gpu": self.gpu,
            "occupancy": self.occupancy.to_dict(), "cycles_per_tile": self.cycles.to_dict(),
            "tile_mix": self.mix.to_dict(), "traffic": self.traffic.to_dict(),
            "waves": round(self.waves, 3), "utilisation": round(self.utilisation, 4),
            "schedule_ms": self.schedule_ms, "dram_ms": self.dram_ms, "l2_ms": self.l2_ms,
            "notes": list(self.notes), "path": self.path,
            "assumptions": list(self.assumptions),
            "parameters": [{"name": n, "value": v, "source": src}
                           for n, v, src in self.parameters],
        }

    def fitted_summary(self) -> str:
        """Which parameters were fitted to which published table."""
        fitted = [n for n, _, src in self.parameters if src == FA2_TABLE_FIT]
        return (f"parameters {', '.join(fitted)} are a {FA2_TABLE_FIT}" if fitted
                else "no parameter is at its published-table fit")


def _gpu(gpu: GpuSpec | str) -> GpuSpec:
    return gpu if isinstance(gpu, GpuSpec) else get_gpu(gpu)


def _tile_mix(problem: Problem, config: KernelConfig, sass: SassFunction | InstructionMix | None,
              resources: ResourcesLike | None, local_per_tile: float | None,
              notes: list[str], path: ModelPath) -> TileMix:
    analytic = path.analytic_mix(problem, config)
    if sass is None and local_per_tile is not None:
        notes.append(f"{local_per_tile:g} local-memory accesses per K/V tile (measured)")
        return dataclasses.replace(analytic, local=local_per_tile)
    if sass is not None:
        loop_mix = sass
        if isinstance(sass, SassFunction):
            loop = main_loop(sass)
            loop_mix = sass.mix(loop) if loop is not None else sass.mix()
            if loop is None:
                notes.append("no loop in the SASS; counts taken over the whole kernel")
        assert isinstance(loop_mix, InstructionMix)
        if loop_mix.mma_flops > 0:
            mix, unroll = sass_tile_mix(loop_mix, analytic)
            if unroll != 1.0:
                notes.append(f"the SASS main loop covers {unroll:g} K/V tiles per pass")
            return mix
        notes.append("the SASS main loop has no MMA; using the analytic instruction mix")
    if resources is not None and resources.spill_stores + resources.spill_loads > 0:
        spill_ops = (resources.spill_stores + resources.spill_loads) / 4
        notes.append(f"{resources.spill_stores + resources.spill_loads} spill bytes assumed "
                     "to be accessed once per K/V tile")
        return dataclasses.replace(analytic, local=spill_ops)
    return analytic


def _occupancy(problem: Problem, config: KernelConfig, gpu: GpuSpec,
               resources: ResourcesLike | None, notes: list[str],
               path: ModelPath) -> Occupancy:
    if resources is not None:
        regs = resources.registers
        smem = resources.static_smem + resources.dynamic_smem
    else:
        regs = path.estimated_registers(problem, config, gpu)
        smem = families.of(problem).smem_bytes(problem, config)
        notes.append(f"registers estimated ({regs}); pass the compiled resources for exact "
                     "occupancy")
    return occupancy(gpu.arch_spec, threads=path.block_threads(config), registers=regs,
                     smem_bytes=smem)


def _cycles(mix: TileMix, problem: Problem, config: KernelConfig, gpu: GpuSpec,
            occ: Occupancy, params: ModelParams, conflict: float,
            path: ModelPath) -> TileCycles:
    thr = gpu.throughput
    tensor = tensor_cycles(mix.mma_flops - mix.wgmma_flops, mix.wgmma_flops,
                           gpu.mma_sync_cycles, gpu.tensor_flops_per_clk_sm,
                           SUBPARTITIONS_PER_SM, params.tensor_efficiency)
    other = (mix.mufu * thr.warp_cycles(thr.mufu_per_clk)
             + mix.fp32 * thr.warp_cycles(thr.fp32_per_clk)
             + mix.shfl * thr.warp_cycles(thr.shfl_per_clk)
             + mix.local * params.local_access_cycles
             + mix.issue_only)
    shared = path.tile_round(tensor, other, occ, config, params)
    warps_per_partition, warp, round_ = shared.warps_per_partition, shared.warp, shared.round
    per_block = math.ceil(config.num_warps / SUBPARTITIONS_PER_SM) * warp
    # A sub-partition issues one warp instruction per cycle, whatever pipe it goes to
    # (a wgmma's issue slot is in issue_only).
    instructions = ((mix.mma_flops - mix.wgmma_flops) / MMA_M16N8K16_FLOPS + mix.mufu
                    + mix.fp32 + mix.shfl + mix.local + mix.issue_only)
    issue_round = warps_per_partition * instructions
    latency = params.exposed_latency_ns * 1e-9 * gpu.clock_hz
    exposed = max(0.0, latency - (config.num_stages - 1) * per_block)
    latency_round = per_block + exposed
    # ldmatrix reads per warp, the writes of one K and one V tile per block, and the
    # operands the tensor-core instructions read from shared memory themselves (wgmma).
    kv_tile_bytes = (config.block_n * (mma_head_dim(problem) + mma_v_head_dim(problem))
                     * problem.dtype.itemsize)
    smem_bytes = occ.blocks_per_sm * (config.num_warps * mix.ldsm_bytes * conflict
                                      + kv_tile_bytes * conflict
                                      + path.operand_smem_bytes(problem, config))
    smem_round = smem_bytes / thr.smem_bytes_per_clk
    return TileCycles(tensor, other, warp, round_, issue_round, latency_round,
                      smem_round, max(round_, issue_round, latency_round, smem_round))



def predict(
    problem: Problem,
    config: KernelConfig,
    shape: ShapeLike,
    gpu: GpuSpec | str,
    *,
    resources: ResourcesLike | None = None,
    sass: SassFunction | InstructionMix | None = None,
    counters: TrafficCounters | None = None,
    params: ModelParams = DEFAULT_PARAMS,
    local_per_tile: float | None = None,
    window: Window | None = None,
) -> Prediction:
    """PREDICTED time of ``problem`` with ``config`` on ``shape`` on ``gpu``.

    ``resources`` (registers, spills, shared memory of the compiled kernel) make occupancy
    exact; ``sass`` (the kernel's parsed SASS function, or the main loop's mix) replaces the
    analytic instruction counts; ``counters`` replace the analytic traffic;
    ``local_per_tile``, without ``sass``, is the measured local-memory accesses per K/V tile
    of a kernel that spills (else spill bytes are assumed accessed once per tile). Raises
    OutOfResources when no block of the kernel fits on an SM, InvalidProblem for a problem
    of another family than the forwards (the model describes a forward's main loop: the
    mma.sync forward's, or on the wgmma path, perf/model/wgmma.py, an sm_90a family's).
    ``window``: a window problem's (left, right) sizes; the tiles left of every row's window
    are not walked and those crossing an edge run masked (``algorithm.block_tiles``). None:
    the window a tuning run times the shape with (``timing_window``).
    """
    path = model_path(problem, config)  # the one arch-specific choice (paths.py)
    check_shape(shape)
    spec = _gpu(gpu)
    notes: list[str] = []
    if problem.window and window is None:
        window = timing_window(shape)
    blocks = block_tiles(problem, config, shape, window)
    tiles = [b.count for b in blocks]
    fn = sass if isinstance(sass, SassFunction) else None
    loops = (kernel_loops(fn, problem, config, path.analytic_mix(problem, config))
             if fn is not None else None)
    if loops is not None and fn is not None:
        mix = loops.tile_mix(False, mean_rescale_probability(config, tiles))
        notes.append(_loop_note(loops, config, tiles, fn))
    else:
        mix = _tile_mix(problem, config, sass, resources, local_per_tile, notes, path)
    occ = _occupancy(problem, config, spec, resources, notes, path)
    conflict = counters.smem_bank_conflict_factor if counters is not None else 1.0
    cyc = _cycles(mix, problem, config, spec, occ, params, conflict, path)
    clock = spec.clock_hz

    slots = occ.blocks_per_sm * spec.sm_count
    bandwidth = params.bandwidth_efficiency * spec.hbm_gbps * 1e9
    l2_bandwidth = params.bandwidth_efficiency * spec.l2_gbps * 1e9
    e = problem.dtype.itemsize
    # A block's own Q tile (read before its first tile) and O tile (written after its
    # last) come from / go to DRAM at its share of the bandwidth; its first K/V tiles
    # mostly hit L2 (other query blocks of the head fetched them).
    row = (problem.head_dim + problem.v_head_dim) * e  # Q's and O's, K's and V's
    q_o_s = config.block_m * row / (bandwidth / slots)
    first_kv_s = config.block_n * row / (l2_bandwidth / slots)
    if loops is not None:
        # Each query block: its masked tiles at the masked loop's executed cost, the rest at
        # the unmasked loop's, both at the block's chance of a rescale.
        durations = []
        for t, (masked, masked_mix, unmasked_mix) in zip(
                tiles, block_tile_mixes(loops, config, blocks), strict=True):
            masked_s = _cycles(masked_mix, problem, config, spec, occ, params,
                               conflict, path).per_tile / clock
            unmasked_s = _cycles(unmasked_mix, problem, config, spec, occ, params,
                                 conflict, path).per_tile / clock
            durations.append(q_o_s + (first_kv_s if t else 0.0) + masked * masked_s
                             + (t - masked) * unmasked_s)
    else:
        tile_s = cyc.per_tile / clock
        durations = [q_o_s + (first_kv_s if t else 0.0) + t * tile_s for t in tiles]
    sched = makespan(durations, shape.batch * shape.heads_q, slots)

    traffic = analytic_traffic(problem, config, shape, l2_bytes=spec.l2_bytes,
                               resident_blocks=slots, window=window)
    if counters is not None and counters.global_read_bytes is not None:
        write = (counters.global_write_bytes if counters.global_write_bytes is not None
                 else shape.batch * shape.heads_q * shape.seqlen_q * (problem.v_head_dim * e + 4))
        l2 = float(counters.global_read_bytes + write)
        traffic = Traffic(min(traffic.dram_bytes, l2), l2, "counters")
    dram_s = traffic.dram_bytes / bandwidth
    l2_s = traffic.l2_bytes / l2_bandwidth
    total_s = max(sched.makespan, dram_s, l2_s) + params.launch_overhead_us * 1e-6

    memory_share = sum(q_o_s + (first_kv_s if t else 0.0) for t in tiles) / sum(durations)
    bound = _bound(sched.makespan, dram_s, l2_s, sched.utilisation, memory_share, cyc, notes)
    work = families.of(problem).flops(problem, shape)
    version = versioned(params, path.model_name)
    return Prediction(
        time_ms=total_s * 1e3, tflops=work / total_s / 1e12, bound=bound,
        model_version=version, gpu=spec.name, occupancy=occ, cycles=cyc, mix=mix,
        traffic=traffic, waves=sched.waves, utilisation=sched.utilisation,
        schedule_ms=sched.makespan * 1e3, dram_ms=dram_s * 1e3, l2_ms=l2_s * 1e3,
        notes=tuple(notes), parameters=parameter_sources(params),
        path=path.name, assumptions=path.assumptions(params),
    )


def _loop_note(loops: KernelLoops, config: KernelConfig, tiles: list[int],
               fn: SassFunction) -> str:
    p = mean_rescale_probability(config, tiles)
    u = loops.unmasked
    text = (f"charged executed instructions: unmasked loop {u.loop.static} static, "
            f"{u.loop.executed_min} without the O rescale, which runs on {p:.0%} of tiles")
    inner = nested_loops(fn, u.loop.loop)
    if inner:
        text += (f"; it holds {len(inner)} inner loop(s) (e.g. rolled copy loops) whose "
                 "bodies are charged once per tile: the SASS does not give their trip count")
    if loops.masked is not None:
        text += f"; masked loop {loops.masked.loop.static} static"
    else:
        text += "; masked steps as the unmasked loop plus a compare and select per score"
    return text


def _bound(schedule_s: float, dram_s: float, l2_s: float, utilisation: float,
           memory_share: float, cyc: TileCycles, notes: list[str]) -> str:
    """What limits the call: the longest of its parts, in this order of precedence."""
    if max(dram_s, l2_s) >= schedule_s or memory_share > 0.5:
        return "memory"
    if utilisation < 0.5:
        notes.append(f"the grid keeps the SMs busy only {utilisation:.0%} of the time")
        return "latency"
    if cyc.per_tile == cyc.smem_round and cyc.smem_round > cyc.compute_round:
        return "memory"
    if cyc.per_tile == cyc.latency_round and cyc.latency_round > cyc.compute_round:
        return "latency"
    if cyc.per_tile == cyc.issue_round and cyc.issue_round > cyc.compute_round:
        notes.append("instruction issue limits each tile (one per cycle per sub-partition)")
    return "compute"


def rank(
    problem: Problem,
    configs: Iterable[KernelConfig],
    shape: ShapeLike,
    gpu: GpuSpec | str,
    *,
    resources: Mapping[KernelConfig, ResourcesLike] | None = None,
    sass: Mapping[KernelConfig, SassFunction | InstructionMix] | None = None,
    params: ModelParams = DEFAULT_PARAMS,
) -> list[tuple[KernelConfig, Prediction]]:
    """Configs with their predictions, fastest PREDICTED first (ties in input order).

    Configs of which no block fits on an SM are left out.
    """
    out: list[tuple[KernelConfig, Prediction]] = []
    for config in configs:
        try:
            pred = predict(problem, config, shape, gpu,
                           resources=(resources or {}).get(config),
                           sass=(sass or {}).get(config), params=params)
        except OutOfResources:
            continue
        out.append((config, pred))
    out.sort(key=lambda cp: cp[1].time_ms)
    return out
