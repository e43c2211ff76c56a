"""Profile one kernel without a GPU: compile it, read its SASS, resources and occupancy, and
PREDICT its time on a named GPU. What ``flashtune profile`` prints.

The SASS statistics (the whole kernel and its main loop: the innermost loop with the most
tensor-core work) and the occupancy are read for a kernel of any family; the time is only
predicted for the forward, the one kernel the cost model describes."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import KernelConfig, Problem, Shape
from flashtune.errors import InvalidConfig
from flashtune.families import render
from flashtune.perf.costmodel import DEFAULT_PARAMS, ModelParams, Prediction, predict
from flashtune.perf.disasm import sass_listing
from flashtune.perf.gpus import GpuSpec, default_gpu_for_arch, get_gpu
from flashtune.perf.loops import MainLoops, main_loops
from flashtune.perf.occupancy import Occupancy, occupancy
from flashtune.perf.sass import InstructionMix, Loop
from flashtune.runtime.compiler import compile_source
from flashtune.runtime.resources import Resources

if TYPE_CHECKING:
    from flashtune.perf.emulated import EmulatedTraffic


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
                    **self.loop_mix.to_dict(),
                },
                **{f"{kind}_loop": value for kind, value in self.loops.to_dict().items()},
            },
            "occupancy": self.occupancy.to_dict(),
            "prediction": None if self.prediction is None else self.prediction.to_dict(),
            "emulator_counters": None if self.emulated is None else self.emulated.to_dict(),
        }


def resolve_gpu(arch: str, gpu: str | None) -> GpuSpec:
    """The GPU named (checked against ``arch``), else the arch's reference GPU."""
    spec = get_arch(arch)
    if gpu is None:
        return default_gpu_for_arch(spec.name)
    found = get_gpu(gpu)
    if found.arch != spec.name:
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
    conflicts replace the model's analytic ones (perf.emulated)."""
    spec = get_arch(arch)
    target = resolve_gpu(spec.name, gpu)
    source = render(problem, config)
    kernel = compile_source(source, spec.name)
    function = sass_listing(kernel.cubin, spec.name).function(source.entry)
    loops = main_loops(function)
    # The main loop: the unmasked one, where most tiles of a long sequence run.
    main = loops.unmasked or loops.masked
    loop = main.loop if main is not None else function.hot_loop()
    if counters and problem.op != "fwd":
        raise InvalidConfig(f"emulator counters feed the cost model's prediction, which only "
                            f"describes the forward; profile the {problem.op!r} family "
                            "without --counters")
    emulated = None
    prediction = None
    if problem.op == "fwd":
        if counters:
            from flashtune.perf.emulated import measure_traffic

            emulated = measure_traffic(problem, config, shape)
        prediction = predict(problem, config, shape, target, resources=kernel.resources,
                             sass=function, params=params,
                             counters=emulated.traffic if emulated is not None else None)
    res = kernel.resources
    occ = occupancy(spec, threads=config.threads, registers=res.registers,
                    smem_bytes=res.static_smem + res.dynamic_smem)
    return KernelProfile(
        problem=problem, config=config, arch=spec.name, gpu=target, shape=shape,
        entry=source.entry, resources=kernel.resources, kernel_mix=function.mix(),
        loop=loop, loop_mix=function.mix(loop) if loop is not None else None, loops=loops,
        occupancy=occ, prediction=prediction, emulated=emulated,
    )
