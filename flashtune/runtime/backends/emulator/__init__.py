"""The CPU emulator: runs generated CUDA kernels on the host, strictly.

See include/flashtune_emu/runtime.h (the CUDA language on the host),
include/flashtune_emu/primitives.h (the primitives API) and include/flashtune_emu/src/*.cpp
(fibers, scheduler, warp collectives, shared-memory checks).
"""

from __future__ import annotations

from flashtune.runtime.backends.emulator.backend import EmulatorBackend, EmulatorLoadedKernel
from flashtune.runtime.backends.emulator.kernel import (
    Arg,
    EmulatedKernel,
    EmulatedModule,
    LaunchOptions,
    Schedule,
    build_module,
    build_source,
    f32,
    i32,
    i64,
    ptr,
)

__all__ = [
    "Arg",
    "EmulatedKernel",
    "EmulatedModule",
    "EmulatorBackend",
    "EmulatorLoadedKernel",
    "LaunchOptions",
    "Schedule",
    "build_module",
    "build_source",
    "f32",
    "i32",
    "i64",
    "ptr",
]
