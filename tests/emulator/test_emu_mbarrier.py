"""mbarrier in the emulator: a cp.async stage ring guarded by full/empty mbarriers (with
cp.async.mbarrier.arrive.noinc and try_wait.parity over several phases) and a barrier
completed by transaction bytes (arrive.expect_tx / complete_tx) copy their input exactly in
both thread orders; planted bugs are caught: a missing arrive is a deadlock that names the
barrier and phase, a missing wait reads in-flight data, a reused stage without the empty
wait, a transaction count that never reaches zero, an init nobody synchronised and a plain
store over a barrier. The same source compiles with NVRTC for sm_90."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from flashtune.codegen.render import included_headers, templates_dir
from flashtune.codegen.spec import DType, KernelConfig, KernelSource, Problem
from flashtune.errors import EmulatorDeadlock, EmulatorError
from flashtune.runtime.backends.emulator import (
    EmulatedModule,
    LaunchOptions,
    build_module,
    i32,
    ptr,
)
from flashtune.runtime.backends.emulator.kernel import Schedule
from flashtune.toolchain.compiler import compile_source

STAGES = 2
THREADS = 64

SOURCE = r"""
#include "mbarrier.cuh"

constexpr int kStages = 2;
constexpr int kTile = 256;  // floats per tile: 16 bytes per thread of 64

// src: tiles x 256 floats, copied to out through a ring of kStages shared buffers.
// bug: 0 none, 1 thread 5 skips its arrival on the full barrier of tile 1, 2 no wait on the
// full barrier, 3 no wait on the empty barrier before reusing a stage, 4 no __syncthreads
// after the init, 5 a plain store over a barrier.
extern "C" __global__ void ring(const float* src, float* out, int tiles, int bug) {
  FT_DYNAMIC_SMEM(unsigned char, smem);
  float* buf = reinterpret_cast<float*>(smem);
  auto* full = reinterpret_cast<unsigned long long*>(smem + kStages * kTile * 4);
  auto* empty = full + kStages;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      ft::mbarrier_init(&full[s], 64);
      ft::mbarrier_init(&empty[s], 64);
    }
    ft::mbarrier_init_fence();
    if (bug == 5) full[1] = 0;
  }
  if (bug != 4) __syncthreads();
  // parity 1 of a fresh barrier names the phase before the first: complete at once
  ft::mbarrier_wait_parity(&empty[0], 1);
  auto load = [&](int j) {
    ft::cp_async<16>(buf + (j % kStages) * kTile + tid * 4, src + j * kTile + tid * 4, 16);
    ft::cp_async_commit();
    if (!(bug == 1 && tid == 5 && j == 1)) ft::cp_async_mbarrier_arrive(&full[j % kStages]);
  };
  for (int j = 0; j < kStages && j < tiles; ++j) load(j);
  for (int j = 0; j < tiles; ++j) {
    const int s = j % kStages;
    const unsigned parity = (j / kStages) & 1;
    if (bug != 2) ft::mbarrier_wait_parity(&full[s], parity);
    for (int i = 0; i < 4; ++i)  // elements other threads copied
      out[j * kTile + tid + 64 * i] = buf[s * kTile + tid + 64 * i];
    ft::mbarrier_arrive(&empty[s]);
    if (j + kStages < tiles) {
      if (bug != 3) ft::mbarrier_wait_parity(&empty[s], parity);
      load(j + kStages);
    }
  }
}

// One phase completed by transaction bytes: thread 0 expects `expect` bytes and arrives
// (count 1); every thread stores 16 bytes and reports them with complete_tx.
extern "C" __global__ void tx(const float* src, float* out, int expect) {
  FT_DYNAMIC_SMEM(unsigned char, smem);
  float* buf = reinterpret_cast<float*>(smem);
  auto* bar = reinterpret_cast<unsigned long long*>(smem + kTile * 4);
  const int tid = threadIdx.x;
  if (tid == 0) {
    ft::mbarrier_init(bar, 1);
    ft::mbarrier_init_fence();
  }
  __syncthreads();
  if (tid == 0) ft::mbarrier_arrive_expect_tx(bar, static_cast<unsigned>(expect));
  for (int i = 0; i < 4; ++i) buf[tid * 4 + i] = src[tid * 4 + i];
  ft::mbarrier_complete_tx(bar, 16);
  ft::mbarrier_wait_parity(bar, 0);
  for (int i = 0; i < 4; ++i) out[tid + 64 * i] = buf[tid + 64 * i];
}
"""

ENTRIES = ("ring", "tx")
SMEM = STAGES * 1024 + 2 * STAGES * 8


@pytest.fixture(scope="module")
def module() -> EmulatedModule:
    return build_module(SOURCE, list(ENTRIES), include_dirs=[templates_dir()])


def _ring(module: EmulatedModule, tiles: int, bug: int, seed: int,
          schedule: Schedule = Schedule.FORWARD) -> tuple[np.ndarray, np.ndarray]:
    src = np.random.default_rng(seed).standard_normal(tiles * 256).astype(np.float32)
    out = np.full(tiles * 256, np.nan, dtype=np.float32)
    module["ring"].launch(1, THREADS, [ptr(src), ptr(out), i32(tiles), i32(bug)],
                          smem_bytes=SMEM, options=LaunchOptions(schedule=schedule))
    return src, out


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize("tiles", [1, 2, 7])
def test_ring_copies_exactly(module: EmulatedModule, tiles: int, schedule: Schedule) -> None:
    seed = int.from_bytes(hashlib.sha256(f"{tiles}{schedule}".encode()).digest()[:4], "big")
    src, out = _ring(module, tiles, 0, seed, schedule)
    assert np.array_equal(src, out), f"seed {seed}"


@pytest.mark.parametrize("schedule", list(Schedule))
def test_missing_arrive_is_a_deadlock_naming_barrier_and_phase(module: EmulatedModule,
                                                               schedule: Schedule) -> None:
    with pytest.raises(EmulatorDeadlock) as info:
        _ring(module, 5, 1, seed=1, schedule=schedule)
    text = str(info.value)
    # full[1] sits right after the two 1024-byte stages; its first phase never completes
    assert "mbarrier at dynamic shared memory offset 2056" in text, text
    assert "for phase 0 (parity 0) to complete: 1 of 64 arrivals missing" in text, text


def test_missing_full_wait_reads_data_in_flight(module: EmulatedModule) -> None:
    """The reads see poison; and a thread that never waits returns with the copies of its
    last arrival still in flight, which is an error of its own."""
    with pytest.raises(EmulatorError, match=r"thread \d+ returned with cp.async copies in "
                       r"flight .*tracked by cp.async_mbarrier_arrive on the mbarrier"):
        _ring(module, 3, 2, seed=2)


def test_stage_reused_without_the_empty_wait_is_caught(module: EmulatedModule) -> None:
    try:
        src, out = _ring(module, 5, 3, seed=3)
    except EmulatorError as exc:  # a phase run ahead of its waiters
        assert "fell a phase behind" in str(exc)
    else:
        assert not np.array_equal(src, out)


def test_init_without_block_barrier_is_an_error(module: EmulatedModule) -> None:
    with pytest.raises(EmulatorError, match="no __syncthreads since then"):
        _ring(module, 2, 4, seed=4)


def test_plain_store_over_a_barrier_is_an_error(module: EmulatedModule) -> None:
    with pytest.raises(EmulatorError, match="were overwritten"):
        _ring(module, 2, 5, seed=5)


def _tx(module: EmulatedModule, expect: int) -> tuple[np.ndarray, np.ndarray]:
    src = np.random.default_rng(6).standard_normal(256).astype(np.float32)
    out = np.full(256, np.nan, dtype=np.float32)
    module["tx"].launch(1, THREADS, [ptr(src), ptr(out), i32(expect)], smem_bytes=1024 + 8)
    return src, out


def test_transaction_bytes_complete_a_phase(module: EmulatedModule) -> None:
    src, out = _tx(module, 1024)
    assert np.array_equal(src, out)


def test_transaction_count_that_never_reaches_zero_is_a_deadlock(
        module: EmulatedModule) -> None:
    with pytest.raises(EmulatorDeadlock, match="0 of 1 arrivals missing, transaction count 16"):
        _tx(module, 1040)


def test_nvrtc_compiles_the_primitives_for_sm90() -> None:
    headers = included_headers(SOURCE)
    digest = hashlib.sha256(SOURCE.encode() + repr(sorted(headers.items())).encode()).hexdigest()
    source = KernelSource(problem=Problem(head_dim=64, dtype=DType.FP16),
                          config=KernelConfig(block_m=64, block_n=64, num_warps=2,
                                              num_stages=2),
                          code=SOURCE, entry="ring", headers=headers, options=("-std=c++17",),
                          digest=digest, smem_bytes=SMEM, threads=THREADS, target=None)
    kernel = compile_source(source, "sm_90")
    assert kernel.arch == "sm_90" and kernel.resources.spill_bytes == 0
