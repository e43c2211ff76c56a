"""cp.async: a correct multi-stage pipeline passes in both schedules; broken ones (missing
wait, missing barrier, wait_group off by one, a prefetch that overwrites a buffer still being
read) are reported; zero fill, visibility between threads, and the address checks."""

from __future__ import annotations

import numpy as np
import pytest

from flashtune.errors import EmulatorError
from flashtune.runtime.backends.emulator import (
    EmulatedModule,
    LaunchOptions,
    Schedule,
    build_module,
    i32,
    ptr,
)

pytestmark = pytest.mark.emulator

OK, NO_WAIT, NO_BARRIER, WAIT_OFF_BY_ONE, PREFETCH_EARLY = range(5)
TILE_BYTES = 1024  # 32 rows x 16 halves

SOURCE = r"""
#include <cuda_fp16.h>

enum { OK, NO_WAIT, NO_BARRIER, WAIT_OFF_BY_ONE, PREFETCH_EARLY };

__device__ unsigned pack16(unsigned short lo, unsigned short hi) {
  return unsigned(lo) | unsigned(hi) << 16;
}

// Streams `tiles` tiles of 32x16 fp16 through a ring of STAGES shared buffers with cp.async
// (each of the 64 threads copies one scattered 16-byte chunk per tile); warp w multiplies rows
// 16w..16w+15 of each tile (ldmatrix x4) by the 16x8 matrix bmat into out[tile][w] (16x8).
template <int STAGES, int BUG>
__device__ void pipeline(const unsigned short* x, const unsigned short* bmat, float* out,
                         int tiles) {
  FT_DYNAMIC_SMEM(unsigned char, smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  auto load = [&](int t) {
    if (t < tiles) {
      int chunk = (tid * 5 + t) % 64;
      ft::cp_async<16>(smem + (t % STAGES) * 1024 + chunk * 16, x + t * 512 + chunk * 8, 16);
    }
    ft::cp_async_commit();
  };
  const int g = lane / 4, q = lane % 4;
  const unsigned b[2] = {pack16(bmat[(2 * q) * 8 + g], bmat[(2 * q + 1) * 8 + g]),
                         pack16(bmat[(2 * q + 8) * 8 + g], bmat[(2 * q + 9) * 8 + g])};
  for (int s = 0; s < STAGES - 1; ++s) load(s);
  for (int t = 0; t < tiles; ++t) {
    if (BUG == PREFETCH_EARLY) load(t + STAGES - 1);
    if (BUG == WAIT_OFF_BY_ONE) ft::cp_async_wait<STAGES - 1>();
    else if (BUG != NO_WAIT) ft::cp_async_wait<STAGES - 2>();
    if (BUG != NO_BARRIER) __syncthreads();
    if (BUG != PREFETCH_EARLY) load(t + STAGES - 1);
    const auto* tile = reinterpret_cast<const unsigned short*>(smem + (t % STAGES) * 1024);
    unsigned a[4];
    ft::ldmatrix_x4(a, tile + (warp * 16 + lane % 16) * 16 + (lane / 16) * 8);
    float z[4] = {0.f, 0.f, 0.f, 0.f}, d[4];
    ft::mma_m16n8k16_f16(d, a, b, z);
    float* o = out + (t * 2 + warp) * 128;
    o[g * 8 + 2 * q] = d[0];
    o[g * 8 + 2 * q + 1] = d[1];
    o[(g + 8) * 8 + 2 * q] = d[2];
    o[(g + 8) * 8 + 2 * q + 1] = d[3];
  }
  ft::cp_async_wait_all();
}

#define PIPE(S, B)                                                                          \
  extern "C" __global__ void pipe_##S##_##B(const unsigned short* x,                         \
                                            const unsigned short* bm, float* out, int n) {   \
    pipeline<S, B>(x, bm, out, n);                                                          \
  }
PIPE(2, 0) PIPE(3, 0) PIPE(4, 0) PIPE(2, 1) PIPE(2, 2) PIPE(3, 3) PIPE(3, 4)

// Thread t copies BYTES bytes from src + t * 16 (reading sizes[t] of them) into
// smem + t * 16; after wait_all and a barrier, thread 0 writes all of shared memory to out.
template <int BYTES>
__device__ void zfill(const unsigned char* src, const int* sizes, unsigned char* out, int n) {
  FT_DYNAMIC_SMEM(unsigned char, smem);
  int t = threadIdx.x;
  if (t < n) {
    ft::cp_async<BYTES>(smem + t * 16, sizes[t] ? src + t * 16 : nullptr, sizes[t]);
  }
  ft::cp_async_wait_all();
  __syncthreads();
  if (t == 0) for (int i = 0; i < n * 16; ++i) out[i] = smem[i];
}
#define ZFILL(B)                                                                   \
  extern "C" __global__ void zfill##B(const unsigned char* s, const int* z,         \
                                      unsigned char* o, int n) {                    \
    zfill<B>(s, z, o, n);                                                           \
  }
ZFILL(4) ZFILL(8) ZFILL(16)

// Thread 0 copies 4 floats into shared memory; a reader thread reads them with plain loads,
// mode 0: thread 32 without a barrier, 1: thread 32 after a barrier, 2: thread 0 itself
// right after its wait (no barrier needed).
extern "C" __global__ void visibility(const float* src, float* out, int mode) {
  FT_DYNAMIC_SMEM(float, s);
  int t = threadIdx.x;
  if (t == 0) {
    ft::cp_async<16>(s, src, 16);
    ft::cp_async_commit();
    ft::cp_async_wait<0>();
    if (mode == 2) for (int i = 0; i < 4; ++i) out[i] = s[i];
  }
  if (mode == 1) __syncthreads();
  if (t == 32 && mode != 2) for (int i = 0; i < 4; ++i) out[i] = s[i];
}

// Faults: 1 misaligned destination, 2 misaligned source, 3 destination in global memory,
// 4 src_bytes > 16, 5 a store into the destination of a copy in flight, 6 two threads
// copying into the same destination (thread 0 waits at a barrier first), 7 a destination
// past the end of shared memory.
extern "C" __global__ void faults(const unsigned char* src, unsigned char* gdst, int mode) {
  FT_DYNAMIC_SMEM(unsigned char, smem);
  int t = threadIdx.x;
  if (t != 0 && !(mode == 6 && t == 1)) return;
  switch (mode) {
    case 1: ft::cp_async<16>(smem + 8, src, 16); break;
    case 2: ft::cp_async<8>(smem, src + 4, 8); break;
    case 3: ft::cp_async<4>(gdst, src, 4); break;
    case 4: ft::cp_async<16>(smem, src, 20); break;
    case 5: ft::cp_async<16>(smem, src, 16); smem[3] = 1; break;
    case 6: ft::cp_async<16>(smem, src, 16); __syncthreads(); break;
    case 7: ft::cp_async<16>(smem + 256, src, 16); break;
  }
  ft::cp_async_wait_all();
}
"""

PIPES = ["pipe_2_0", "pipe_3_0", "pipe_4_0", "pipe_2_1", "pipe_2_2", "pipe_3_3", "pipe_3_4"]


@pytest.fixture(scope="module")
def module() -> EmulatedModule:
    return build_module(SOURCE, [*PIPES, "zfill4", "zfill8", "zfill16", "visibility", "faults"])


def _run_pipeline(module: EmulatedModule, stages: int, bug: int, schedule: Schedule,
                  tiles: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng()
    x = rng.standard_normal((tiles, 32, 16)).astype(np.float16)
    bmat = rng.standard_normal((16, 8)).astype(np.float16)
    out = np.full((tiles, 2, 16, 8), np.nan, dtype=np.float32)
    module[f"pipe_{stages}_{bug}"].launch(
        1, 64, [ptr(x.view(np.uint16)), ptr(bmat.view(np.uint16)), ptr(out), i32(tiles)],
        smem_bytes=stages * TILE_BYTES, options=LaunchOptions(schedule=schedule))
    expected = x.astype(np.float64).reshape(tiles, 2, 16, 16) @ bmat.astype(np.float64)
    return out, expected


SCHEDULES = [Schedule.FORWARD, Schedule.REVERSE]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_correct_pipeline_passes(module: EmulatedModule, stages: int,
                                 schedule: Schedule) -> None:
    out, expected = _run_pipeline(module, stages, OK, schedule)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(
    ("stages", "bug", "message"),
    [
        (2, NO_WAIT, r"ldmatrix_x4 .* whose cp.async \(issued by thread \d+ .*\) has not "
                     r"completed"),
        (2, NO_BARRIER, r"(no __syncthreads since that wait|holds the shared-memory poison)"),
        (3, WAIT_OFF_BY_ONE, r"has not completed: no cp_async_wait covering its group"),
        (3, PREFETCH_EARLY, r"(has not completed|write-after-read race)"),
    ],
    ids=["missing-wait", "missing-barrier", "wait-off-by-one", "prefetch-before-barrier"],
)
def test_broken_pipeline_is_detected(module: EmulatedModule, stages: int, bug: int,
                                     message: str, schedule: Schedule) -> None:
    with pytest.raises(EmulatorError, match=message):
        _run_pipeline(module, stages, bug, schedule)


@pytest.mark.parametrize("nbytes", [4, 8, 16])
def test_zero_fill_reads_only_src_bytes(module: EmulatedModule, nbytes: int) -> None:
    rng = np.random.default_rng()
    n = 32
    src = rng.integers(1, 256, size=n * 16, dtype=np.uint8)
    sizes = rng.integers(0, nbytes + 1, size=n).astype(np.int32)
    sizes[:2] = [0, nbytes]
    out = np.zeros(n * 16, dtype=np.uint8)
    module[f"zfill{nbytes}"].launch(1, 32, [ptr(src), ptr(sizes), ptr(out), i32(n)],
                                    smem_bytes=n * 16)
    for t in range(n):
        got = out[t * 16: t * 16 + nbytes]
        want = np.concatenate([src[t * 16: t * 16 + sizes[t]],
                               np.zeros(nbytes - sizes[t], np.uint8)])
        np.testing.assert_array_equal(got, want, err_msg=f"thread {t}, src_bytes {sizes[t]}")
        # Bytes past the copy were never written: they still hold the poison pattern.
        assert (out[t * 16 + nbytes: t * 16 + 16] != 0).all()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("mode", "visible"), [(0, False), (1, True), (2, True)],
                         ids=["other-thread-no-barrier", "after-barrier", "issuing-thread"])
def test_copied_data_is_visible_per_the_rules(module: EmulatedModule, mode: int, visible: bool,
                                              schedule: Schedule) -> None:
    src = np.random.default_rng().standard_normal(4).astype(np.float32)
    out = np.zeros(4, dtype=np.float32)
    module["visibility"].launch(1, 64, [ptr(src), ptr(out), i32(mode)], smem_bytes=64,
                                options=LaunchOptions(schedule=schedule))
    if visible:
        np.testing.assert_array_equal(out, src)
    else:
        assert np.isnan(out).all(), "a plain read without a barrier must see poison (NaN)"


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (1, r"cp_async<16> at .*destination dynamic shared memory offset 8 is not 16-byte "
            r"aligned"),
        (2, r"cp_async<8> at .*global source 0x[0-9a-f]+ is not 8-byte aligned"),
        (3, r"cp_async<4> at .*destination 0x[0-9a-f]+, which is not in this block's shared "
            r"memory"),
        (4, r"cp_async<16> at .*src_bytes=20 is outside \[0, 16\]"),
        (5, r"race: shared memory at dynamic shared memory offset 0 was stored to while the "
            r"cp.async into it .* was in flight"),
        (6, r"already the destination of a cp.async in flight \(issued by thread 0"),
        (7, r"offset 256 of the 256-byte dynamic shared memory \(out of bounds\)"),
    ],
)
def test_faults_are_reported(module: EmulatedModule, mode: int, message: str) -> None:
    src = np.zeros(64, dtype=np.uint8)
    gdst = np.zeros(64, dtype=np.uint8)
    with pytest.raises(EmulatorError, match=message):
        module["faults"].launch(1, 32, [ptr(src[16:]), ptr(gdst), i32(mode)], smem_bytes=256)
