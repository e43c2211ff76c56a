"""What the measurers that ship (the GPU and the dry run) share: compile, identity, verify.

Both compile with ``NvrtcCompiler``, which runs in the tuner's process pool and fills the
kernel cache the launch path reads; ``device_record`` is a device's identity in the
database; ``check_kernel`` is the verification step, runtime.launch.verify's verdict as a typed
trial outcome (a wrong result is recorded as wrong_result and can never become a bucket's
best). The measurers themselves: ``cuda.CudaMeasurer`` and ``dry.DryRunMeasurer``, made by
name in ``factory.make_measurer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

from flashtune.codegen.spec import KernelConfig, Problem, Shape
from flashtune.db.records import DeviceRecord, TrialStatus, truncate_error
from flashtune.families import render
from flashtune.runtime.backends.base import LoadedKernel
from flashtune.runtime.device import DeviceInfo
from flashtune.tuner.measure.base import CompileOutcome, VerifyOutcome

if TYPE_CHECKING:  # torch stays out of the compile pool's processes, which import this
    import torch

    from flashtune.families.base import Verdict


@dataclass(frozen=True)
class NvrtcCompiler:
    """Compiles a config for ``arch`` through the kernel cache (picklable)."""

    arch: str

    def __call__(self, problem: Problem, config: KernelConfig) -> CompileOutcome:
        from flashtune.toolchain.compiler import CompileFailure, compile_or_fail

        outcome = compile_or_fail(render(problem, config), self.arch)
        if isinstance(outcome, CompileFailure):
            text = outcome.message + ("\n" + outcome.log if outcome.log else "")
            return CompileOutcome(TrialStatus.COMPILE_FAILED, error=truncate_error(text))
        res = outcome.resources
        return CompileOutcome(TrialStatus.OK, registers=res.registers,
                              spill_bytes=res.spill_stores, smem_bytes=res.smem_bytes)


def _version(value: str | None) -> str:
    return value if value else "none"


def _cupy_version() -> str:
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "none"


def device_record(info: DeviceInfo) -> DeviceRecord:
    """The database's identity of ``info``. A virtual device has no SM count or memory;
    it is stored with 1 of each (it never holds timed results, so nothing compares them)."""
    major, minor = info.compute_capability
    return DeviceRecord(
        name=info.name, cc_major=major, cc_minor=minor, sm_count=info.sm_count or 1,
        memory_bytes=info.total_memory or 1, driver_version=_version(info.driver_version),
        cuda_version=_version(info.runtime_version),
        nvrtc_version=_version(info.nvrtc_version), cupy_version=_cupy_version())


def outcome(verdict: Verdict) -> VerifyOutcome:
    if verdict.ok:
        return VerifyOutcome(TrialStatus.OK, max_abs_error=verdict.max_abs)
    finite = verdict.max_abs if verdict.max_abs != float("inf") else None
    return VerifyOutcome(TrialStatus.WRONG_RESULT, max_abs_error=finite, error=verdict.message)


def check_kernel(kernel: LoadedKernel, shape: Shape, device: torch.device | str, *,
                 stream: int = 0) -> VerifyOutcome:
    """Launch ``kernel`` once on fresh inputs and compare with its family's reference."""
    from flashtune.runtime.launch import verify

    return outcome(verify(kernel, shape, device, stream=stream))
