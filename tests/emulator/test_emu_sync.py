"""Block barriers with exited threads, planted deadlocks (reported within seconds, naming the
kernel, block, warp and lanes), divergent barriers, hangs, and faults that must not take the
Python process down."""

from __future__ import annotations

import time

import numpy as np
import pytest

from flashtune.errors import EmulatorDeadlock, EmulatorError
from flashtune.runtime.backends.emulator import (
    EmulatedModule,
    LaunchOptions,
    Schedule,
    build_module,
    i32,
    ptr,
)

pytestmark = pytest.mark.emulator

SOURCE = r"""
#include <stdexcept>

// Threads below `nexit` return at once; the others exchange values through shared memory
// across two barriers.
extern "C" __global__ void barrier_exit(int* out, int nexit) {
  FT_DYNAMIC_SMEM(int, s);
  int t = threadIdx.x, n = blockDim.x;
  if (t < nexit) return;
  s[t] = t * 3 + 1;
  __syncthreads();
  int v = s[nexit + (t - nexit + 1) % (n - nexit)];
  __syncthreads();
  s[t] = v;
  __syncthreads();
  out[t] = s[t];
}

extern "C" __global__ void deadlock(float* out, int mode) {
  FT_DYNAMIC_SMEM(unsigned char, smem);
  int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  float v = static_cast<float>(t);
  if (mode == 1) {  // lane 0 of warp 1 skips a shuffle its warp-mates wait in
    if (!(warp == 1 && lane == 0)) v += __shfl_xor_sync(0xffffffffu, v, 1);
    __syncthreads();
  } else if (mode == 2) {  // half of warp 0 returns before an mma
    if (warp == 0 && lane >= 16) return;
    unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    float c[4] = {0, 0, 0, 0}, d[4];
    ft::mma_m16n8k16_f16(d, a, b, c);
    v = d[0];
  } else if (mode == 3) {  // the two warps reach different __syncthreads calls
    if (warp == 0) __syncthreads();
    else __syncthreads();
  } else if (mode == 4) {  // lane 5 returns while its warp waits in ldmatrix
    for (int i = t; i < 512; i += blockDim.x) smem[i] = 0;
    __syncthreads();
    if (t == 5) return;
    unsigned r[4];
    ft::ldmatrix_x4(r, smem + (lane % 32) * 16);
    v = static_cast<float>(r[0]);
  } else if (mode == 5) {  // a __syncwarp naming lane 16, which waits at a barrier instead
    if (lane < 16) __syncwarp(0x0001ffffu);
    __syncthreads();
  }
  out[t] = v;
}

// Thread 3 spins on a flag nobody sets.
extern "C" __global__ void spin(volatile int* flag) {
  if (threadIdx.x == 3) while (flag[0] == 0) {}
}

__device__ int recurse(int n) {
  volatile char pad[512];
  pad[0] = static_cast<char>(n);
  return recurse(n + 1) + pad[0];
}

extern "C" __global__ void crash(int* p, int mode, int zero) {
  FT_DYNAMIC_SMEM(unsigned char, smem);
  if (threadIdx.x != 7) return;
  switch (mode) {
    case 1: p[0] = 1; break;                            // null pointer store
    case 2: p[0] = 100 / zero; break;                   // integer division by zero
    case 3: p[0] = recurse(zero); break;                // stack overflow
    case 4: smem[zero + 4096 + 17] = 1; break;          // far past the end: guard page
    case 5: smem[zero + 250 + 3] = 1; break;            // just past the end (250 bytes)
    case 6: throw std::runtime_error("host-only code");  // cannot happen on a GPU
  }
}
"""


@pytest.fixture(scope="module")
def module() -> EmulatedModule:
    return build_module(SOURCE, ["barrier_exit", "deadlock", "spin", "crash"])


@pytest.mark.parametrize("schedule", [Schedule.FORWARD, Schedule.REVERSE])
@pytest.mark.parametrize("nexit", [0, 1, 40, 95])
def test_barrier_ignores_exited_threads(module: EmulatedModule, nexit: int,
                                        schedule: Schedule) -> None:
    n = 96
    out = np.full(n, -1, dtype=np.int32)
    module["barrier_exit"].launch(2, n, [ptr(out), i32(nexit)], smem_bytes=4 * n,
                                  options=LaunchOptions(schedule=schedule))
    t = np.arange(nexit, n)
    np.testing.assert_array_equal(out[nexit:], (nexit + (t - nexit + 1) % (n - nexit)) * 3 + 1)
    assert (out[:nexit] == -1).all()


def _deadlock(module: EmulatedModule, mode: int, **opts: object) -> None:
    out = np.zeros(64, dtype=np.float32)
    module["deadlock"].launch((1, 2), 64, [ptr(out), i32(mode)], smem_bytes=512,
                              options=LaunchOptions(**opts))  # type: ignore[arg-type]


def test_planted_deadlock_is_reported_quickly(module: EmulatedModule) -> None:
    start = time.perf_counter()
    with pytest.raises(EmulatorDeadlock) as info:
        _deadlock(module, 1)
    assert time.perf_counter() - start < 5.0
    message = str(info.value)
    assert message.startswith("kernel deadlock: block (0,0,0): deadlock, no thread can make "
                              "progress (64 of 64 threads have not returned)")
    assert "warp 0: lanes 0-31 wait at __syncthreads (kernels.cu:" in message
    assert ("warp 1: lanes 0 wait at __syncthreads (kernels.cu:" in message
            or "warp 1: lanes 0 wait at __syncthreads" in message)
    assert ("lanes 1-31 wait in __shfl_xor_sync (mask 0xffffffff, lanes 1-31 arrived) at "
            "kernels.cu:" in message)


def test_mma_with_returned_lanes_is_a_deadlock(module: EmulatedModule) -> None:
    with pytest.raises(EmulatorDeadlock,
                       match=r"kernel deadlock: block \(0,0,0\), thread \(\d+,0,0\) \[warp 0, "
                             r"lane \d+\]: mma_m16n8k16_f16 at kernels.cu:\d+ needs all 32 "
                             r"lanes of warp 0, but lanes 16-31 have returned"):
        _deadlock(module, 2, schedule=Schedule.REVERSE)
    with pytest.raises(EmulatorDeadlock, match=r"lane 16 of warp 0 returned while lanes 0-15 "
                                               r"wait in mma_m16n8k16_f16"):
        _deadlock(module, 2, schedule=Schedule.FORWARD)


def test_divergent_barrier_sites(module: EmulatedModule) -> None:
    with pytest.raises(EmulatorError, match=r"__syncthreads at kernels.cu:\d+, while the threads "
                                            r"already waiting \(warp 0 lanes 0-31\) reached the "
                                            r"one at kernels.cu:\d+"):
        _deadlock(module, 3)
    _deadlock(module, 3, check_barrier_site=False)  # the hardware counts any bar.sync 0


def test_lane_returning_during_a_collective(module: EmulatedModule) -> None:
    with pytest.raises(EmulatorDeadlock, match=r"lane 5 of warp 0 returned while lanes 0-4 wait "
                                               r"in ldmatrix_x4 \(mask 0xffffffff"):
        _deadlock(module, 4)


def test_syncwarp_waiting_for_a_lane_that_never_comes(module: EmulatedModule) -> None:
    with pytest.raises(EmulatorDeadlock,
                       match=r"warp 0: lanes 0-15 wait in __syncwarp \(mask 0x0001ffff, lanes "
                             r"0-15 arrived\)"):
        _deadlock(module, 5)


def test_spinning_thread_is_reported_as_a_hang(module: EmulatedModule) -> None:
    flag = np.zeros(1, dtype=np.int32)
    start = time.perf_counter()
    with pytest.raises(EmulatorDeadlock, match=r"thread \(3,0,0\) .* no progress for 0.5 s"):
        module["spin"].launch(1, 32, [ptr(flag)], options=LaunchOptions(hang_timeout_s=0.5))
    assert time.perf_counter() - start < 5.0
    flag[0] = 1
    module["spin"].launch(1, 32, [ptr(flag)])  # the runtime is usable afterwards


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (1, r"thread \(7,0,0\) .*invalid memory access at address (0x0|\(nil\)) \(SIGSEGV\)"),
        (2, r"arithmetic exception \(SIGFPE"),
        (3, r"stack overflow of the emulated thread"),
        (4, r"shared memory access out of bounds: byte offset 4113 of the 256-byte dynamic"),
        (5, r"stored to shared memory out of bounds, at byte offset 253 of the 250-byte"),
        (6, r"C\+\+ exception escaped the kernel: host-only code"),
    ],
    ids=["null-store", "div-by-zero", "stack-overflow", "smem-guard-page", "smem-slack",
         "exception"],
)
def test_faults_do_not_kill_the_process(module: EmulatedModule, mode: int, message: str) -> None:
    smem = 250 if mode == 5 else 256
    with pytest.raises(EmulatorError, match=message):
        module["crash"].launch(1, 32, [(ptr(np.zeros(1))[0], 0), i32(mode), i32(0)],
                               smem_bytes=smem)
    out = np.zeros(1, dtype=np.int32)
    module["crash"].launch(1, 32, [ptr(out), i32(1), i32(0)])
    assert out[0] == 1
