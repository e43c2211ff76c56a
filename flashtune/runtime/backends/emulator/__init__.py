"""The CPU emulator: runs generated CUDA kernels on the host, strictly.

A kernel source is compiled by the host C++ compiler (C++20) together with
``include/flashtune_emu/runtime.h`` (the CUDA language on the host) and
``primitives.h`` (the flashtune primitives API), and linked against the emulator runtime
(``include/flashtune_emu/src``: fibers, scheduler, warp collectives, shared-memory checks),
which is built once per toolchain. Both are cached by content in ArtifactCache.

Execution: blocks run one after another on the calling thread (in linear order, or in a
seeded shuffled order with ``LaunchOptions(block_order_seed=...)`` so that results that
depend on the order of blocks show it), each thread of a block is a fiber. A fiber runs
until it blocks at ``__syncthreads`` (a rendezvous of the block's threads that have not
returned) or in a warp collective (a rendezvous of the lanes named
in its mask; mma and ldmatrix need all 32; the last lane to arrive computes the result
with the PTX register layouts). ``Schedule.FORWARD`` runs the lowest runnable thread next,
``REVERSE`` the highest, so races between warps show in one order or the other.

What is detected (EmulatorError unless noted):

* deadlocks (EmulatorDeadlock), at once: no thread can run but some have not returned; the
  message names the kernel, block, and per warp the lanes and what each waits in; also a
  full-warp collective some lanes of which returned, and a thread that runs for
  ``hang_timeout_s`` without reaching a barrier, collective or its end;
* divergence: lanes of one mask at different collectives, mma/ldmatrix lanes at different
  call sites, threads at different ``__syncthreads`` calls, masks naming missing lanes;
* shared memory holds a NaN poison (0xffa5 halves) at every block start; cp.async data
  lands only at a wait that covers its group (the destination holds poison until then) and
  is visible to other threads only after the next ``__syncthreads``: reading it earlier
  through ldmatrix is an error naming the copy, through a plain load it yields poison;
  mma operands that hold the poison are errors; overwriting a buffer another warp read
  since the last barrier (write-after-read), copies into memory in flight, and stores that
  race with copies are errors;
* mbarriers (sm_90 phases, arrivals and transaction counts; src/mbarrier.cpp): copies
  tracked by ``cp.async.mbarrier.arrive`` land, visible to every thread, when the phase
  completes; a wait that can never complete is a deadlock naming the barrier, its phase and
  the arrivals or transaction bytes it lacks; a waiter that falls a phase behind, arrivals
  beyond the init count, an init no ``__syncthreads`` published and plain stores over a
  barrier are errors;
* misaligned or out-of-bounds ldmatrix rows and cp.async destinations; plain accesses past
  the dynamic shared memory (guard pages, and a check of the alignment slack at block end);
* faults of kernel code (SIGSEGV, SIGBUS, SIGFPE, stack overflow) end the launch with an
  error instead of the process; with ``FLASHTUNE_EMULATOR_ASAN=1`` (in a process started
  with ``toolchain.asan_environment()``) global and shared out-of-bounds accesses are
  reported by AddressSanitizer.

Counters (``LaunchOptions(counters=True)``; the launch returns an ``EmulatorCounters``):
cp.async global bytes and 32-byte sectors per warp request, shared-memory bank conflicts of
ldmatrix and cp.async writes (overall and per call site), mma, shuffle and barrier counts and
mma per block; see ``counters.py``. Plain loads and stores are not counted.
"""

from __future__ import annotations

from flashtune.runtime.backends.emulator.backend import EmulatorBackend, EmulatorLoadedKernel
from flashtune.runtime.backends.emulator.counters import EmulatorCounters, SiteCounters
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
    "EmulatorCounters",
    "EmulatorBackend",
    "EmulatorLoadedKernel",
    "LaunchOptions",
    "Schedule",
    "SiteCounters",
    "build_module",
    "build_source",
    "f32",
    "i32",
    "i64",
    "ptr",
]
