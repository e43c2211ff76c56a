"""The measurement backends that ship: the GPU and the dry run (NVRTC + CPU emulator).

``gpu_backend()`` measures on the current CUDA device (TuningError without one, saying
how to do a dry run instead); ``dry_run_backend("sm_90")`` compiles for the named arch and
verifies in the emulator, untimed. Both compile with ``NvrtcCompiler``, which runs in the
tuner's process pool and fills the kernel cache the launch path reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.db.records import DeviceRecord, TrialStatus, truncate_error
from flashtune.families import render
from flashtune.runtime.device import DeviceInfo
from flashtune.tuner.measure import CompileOutcome, MeasurementBackend


@dataclass(frozen=True)
class NvrtcCompiler:
    """Compiles a config for ``arch`` through the kernel cache (picklable)."""

    arch: str

    def __call__(self, problem: Problem, config: KernelConfig) -> CompileOutcome:
        from flashtune.runtime.compiler import CompileFailure, compile_or_fail

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


def gpu_backend(device_index: int | None = None) -> MeasurementBackend:
    """The CUDA device ``device_index`` (default: current) as a measurement backend."""
    from flashtune.tuner.cuda_backend import CudaMeasurement

    return CudaMeasurement(device_index)


def dry_run_backend(arch: str = "sm_90") -> MeasurementBackend:
    """NVRTC for ``arch`` plus emulator verification; never timed."""
    from flashtune.tuner.dry_backend import DryRunMeasurement

    return DryRunMeasurement(get_arch(arch).name)
