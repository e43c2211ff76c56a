"""The one launch seam: a kernel, a shape and tensors become a launch, through the family.

Everything that runs a generated kernel goes through here or through the family's own
packing: the torch API's hot path packs with ``families.fwd.args`` (the same grid and
argument order, built without dataclasses); verification (``verify``), the tuner's timing
(``prepare``, then the bound launch repeated with nothing converted inside the timed
interval), the cost model's emulated counters and the benchmarks use ``prepare``. So the
tuner measures exactly what users run.

``verify`` draws fresh random inputs (a fresh seed unless one is given, to replay), fills
every output with NaN before the launch (an element the kernel never writes is caught) and
compares with the family's float64 reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashtune import families
from flashtune.codegen.spec import KernelConfig, Problem, Shape
from flashtune.families.base import Inputs, KernelFamily, LaunchPlan, Verdict
from flashtune.runtime.backends.base import LoadedKernel


@dataclass(frozen=True)
class PreparedLaunch:
    """One kernel over fixed inputs and outputs; ``run()`` enqueues it (again).

    The launch owns its tensors: keep the PreparedLaunch (or its bound ``run``) alive while
    the kernel may still be running, since the packed arguments are raw pointers into them.
    """

    family: KernelFamily
    problem: Problem
    config: KernelConfig
    shape: Shape
    inputs: Inputs
    outputs: dict[str, torch.Tensor]
    plan: LaunchPlan
    bound: Callable[[], None]

    def run(self) -> None:
        """Enqueue the kernel (a method, so that a held ``run`` keeps the tensors alive)."""
        self.bound()

    def verdict(self) -> Verdict:
        """Compare the outputs of the launches so far with the float64 reference."""
        reference = self.family.reference(self.problem, self.inputs)
        return self.family.compare(self.problem, self.shape, self.outputs, reference)


def prepare(kernel: LoadedKernel, shape: Shape, device: torch.device | str, *,
            inputs: Inputs | None = None, seed: int | None = None, poison: bool = False,
            stream: int = 0) -> PreparedLaunch:
    """Inputs (given, or fresh random ones of ``shape``), outputs (NaN-filled when
    ``poison``) and the bound launch of ``kernel`` over them; nothing is launched yet."""
    source = kernel.source
    family = families.of(source.problem)
    problem, config = source.problem, source.config
    if inputs is None:
        inputs = family.random_inputs(problem, shape, device, seed)
    inputs = family.bind(problem, config, inputs)
    outputs = family.empty_outputs(problem, shape, inputs, poison=poison)
    plan = family.launch_plan(problem, config, shape, inputs, outputs)
    bound = kernel.bind(plan.grid, plan.args, stream=stream)
    return PreparedLaunch(family, problem, config, shape, inputs, outputs, plan, bound)


def verify(kernel: LoadedKernel, shape: Shape, device: torch.device | str, *,
           seed: int | None = None, stream: int = 0) -> Verdict:
    """Launch ``kernel`` once on fresh inputs (NaN-poisoned outputs) and compare."""
    launch = prepare(kernel, shape, device, seed=seed, poison=True, stream=stream)
    launch.run()
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
    return launch.verdict()


def l2_flush_bytes(device: torch.device) -> int:
    """Bytes to overwrite between timed launches so that none of their data stays in L2:
    twice the device's L2 size, at least 64 MiB (the one rule of the tuner and benchmarks)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    l2 = int(getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0))
    return max(2 * l2, 64 << 20)
