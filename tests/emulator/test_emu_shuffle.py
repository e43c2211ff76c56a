"""The shuffle family with width and mask, votes, and the ft:: shuffle wrappers, against a
Python model of PTX shfl.sync."""

from __future__ import annotations

import numpy as np
import pytest
from emu_helpers import shfl_expected

from flashtune.codegen.abi import ArgType
from flashtune.errors import EmulatorError
from flashtune.runtime.backends.emulator import Arg, EmulatedModule, build_module, i32, ptr

pytestmark = pytest.mark.emulator

MODES = ["idx", "up", "down", "xor"]


def u32(value: int) -> Arg:
    """An unsigned 32-bit argument (I32 accepts the full uint32 range for unsigned params)."""
    return (ArgType.I32, value)

SOURCE = r"""
// Lanes outside `mask` return at once; the others shuffle values[tid] with args[tid].
extern "C" __global__ void shfl(const unsigned* values, const int* args, unsigned* out, int mode,
                                unsigned mask, int width) {
  int t = threadIdx.x;
  if (!((mask >> (t & 31)) & 1u)) return;
  unsigned v = values[t];
  int a = args[t];
  unsigned r = 0;
  switch (mode) {
    case 0: r = __shfl_sync(mask, v, a, width); break;
    case 1: r = __shfl_up_sync(mask, v, static_cast<unsigned>(a), width); break;
    case 2: r = __shfl_down_sync(mask, v, static_cast<unsigned>(a), width); break;
    case 3: r = __shfl_xor_sync(mask, v, a, width); break;
  }
  out[t] = r;
}

// Two half-warps shuffle at the same time with disjoint masks at different call sites; a
// double and the ft:: float wrappers go through the same machinery.
extern "C" __global__ void mixed(const float* x, float* out, double* dout) {
  int lane = threadIdx.x;
  float r;
  if (lane < 16) r = __shfl_xor_sync(0x0000ffffu, x[lane], 1, 16);
  else r = __shfl_sync(0xffff0000u, x[lane], 3, 16);
  out[lane] = r;
  out[32 + lane] = ft::shfl_xor(x[lane], 2);
  out[64 + lane] = ft::shfl_xor_sync(0xffffffffu, x[lane], 5, 8);
  out[96 + lane] = ft::shfl_sync(0xffffffffu, x[lane], 31 - lane);
  dout[lane] = __shfl_down_sync(0xffffffffu, static_cast<double>(x[lane]) * 1e300, 1);
}

// Votes over the lanes in `mask` (the others return).
extern "C" __global__ void vote(const int* pred, unsigned* out, unsigned mask) {
  int lane = threadIdx.x;
  if (!((mask >> lane) & 1u)) return;
  out[lane * 3 + 0] = __ballot_sync(mask, pred[lane]);
  out[lane * 3 + 1] = __any_sync(mask, pred[lane]);
  out[lane * 3 + 2] = __all_sync(mask, pred[lane]);
}

// ft::vote_any over the full warp: once from one call site, once from two sites that split
// the warp by its own predicate (vote.sync is not .aligned: the sites meet in one vote).
extern "C" __global__ void ft_vote(const int* pred, unsigned* out) {
  int t = threadIdx.x;
  bool p = pred[t] != 0;
  out[2 * t] = ft::vote_any(p) ? 1u : 0u;
  bool r;
  if (p) r = ft::vote_any(true);
  else r = ft::vote_any(false);
  out[2 * t + 1] = r ? 1u : 0u;
}
"""


@pytest.fixture(scope="module")
def module() -> EmulatedModule:
    return build_module(SOURCE, ["shfl", "mixed", "vote", "ft_vote"])


def _shfl(module: EmulatedModule, mode: str, mask: int, width: int, args: np.ndarray,
          threads: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng()
    values = rng.integers(0, 1 << 32, size=threads, dtype=np.uint32)
    out = np.zeros(threads, dtype=np.uint32)
    module["shfl"].launch(1, threads, [ptr(values), ptr(args), ptr(out), i32(MODES.index(mode)),
                                       u32(mask), i32(width)])
    return values, out


@pytest.mark.parametrize("width", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("mode", MODES)
def test_full_warp_shuffles(module: EmulatedModule, mode: str, width: int) -> None:
    rng = np.random.default_rng()
    args = rng.integers(0, 40 if mode == "idx" else 32, size=64).astype(np.int32)
    values, out = _shfl(module, mode, 0xFFFFFFFF, width, args)
    for warp in range(2):
        lanes = slice(32 * warp, 32 * warp + 32)
        want = shfl_expected(mode, list(values[lanes]), list(args[lanes]), width, set(range(32)))
        assert [int(out[32 * warp + lane]) for lane in range(32)] == [want[i] for i in range(32)]


@pytest.mark.parametrize("width", [4, 16])
@pytest.mark.parametrize("mode", MODES)
def test_partial_mask_shuffles(module: EmulatedModule, mode: str, width: int) -> None:
    rng = np.random.default_rng()
    args = rng.integers(0, 32, size=32).astype(np.int32)
    values, out = _shfl(module, mode, 0x0000FFFF, width, args, threads=32)
    want = shfl_expected(mode, list(values), list(args), width, set(range(16)))
    assert [int(out[lane]) for lane in range(16)] == [want[i] for i in range(16)]


def test_xor_reads_earlier_segments_only(module: EmulatedModule) -> None:
    # width 16, lane mask 16: lanes 0-15 keep their value, lanes 16-31 read lanes 0-15 (PTX
    # shfl.bfly clamps only at the end of the caller's segment).
    args = np.full(32, 16, dtype=np.int32)
    values, out = _shfl(module, "xor", 0xFFFFFFFF, 16, args, threads=32)
    np.testing.assert_array_equal(out[:16], values[:16])
    np.testing.assert_array_equal(out[16:], values[:16])
    # With only lanes 16-31 taking part, that read names a lane outside the mask.
    with pytest.raises(EmulatorError, match=r"lane 16 \(warp 0\) reads lane 0, which does not "
                                            r"take part \(mask 0xffff0000"):
        _shfl(module, "xor", 0xFFFF0000, 16, args, threads=32)


def test_invalid_width_and_mask(module: EmulatedModule) -> None:
    args = np.zeros(32, dtype=np.int32)
    with pytest.raises(EmulatorError, match=r"__shfl_sync at .*width 3 is not a power of two"):
        _shfl(module, "idx", 0xFFFFFFFF, 3, args, threads=32)
    with pytest.raises(EmulatorError, match=r"mask 0xffffffff names lanes 16-31, which do not "
                                            r"exist \(the block has 16 threads\)"):
        _shfl(module, "idx", 0xFFFFFFFF, 32, args, threads=16)


def test_concurrent_half_warp_shuffles_and_wrappers(module: EmulatedModule) -> None:
    x = np.random.default_rng().standard_normal(32).astype(np.float32)
    out = np.zeros(128, dtype=np.float32)
    dout = np.zeros(32, dtype=np.float64)
    module["mixed"].launch(1, 32, [ptr(x), ptr(out), ptr(dout)])
    lanes = np.arange(32)
    np.testing.assert_array_equal(out[:16], x[lanes[:16] ^ 1])
    np.testing.assert_array_equal(out[16:32], x[np.full(16, 16 + 3)])
    np.testing.assert_array_equal(out[32:64], x[lanes ^ 2])
    np.testing.assert_array_equal(out[64:96], x[lanes ^ 5])
    np.testing.assert_array_equal(out[96:128], x[31 - lanes])
    want = np.where(lanes < 31, x[np.minimum(lanes + 1, 31)], x).astype(np.float64) * 1e300
    np.testing.assert_array_equal(dout, want)


@pytest.mark.parametrize("mask", [0xFFFFFFFF, 0x00F0F00F])
def test_votes(module: EmulatedModule, mask: int) -> None:
    pred = np.random.default_rng().integers(0, 2, size=32).astype(np.int32)
    out = np.zeros((32, 3), dtype=np.uint32)
    module["vote"].launch(1, 32, [ptr(pred), ptr(out), u32(mask)])
    lanes = [lane for lane in range(32) if mask >> lane & 1]
    ballot = sum(1 << lane for lane in lanes if pred[lane])
    for lane in lanes:
        assert list(out[lane]) == [ballot, int(ballot != 0),
                                   int(all(pred[x] for x in lanes))]


@pytest.mark.parametrize("pattern", ["random", "none", "one", "all"])
def test_ft_vote_any(module: EmulatedModule, pattern: str) -> None:
    rng = np.random.default_rng()
    pred = np.zeros(64, dtype=np.int32)
    if pattern == "random":
        pred = rng.integers(0, 2, size=64).astype(np.int32)
    elif pattern == "one":
        pred[int(rng.integers(32, 64))] = 1  # only one lane of the second warp
    elif pattern == "all":
        pred[:] = 1
    out = np.full((64, 2), 7, dtype=np.uint32)
    module["ft_vote"].launch(1, 64, [ptr(pred), ptr(out)])
    for warp in range(2):
        want = int(pred[32 * warp:32 * warp + 32].any())
        assert (out[32 * warp:32 * warp + 32] == want).all(), (pattern, warp, out[32 * warp:])
