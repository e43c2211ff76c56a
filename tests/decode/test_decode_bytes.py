"""Decoding at the byte minimum, proved by the emulator's counters: with the tile raised to
cover a GQA group's packed rows (``space.covering_config``), every K/V element of a
sequence is read once per kv head for any group size (1-16) and query-row count (1-16),
page size (none, 1, 3, 16, 64, 256) and split count (one to many), and the group's Q rows
once per non-empty split; a call of one split writes O and LSE itself and launches no
combine. (At head dim 256 more than 128 packed rows stay in two row blocks: a 16-warp tile
has no registers for its accumulators.) A seeded sample runs by default, the whole grid
behind the sweep marker.

The combine reads each partial once: every partial LSE, and the partial O of every split
whose weight is not zero (an empty split's O is never read), counted by the emulator at the
combine's ``__ldg`` loads."""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
from dataclasses import dataclass
from typing import Any, cast

import pytest
import torch
from decode_cases import assert_close_to_float64
from sampling import seeded_part

import flashtune
from flashtune import families
from flashtune.api import decode as api_decode
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, Problem, Shape
from flashtune.families.combine import COMBINE
from flashtune.families.decode import DECODE, DecodeCase
from flashtune.families.decode.space import covering_config
from flashtune.families.decode.splits import split_range
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions
from flashtune.runtime.launch import prepare
from flashtune.runtime.plans import Plan

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
GROUPS = (1, 2, 3, 4, 8, 16)
SEQLEN_Q = (1, 2, 4, 7, 16)
PAGE_SIZES: tuple[int | None, ...] = (None, 1, 3, 16, 64, 256)
NUM_SPLITS = (1, 3, 16, 128)
DIM = 64
CAPACITY = 200


@dataclass(frozen=True)
class ByteCase:
    group: int
    seqlen_q: int
    page_size: int | None
    num_splits: int

    @property
    def key(self) -> str:
        page = "unpaged" if self.page_size is None else f"page{self.page_size}"
        return f"g{self.group}-q{self.seqlen_q}-{page}-s{self.num_splits}"

    @property
    def shape(self) -> Shape:
        heads_kv = 1 if self.group >= 8 else 2  # MQA for the large groups (emulator time)
        return Shape(2, self.group * heads_kv, heads_kv, self.seqlen_q, CAPACITY)


GRID = tuple(ByteCase(*c) for c in itertools.product(GROUPS, SEQLEN_Q, PAGE_SIZES, NUM_SPLITS))


def _sample(seed: int) -> list[ByteCase]:
    """One case per page size (packed rows that the default 64-row tile covers: its build is
    shared with the other decode tests), one of one split and one with more than 128
    packed rows (the 256-row tile), drawn with ``seed``."""
    rng = random.Random(seed)
    small = [c for c in GRID if c.group * c.seqlen_q <= 64]
    picked = [rng.choice([c for c in small if c.page_size == page]) for page in PAGE_SIZES]
    picked.append(rng.choice([c for c in small if c.num_splits == 1]))
    picked.append(rng.choice([c for c in GRID if c.group * c.seqlen_q > 128]))
    return picked


def _check_bytes(case: ByteCase) -> None:
    problem = Problem(DIM, DType.FP16, causal=False, op="decode")
    base = DECODE.default_config(problem, get_arch("sm_90"))
    rows = case.group * case.seqlen_q
    config = covering_config(problem, base, rows, get_arch("sm_90"))
    assert config.block_m >= rows, (config, rows)
    shape = case.shape
    rng = random.Random(f"{SEED}-{case.key}")
    probe = DecodeCase(case.page_size, (0, 0), 0, case.num_splits)
    room = probe.capacity(shape) - case.seqlen_q
    lengths = (room, rng.randrange(0, room))
    decode_case = DecodeCase(case.page_size, lengths, case.seqlen_q, case.num_splits)
    inputs = DECODE.random_inputs(problem, shape, "cpu", seed=rng.randrange(1 << 30),
                                  case=decode_case)
    kernel = EmulatorBackend(options=LaunchOptions(counters=True)).load(
        families.render(problem, config))
    launch = prepare(kernel, shape, "cpu", inputs=inputs, poison=True)
    launch.run()
    got = kernel.last_counters
    verdict = launch.verdict()
    assert got is not None and verdict.ok, verdict.message
    totals = [n + case.seqlen_q for n in lengths]
    nonempty = sum(1 for t in totals for s in range(case.num_splits)
                   if split_range(t, case.num_splits, s)[0] < split_range(t, case.num_splits, s)[1])
    elem = 2
    kv_bytes = 2 * shape.heads_kv * sum(totals) * DIM * elem
    q_bytes = shape.heads_q * case.seqlen_q * DIM * elem * nonempty
    assert got.cp_async_bytes == kv_bytes + q_bytes, (got.cp_async_bytes, kv_bytes, q_bytes)
    assert got.coalescing_efficiency == 1.0


@pytest.mark.emulator
@pytest.mark.parametrize("case", _sample(SEED + 7), ids=lambda c: c.key)
def test_kv_bytes_are_the_minimum_on_a_sample(case: ByteCase) -> None:
    _check_bytes(case)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("case", GRID, ids=lambda c: c.key)
def test_kv_bytes_are_the_minimum_on_the_grid(case: ByteCase) -> None:
    _check_bytes(case)


def test_covering_tiles_keep_rows_per_warp_and_fit() -> None:
    """The cover raises block_m to the next power of two >= rows, keeps 16 rows per warp
    (the registers per thread) and passes the static rules; a tile that covers stays."""
    problem = Problem(128, DType.BF16, causal=False, op="decode")
    for arch in ("sm_80", "sm_86", "sm_90"):
        base = DECODE.default_config(problem, get_arch(arch))
        assert covering_config(problem, base, base.block_m, get_arch(arch)) == base
        for rows in (65, 100, 128, 200, 256):
            got = covering_config(problem, base, rows, get_arch(arch))
            assert got.block_m == 1 << (rows - 1).bit_length()
            assert got.block_m // got.num_warps == base.block_m // base.num_warps
            assert DECODE.rules(problem, got, get_arch(arch)) is None


@pytest.mark.emulator
def test_one_split_writes_o_and_lse_without_the_combine(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """num_splits=1 launches the decode kernel alone (the combine plan is never launched),
    and its O and LSE match float64 attention, a row with no key included (O 0, LSE
    +inf: the first sequence is empty)."""
    problem = Problem(DIM, DType.BF16, causal=True, op="decode")
    shape = Shape(3, 8, 2, 3, 150)
    inputs = DECODE.random_inputs(problem, shape, "cpu", seed=SEED,
                                  case=DecodeCase(16, (0, 140, 57), 0, 1))
    launched: list[str] = []
    real_plan_for = api_decode.plan_for

    class Spy:
        """The combine kernel, counting its launches."""

        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def launch(self, *args: Any, **kwargs: Any) -> None:
            launched.append("combine")
            self.kernel.launch(*args, **kwargs)

    def counting_plan_for(*args: Any, **kwargs: Any) -> tuple[Plan, Plan]:
        decode, combine = real_plan_for(*args, **kwargs)
        return decode, dataclasses.replace(combine, kernel=cast(Any, Spy(combine.kernel)))

    monkeypatch.setattr(api_decode, "plan_for", counting_plan_for)
    t = inputs.tensors
    out, lse = flashtune.attention_with_kvcache(
        t["q"], t["k_cache"], t["v_cache"], t["cache_seqlens"], block_table=t["block_table"],
        causal=True, num_splits=1, return_lse=True, backend="emulator")
    assert launched == []
    assert torch.isinf(lse[0]).all() and (out[0] == 0).all()
    assert_close_to_float64(inputs, True, out, lse)
    two = flashtune.attention_with_kvcache(
        t["q"], t["k_cache"], t["v_cache"], t["cache_seqlens"], block_table=t["block_table"],
        causal=True, num_splits=2, return_lse=True, backend="emulator")
    assert launched == ["combine"]  # the spy sees the combine when there is one
    assert torch.equal(two[1][0], lse[0])


@pytest.mark.parametrize("arch, head_dim", seeded_part(
    [("sm_90", 64), ("sm_90", 128), ("sm_80", 128)], 1, "decode-bytes-nvrtc", several=True))
def test_the_largest_covering_tile_compiles_with_nvrtc_without_spills(arch: str,
                                                                      head_dim: int) -> None:
    """256 packed rows (group 16 x 16 query rows): 16 warps of 16 rows, narrow key tiles
    (one arch and head dim drawn with the run's seed, the others under -m sweep)."""
    from flashtune.toolchain.compiler import compile_source

    problem = Problem(head_dim, DType.BF16, causal=True, op="decode")
    config = covering_config(problem, DECODE.default_config(problem, get_arch(arch)), 256,
                             get_arch(arch))
    assert config.block_m == 256
    kernel = compile_source(families.render(problem, config), arch)
    assert kernel.resources.spill_bytes == 0 and kernel.resources.registers > 0


@pytest.mark.emulator
@pytest.mark.parametrize("num_splits", (1, 3, 33, 128))
@pytest.mark.parametrize("dim", (64, 256))
def test_the_combine_reads_each_partial_once(num_splits: int, dim: int) -> None:
    """Bytes the combine reads = every partial LSE once + the partial O of every non-empty
    split once (random partials, a third of the splits empty, some rows with none)."""
    problem = Problem(dim, DType.BF16, op="combine")
    shape = Shape(2, 4, 4, 3, 1)
    inputs = COMBINE.random_inputs(problem, shape, "cpu", seed=SEED + num_splits + dim,
                                   num_splits=num_splits)
    kernel = EmulatorBackend(options=LaunchOptions(counters=True)).load(
        families.render(problem, COMBINE.default_config(problem, get_arch("sm_80"))))
    launch = prepare(kernel, shape, "cpu", inputs=inputs, poison=True)
    launch.run()
    got = kernel.last_counters
    verdict = launch.verdict()
    assert got is not None and verdict.ok, verdict.message
    lse = inputs.tensors["lse_part"]
    nonempty = int(torch.isfinite(lse).sum())
    assert 0 < nonempty < lse.numel()
    assert got.ldg_bytes == 4 * lse.numel() + 4 * dim * nonempty, (got.ldg_bytes, nonempty)
    assert got.cp_async_bytes == 0
