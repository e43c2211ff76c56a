"""The global fp32 reduction primitive (``ft::atomic_add_f32``, red.global.add.f32) and the
seeded shuffled block order of the emulator.

The reduction rounds to nearest even and flushes subnormal inputs and results to zero of the
same sign, as the PTX ISA states for .add.f32 on global memory; every case below is checked
against NumPy float32 arithmetic with that flush applied. The block order is a permutation of
the grid drawn from the seed: every block runs exactly once, the same seed gives the same
order, different seeds give different orders, and order-dependent float sums show it.
"""

from __future__ import annotations

import numpy as np
import pytest

from flashtune.errors import InvalidInput
from flashtune.runtime.backends.emulator import (
    EmulatedModule,
    LaunchOptions,
    build_module,
    i32,
    ptr,
)

pytestmark = pytest.mark.emulator

SOURCE = r"""
#include "primitives.cuh"

// Thread t adds values[t] to *target[t] (targets may repeat: the adds then land in thread
// order, which the emulator makes deterministic within a block).
extern "C" __global__ void add_each(float* acc, const int* target, const float* values, int n) {
  const int t = static_cast<int>(threadIdx.x);
  if (t < n) ft::atomic_add_f32(acc + target[t], values[t]);
}

// Each block appends its linear index to `order` (the position comes from an integer
// counter) and adds `terms[block]` to one float sum.
extern "C" __global__ void record_order(unsigned* counter, unsigned* order, float* sum,
                                        const float* terms) {
  if (threadIdx.x != 0) return;
  const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  order[atomicAdd(counter, 1u)] = block;
  ft::atomic_add_f32(sum, terms[block]);
}
"""


@pytest.fixture(scope="module")
def module() -> EmulatedModule:
    from flashtune.codegen.render import templates_dir

    return build_module(SOURCE, ["add_each", "record_order"], include_dirs=[templates_dir()])


def _ftz(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    tiny = np.finfo(np.float32).tiny
    return np.where(np.abs(x) < tiny, np.copysign(np.float32(0), x), x).astype(np.float32)


def _expected(start: np.ndarray, target: np.ndarray, values: np.ndarray) -> np.ndarray:
    acc: np.ndarray = start.astype(np.float32).copy()
    for t, v in zip(target, values, strict=True):
        acc[t] = _ftz(_ftz(acc[t]) + _ftz(np.float32(v)))
    return acc


def _run_add(module: EmulatedModule, start: np.ndarray, target: list[int], values: list[float]
             ) -> np.ndarray:
    acc: np.ndarray = start.astype(np.float32).copy()
    tgt = np.asarray(target, dtype=np.int32)
    val = np.asarray(values, dtype=np.float32)
    module["add_each"].launch(1, 32, [ptr(acc), ptr(tgt), ptr(val), i32(len(target))])
    return acc


def _bits(x: np.ndarray) -> list[int]:
    return [int(b) for b in np.asarray(x, dtype=np.float32).view(np.uint32)]


def test_add_rounds_to_nearest_even(module: EmulatedModule) -> None:
    one = np.float32(1.0)
    half_ulp = np.float32(2.0 ** -24)
    start = np.array([1.0, 1.0 + 2.0 ** -23, 3.0, 0.0], dtype=np.float32)
    # 1 + half an ulp ties to 1 (even); 1+ulp + half an ulp ties up to 1+2ulp (even);
    # 3 + 1e-8 rounds back to 3; the 0.1s accumulate with float32 rounding at each step.
    target = [0, 1, 2, 3, 3, 3]
    values = [float(half_ulp), float(half_ulp), 1e-8, 0.1, 0.1, 0.1]
    got = _run_add(module, start, target, values)
    want = _expected(start, np.asarray(target), np.asarray(values, dtype=np.float32))
    assert _bits(got) == _bits(want)
    assert got[0] == one and got[1] == np.float32(1.0 + 2.0 ** -22)
    assert got[3] == np.float32(np.float32(np.float32(0.1) + np.float32(0.1)) + np.float32(0.1))


def test_add_flushes_subnormals_to_signed_zero(module: EmulatedModule) -> None:
    tiny = float(np.finfo(np.float32).tiny)  # smallest normal
    sub = tiny / 4  # a subnormal
    start = np.array([0.0, -0.0, sub, 1.0, 1.5 * tiny, -1.5 * tiny, 0.0, 0.0], dtype=np.float32)
    target = [0, 1, 2, 3, 4, 5, 6, 7]
    values = [sub, -sub, 0.0, sub, -tiny, tiny, float("inf"), float("nan")]
    got = _run_add(module, start, target, values)
    want = _expected(start, np.asarray(target), np.asarray(values, dtype=np.float32))
    assert _bits(got) == _bits(want)
    assert _bits(got[:2]) == _bits(np.array([0.0, -0.0], dtype=np.float32))  # input flushed
    assert got[2] == 0.0  # a subnormal already in memory is flushed too
    assert got[3] == 1.0
    # 1.5 tiny - tiny is subnormal: the result is flushed, keeping its sign.
    assert _bits(got[4:6]) == _bits(np.array([0.0, -0.0], dtype=np.float32))
    assert np.isposinf(got[6]) and np.isnan(got[7])


def test_many_adds_to_one_address_from_every_block_and_order(module: EmulatedModule) -> None:
    """Integers sum exactly in any order: every block's add lands once, whatever the order."""
    grid = (5, 3, 2)
    n = int(np.prod(grid))
    terms = np.arange(1, n + 1, dtype=np.float32)
    for seed in (None, 0, 1, 2**63 + 5):
        counter = np.zeros(1, dtype=np.uint32)
        order = np.full(n, 999, dtype=np.uint32)
        total = np.zeros(1, dtype=np.float32)
        module["record_order"].launch(grid, 32, [ptr(counter), ptr(order), ptr(total),
                                                 ptr(terms)],
                                      options=LaunchOptions(block_order_seed=seed))
        assert total[0] == n * (n + 1) / 2
        assert sorted(order.tolist()) == list(range(n)), "every block runs exactly once"
        if seed is None:
            assert order.tolist() == list(range(n)), "the default order is linear"


def _order(module: EmulatedModule, grid: tuple[int, int, int], seed: int | None,
           terms: np.ndarray) -> tuple[list[int], float]:
    n = int(np.prod(grid))
    counter = np.zeros(1, dtype=np.uint32)
    order = np.zeros(n, dtype=np.uint32)
    total = np.zeros(1, dtype=np.float32)
    module["record_order"].launch(grid, 32, [ptr(counter), ptr(order), ptr(total), ptr(terms)],
                                  options=LaunchOptions(block_order_seed=seed))
    return order.tolist(), float(total[0])


def test_a_seed_names_one_order_and_order_dependent_sums_show_it(
        module: EmulatedModule) -> None:
    grid = (16, 2, 1)
    rng = np.random.default_rng(7)
    # Terms of very different magnitudes: their float32 sum depends on the order.
    terms = (rng.standard_normal(32) * 10.0 ** rng.integers(-4, 5, 32)).astype(np.float32)
    first, sum_a = _order(module, grid, 11, terms)
    again, sum_b = _order(module, grid, 11, terms)
    assert first == again and sum_a == sum_b, "one seed, one order"
    orders = {tuple(_order(module, grid, seed, terms)[0]) for seed in range(6)}
    assert len(orders) == 6, "different seeds give different orders"
    assert tuple(range(32)) not in orders
    sums = {_order(module, grid, seed, terms)[1] for seed in range(6)}
    assert len(sums) > 1, "a float sum over shuffled blocks depends on the order"
    for order_seed in range(6):
        order, total = _order(module, grid, order_seed, terms)
        # The sum is exactly the float32 sum in the recorded order.
        acc = np.float32(0)
        for block in order:
            acc = np.float32(acc + terms[block])
        assert total == acc


def test_block_order_seed_is_validated() -> None:
    for bad in (-1, 2**64, 1.5, True):
        with pytest.raises(InvalidInput, match="block_order_seed"):
            LaunchOptions(block_order_seed=bad)  # type: ignore[arg-type]
