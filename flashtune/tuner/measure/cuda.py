"""Measuring on a CUDA GPU: verification on the device, timing with CUDA events.

Timing follows the field's conventions (see the attention baselines reference): random
inputs (never zeros), ``warmup`` untimed launches, then ``repeats`` launches each bracketed
by CUDA events on the launch stream, with L2 flushed before each (a buffer twice the L2
size is overwritten outside the timed interval); the median is the result. A launch
failure that leaves the CUDA context unusable is recorded for its config and then stops the
worker with a TuningError (a new process is needed; ``--resume`` continues and never
retries the failed config).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from flashtune import families
from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.spec import KernelConfig, Problem, Shape
from flashtune.db.records import DeviceRecord
from flashtune.errors import DeviceError, TuningError
from flashtune.families import render
from flashtune.families.base import Inputs
from flashtune.runtime.backends.base import LoadedKernel
from flashtune.runtime.device import DeviceInfo
from flashtune.runtime.launch import l2_flush_bytes, prepare
from flashtune.tuner.measure.base import ShapeTiming, TimingPlan, VerifyOutcome
from flashtune.tuner.measure.common import NvrtcCompiler, check_kernel, device_record

NO_GPU = ("no CUDA GPU is available here, so `flashtune tune` cannot time kernels. Without a "
          "GPU, run `flashtune tune --dry-run --arch sm_90 ...` to compile and verify every "
          "candidate for that arch (untimed), and tune on the GPU machine later")

#: Timing inputs kept on the device (one bucket's shapes).
MAX_CACHED_INPUTS = 8


class CudaMeasurer:
    """Measurer on one CUDA device (default: torch's current device)."""

    def __init__(self, device_index: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise TuningError(NO_GPU)
        from flashtune.runtime.backends.cuda import CudaBackend

        self.index = torch.cuda.current_device() if device_index is None else device_index
        torch.cuda.set_device(self.index)
        self.torch_device = torch.device("cuda", self.index)
        self._info = DeviceInfo.current(self.index)
        self._device = device_record(self._info)
        self._loader = CudaBackend()
        self._compiler = NvrtcCompiler(self._info.arch)
        self._flush = torch.empty(l2_flush_bytes(self.torch_device), dtype=torch.uint8,
                                  device=self.torch_device)
        self._context_lost: str | None = None
        self._inputs: dict[tuple[Problem, Shape, str], Inputs] = {}

    @property
    def device(self) -> DeviceRecord:
        return self._device

    @property
    def arch(self) -> ArchSpec:
        return self._info.spec

    @property
    def timed(self) -> bool:
        return True

    @property
    def compiler(self) -> NvrtcCompiler:
        return self._compiler

    def _load(self, problem: Problem, config: KernelConfig) -> LoadedKernel:
        if self._context_lost is not None:
            raise TuningError(f"the CUDA context is unusable after {self._context_lost}; the "
                              "failure is recorded: rerun with --resume to continue")
        return self._loader.load(render(problem, config), self.index)

    def _stream(self) -> int:
        return int(torch.cuda.current_stream(self.torch_device).cuda_stream)

    def _guard(self, what: str, exc: BaseException) -> None:
        """After a failed launch: is the context still usable? Remember if not."""
        try:
            torch.cuda.synchronize(self.torch_device)
        except Exception:  # the error is sticky: every later CUDA call fails
            self._context_lost = f"{what} failed ({exc})"

    def verify(self, problem: Problem, config: KernelConfig, shape: Shape) -> VerifyOutcome:
        kernel = self._load(problem, config)
        try:
            return check_kernel(kernel, shape, self.torch_device, stream=self._stream())
        except (DeviceError, RuntimeError) as exc:
            self._guard(f"verifying {config.key()}", exc)
            if isinstance(exc, DeviceError):
                raise
            raise DeviceError(f"verifying {config.key()} failed on the device: {exc}") from exc

    def time(self, problem: Problem, config: KernelConfig, shapes: Sequence[Shape],
             plan: TimingPlan) -> list[ShapeTiming]:
        kernel = self._load(problem, config)
        try:
            return [self._time_shape(kernel, problem, config, s, plan) for s in shapes]
        except (DeviceError, RuntimeError) as exc:
            self._guard(f"timing {config.key()}", exc)
            if isinstance(exc, DeviceError):
                raise
            raise DeviceError(f"timing {config.key()} failed on the device: {exc}") from exc

    def _time_shape(self, kernel: LoadedKernel, problem: Problem, config: KernelConfig,
                    shape: Shape, plan: TimingPlan) -> ShapeTiming:
        key = (problem, shape, plan.shape_class)
        if key not in self._inputs:  # timing inputs do not depend on the config: draw once
            if len(self._inputs) >= MAX_CACHED_INPUTS:  # a new bucket: free the old ones
                self._inputs.clear()
            self._inputs[key] = families.of(problem).timing_inputs(
                problem, shape, self.torch_device, plan.shape_class)
        # Outputs, grid and arguments are made and converted once, outside the timed
        # interval: the events bracket the bound launch alone, as the torch API runs it.
        launch = prepare(kernel, shape, self.torch_device, inputs=self._inputs[key],
                         stream=self._stream()).run
        for _ in range(plan.warmup):
            launch()
        event = torch.cuda.Event
        starts = [event(enable_timing=True) for _ in range(plan.repeats)]  # type: ignore[no-untyped-call]
        ends = [event(enable_timing=True) for _ in range(plan.repeats)]  # type: ignore[no-untyped-call]
        for start, end in zip(starts, ends, strict=True):
            if plan.flush_l2:
                self._flush.zero_()
            start.record()
            launch()
            end.record()
        torch.cuda.synchronize(self.torch_device)
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
        return ShapeTiming(shape, statistics.median(times), times[0], times[-1], len(times))
