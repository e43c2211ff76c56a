"""Dry runs without a GPU: NVRTC compiles for a named arch, the CPU emulator verifies.

Nothing here is timed: the emulator's speed says nothing about a GPU's, so results are
recorded as ``verified_untimed`` and can never become a bucket's best.
"""

from __future__ import annotations

from collections.abc import Sequence

from flashtune.codegen.arch import ArchSpec, get_arch
from flashtune.codegen.spec import KernelConfig, Problem, Shape
from flashtune.db.records import DeviceRecord
from flashtune.errors import TuningError
from flashtune.families import render
from flashtune.runtime.device import DeviceInfo
from flashtune.tuner.measure.base import ShapeTiming, TimingPlan, VerifyOutcome
from flashtune.tuner.measure.common import NvrtcCompiler, check_kernel, device_record


class DryRunMeasurer:
    """Measurer for a virtual device of ``arch`` (untimed)."""

    def __init__(self, arch: str) -> None:
        from flashtune.runtime.backends.emulator import EmulatorBackend

        self._arch = get_arch(arch)
        self._info = DeviceInfo.virtual(self._arch.name)
        self._device = device_record(self._info)
        self._emulator = EmulatorBackend()
        self._compiler = NvrtcCompiler(self._arch.name)

    @property
    def device(self) -> DeviceRecord:
        return self._device

    @property
    def arch(self) -> ArchSpec:
        return self._arch

    @property
    def timed(self) -> bool:
        return False

    @property
    def compiler(self) -> NvrtcCompiler:
        return self._compiler

    def verify(self, problem: Problem, config: KernelConfig, shape: Shape) -> VerifyOutcome:
        kernel = self._emulator.load(render(problem, config))
        return check_kernel(kernel, shape, "cpu")

    def time(self, problem: Problem, config: KernelConfig, shapes: Sequence[Shape],
             plan: TimingPlan) -> list[ShapeTiming]:
        raise TuningError("a dry run never times kernels: emulator timings mean nothing")
