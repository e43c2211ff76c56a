"""The cost model's key tiles under a sliding window (perf.model.algorithm.block_tiles): the
tiles each query block walks and masks, against a brute-force count over the visible
(row, key) pairs and against the forward kernel itself in the emulator (its per-block MMA
count and its cp.async bytes); and the prediction charges only the walked tiles."""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest

from flashtune import families
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families.base import Inputs, timing_window
from flashtune.perf.model.algorithm import Window, block_tiles
from flashtune.perf.model.costmodel import predict
from flashtune.perf.model.emulated import algorithm_read_bytes
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions
from flashtune.runtime.launch import prepare

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
WINDOWED = Problem(64, DType.FP16, window=True)


def _visible(nq: int, nk: int, window: Window) -> np.ndarray:
    """(Nq, Nk + padding) bools: row i sees key j (flash-attn's local rule, bottom-right)."""
    left, right = window
    rows, keys = np.arange(nq)[:, None], np.arange(nk)[None, :]
    seen = np.ones((nq, nk), dtype=bool)
    if left >= 0:
        seen &= keys >= rows + nk - nq - left
    if right >= 0:
        seen &= keys <= rows + nk - nq + right
    return seen


def _brute(nq: int, nk: int, bm: int, bn: int, window: Window) -> list[tuple[int, int, int]]:
    """(low, high, masked) per query block: the tiles from the first to the last one holding
    a key some row sees; masked: those holding a key some row does not see (or past Nk),
    and always the first step's (the top tile)."""
    seen = _visible(nq, nk, window)
    out = []
    for m in range(math.ceil(nq / bm)):
        block = seen[m * bm:(m + 1) * bm]
        cols = np.nonzero(block.any(axis=0))[0]
        if cols.size == 0:
            out.append((0, 0, 0))
            continue
        low, high = cols[0] // bn, math.ceil((cols[-1] + 1) / bn)
        masked = 1 + sum(1 for t in range(low, high - 1)
                         if (t + 1) * bn > nk or not block[:, t * bn:(t + 1) * bn].all())
        out.append((int(low), int(high), masked))
    return out


def _cases(count: int, seed: int) -> list[tuple[int, int, int, int, Window]]:
    rng = random.Random(seed)
    sizes = (-1, 0, 1, 5, 16, 63, 64, 100, 257)
    return [(rng.randrange(1, 600), rng.randrange(1, 600), rng.choice((16, 32, 64, 128)),
             rng.choice((16, 32, 64, 128)), (rng.choice(sizes), rng.choice(sizes)))
            for _ in range(count)]


@pytest.mark.parametrize("seed", [SEED])
def test_window_tiles_match_a_brute_force_count(seed: int) -> None:
    for nq, nk, bm, bn, window in _cases(200, seed):
        got = [(b.low, b.high, b.masked) for b in block_tiles(
            WINDOWED, KernelConfig(bm, bn, 1, 1), Shape(1, 1, 1, nq, nk), window)]
        assert got == _brute(nq, nk, bm, bn, window), (seed, nq, nk, bm, bn, window)


@pytest.mark.emulator
@pytest.mark.parametrize("seed", [SEED])
def test_the_kernel_walks_and_reads_the_modelled_tiles(seed: int) -> None:
    """The forward kernel in the emulator, with the window set: each block's MMA count is
    its walked tiles times one tile's MMAs, and its cp.async bytes are the model's."""
    rng = random.Random(f"{seed}-emulated")
    family = families.get("fwd")
    config = KernelConfig(64, 32, 4, 2)
    for _ in range(3):
        nq, nk = rng.randrange(70, 200), rng.randrange(70, 200)
        window = (rng.choice((0, 9, 40, 100)), rng.choice((-1, 0, 7, 33)))
        shape = Shape(1, 1, 1, nq, nk)
        kernel = EmulatorBackend(options=LaunchOptions(counters=True)).load(
            families.render(WINDOWED, config))
        drawn = family.random_inputs(WINDOWED, shape, "cpu")
        inputs = Inputs(drawn.tensors, {**drawn.scalars, "window_left": window[0],
                                        "window_right": window[1]})
        prepare(kernel, shape, "cpu", inputs=inputs, poison=True).run()
        counters = kernel.last_counters
        assert counters is not None
        walked = [b.count for b in block_tiles(WINDOWED, config, shape, window)]
        per_tile = 2 * config.block_m * config.block_n * 64 * 2 // (16 * 8 * 16 * 2)
        assert list(counters.block_mma) == [t * per_tile for t in walked], (nq, nk, window)
        assert counters.cp_async_bytes == algorithm_read_bytes(WINDOWED, config, shape,
                                                               window), (nq, nk, window)


def test_prediction_charges_the_walked_tiles_only() -> None:
    """A window of a quarter of 16k keys costs about a quarter of full attention's tile
    time, and a wider window more; without sizes the model takes the timing window."""
    config, shape = KernelConfig(128, 64, 4, 2), Shape(1, 32, 32, 16384, 16384)
    full = predict(Problem(64, DType.FP16), config, shape, "H100").time_ms
    quarter = predict(WINDOWED, config, shape, "H100", window=(4096, 0)).time_ms
    half = predict(WINDOWED, config, shape, "H100", window=(8192, 0)).time_ms
    assert 0.2 * full < quarter < 0.4 * full and quarter < half < full
    assert timing_window(shape) == (4096, 0)
    assert predict(WINDOWED, config, shape, "H100").time_ms == quarter


@pytest.mark.parametrize("op", ["fwd", "bwd", "bwddet"])
def test_window_buckets_are_timed_with_the_timing_window(op: str) -> None:
    """A tuning run times a window problem with ``timing_window`` (what the model predicts),
    not with the random windows verification draws."""
    shape = Shape(2, 4, 2, 300, 1000)
    family = families.get(op)
    inputs = family.timing_inputs(Problem(64, DType.FP16, window=True), shape, "cpu")
    assert (inputs.scalars["window_left"], inputs.scalars["window_right"]) == (250, 0)
    plain = family.timing_inputs(Problem(64, DType.FP16), shape, "cpu")
    assert "window_left" not in plain.scalars
