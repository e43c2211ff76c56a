"""Profile one kernel without a GPU: compile it, read its SASS, resources and occupancy, and
PREDICT its time on a named GPU. What ``flashtune profile`` prints.

The SASS statistics (the whole kernel and its main loop, ``perf.sass.loops.main_loop``) and
the occupancy are read for a kernel of any family; the time is only
predicted for the forwards the cost model describes: the mma.sync forward and the sm_90a
(wgmma) families, each on its own labelled path. On an H100 sweep point the published
FA3 / FA2 figures are given with the ratio of the prediction to them (a sanity check)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import KernelConfig, Problem, Shape
from flashtune.errors import InvalidConfig
from flashtune.families import of, render
from flashtune.families.registers import mma_head_dim, mma_v_head_dim
from flashtune.perf.model.baselines import PublishedFigure, published_figures
from flashtune.perf.model.costmodel import DEFAULT_PARAMS, ModelParams, Prediction, predict
from flashtune.perf.model.gpus import GpuSpec, default_gpu_for_arch, get_gpu
from flashtune.perf.model.occupancy import Occupancy, occupancy
from flashtune.perf.model.paths import is_arch_specific_path, predicts
from flashtune.perf.sass.disasm import sass_listing
from flashtune.perf.sass.loops import MainLoops, main_loop, main_loops, nested_loops
from flashtune.perf.sass.parse import InstructionMix, Loop
from flashtune.toolchain.compiler import compile_source
from flashtune.toolchain.resources import Resources

if TYPE_CHECKING:
    from flashtune.perf.model.emulated import EmulatedTraffic


@dataclass(frozen=True)
class KernelProfile:
    """Static facts of one compiled kernel and its PREDICTED time on one shape."""

    problem: Problem
    config: KernelConfig
    arch: str
    gpu: GpuSpec
    shape: Shape
    entry: str
    resources: Resources
    kernel_mix: InstructionMix
    loop: Loop | None
    loop_mix: InstructionMix | None
    loops: MainLoops
    occupancy: Occupancy
    prediction: Prediction | None  # None: the cost model has no model of this family
    emulated: EmulatedTraffic | None = None  # emulator counters fed to the prediction
    #: Published figures for the same GPU and shape (empty off the standard sweep)
    published: tuple[PublishedFigure, ...] = field(default=())
    #: Loops inside the main loop with their mixes (the main loop's static counts take
    #: their bodies once per iteration)
    inner_loops: tuple[tuple[Loop, InstructionMix], ...] = field(default=())

    @property
    def tensor_flops_per_iteration(self) -> int | None:
        """Tensor FLOPs one main-loop iteration of the whole block computes (each warp's
        share, HMMA or its quarter of a wgmma, times the block's compute warps)."""
        if self.loop_mix is None:
            return None
        return self.loop_mix.mma_flops * self.compute_warps

    @property
    def compute_warps(self) -> int:
        """Warps of the block that issue the tensor-core math (the family's count)."""
        return of(self.problem).compute_warps(self.problem, self.config)

    @property
    def tensor_flops_per_tile(self) -> int | None:
        """A forward's tensor FLOPs per K/V tile: 2 * block_m * block_n * (Q/K's head dim +
        V's) (Q K^T and P V, each head dim rounded up to 16 as the tensor cores see it);
        None for a kernel that is not a forward (the mma.sync one or an sm_90a family)."""
        if not predicts(self.problem):
            return None
        return (2 * self.config.block_m * self.config.block_n
                * (mma_head_dim(self.problem) + mma_v_head_dim(self.problem)))

    def to_dict(self) -> dict[str, object]:
        return {
            "problem": self.problem.to_dict(),
            "config": self.config.to_dict(),
            "config_key": self.config.key(),
            "arch": self.arch,
            "gpu": self.gpu.to_dict(),
            "shape": asdict(self.shape),
            "entry": self.entry,
            "resources": self.resources.to_dict(),
            "sass": {
                "kernel": self.kernel_mix.to_dict(),
                "main_loop": None if self.loop_mix is None else {
                    "start": self.loop.start if self.loop else None,
                    "end": self.loop.end if self.loop else None,
                    "tensor_flops_per_iteration": self.tensor_flops_per_iteration,
                    "tensor_flops_per_tile": self.tensor_flops_per_tile,
                    "inner_loops": [{"start": lp.start, "end": lp.end, "instructions": mix.total,
                                     "tensor_flops": mix.mma_flops}
                                    for lp, mix in self.inner_loops],
                    **self.loop_mix.to_dict(),
                },
                **{f"{kind}_loop": value for kind, value in self.loops.to_dict().items()},
            },
            "occupancy": self.occupancy.to_dict(),
            "prediction": None if self.prediction is None else self.prediction.to_dict(),
            "published": [f.to_dict(self.prediction.tflops if self.prediction else None)
                          for f in self.published],
            "emulator_counters": None if self.emulated is None else self.emulated.to_dict(),
        }


def resolve_gpu(arch: str, gpu: str | None) -> GpuSpec:
    """The GPU named (checked against ``arch``), else the arch's reference GPU."""
    spec = get_arch(arch)
    if gpu is None:
        return default_gpu_for_arch(spec.name)
    found = get_gpu(gpu)
    if not spec.runs_on(found.arch_spec):
        raise InvalidConfig(f"GPU {found.name} is {found.arch}, but the kernel is compiled for "
                            f"{spec.name}; pass --arch {found.arch} or another --gpu")
    return found


def profile_kernel(problem: Problem, config: KernelConfig, shape: Shape, arch: str,
                   gpu: str | None = None, *,
                   params: ModelParams = DEFAULT_PARAMS,
                   counters: bool = False) -> KernelProfile:
    """Compile ``problem`` x ``config`` for ``arch``, disassemble it and predict ``shape``
    on ``gpu`` (default: the arch's reference GPU). With ``counters``, the kernel also runs
    in the CPU emulator on a small sample shape and its measured global bytes and bank
    conflicts replace the model's analytic ones (perf.model.emulated)."""
    spec = get_arch(arch)
    target = resolve_gpu(spec.name, gpu)
    source = render(problem, config)
    kernel = compile_source(source, spec.name)
    function = sass_listing(kernel.cubin, spec.name).function(source.entry)
    loops = main_loops(function)
    loop = main_loop(function, loops)
    if counters and not (predicts(problem) and not is_arch_specific_path(problem)):
        raise InvalidConfig(f"emulator counters feed the mma.sync forward's prediction only; "
                            f"profile the {problem.op!r} family without --counters")
    emulated = None
    prediction = None
    if predicts(problem):
        if counters:
            from flashtune.perf.model.emulated import measure_traffic

            emulated = measure_traffic(problem, config, shape)
        prediction = predict(problem, config, shape, target, resources=kernel.resources,
                             sass=function, params=params,
                             counters=emulated.traffic if emulated is not None else None)
    res = kernel.resources
    occ = occupancy(spec, threads=source.threads, registers=res.registers,
                    smem_bytes=res.static_smem + res.dynamic_smem)
    return KernelProfile(
        problem=problem, config=config, arch=spec.name, gpu=target, shape=shape,
        entry=source.entry, resources=kernel.resources, kernel_mix=function.mix(),
        loop=loop, loop_mix=function.mix(loop) if loop is not None else None, loops=loops,
        occupancy=occ, prediction=prediction, emulated=emulated,
        published=tuple(published_figures(problem, shape, target.name)),
        inner_loops=tuple((lp, function.mix(lp)) for lp in
                          (nested_loops(function, loop) if loop is not None else ())),
    )
