"""The decoding test grid, after flash-attn's own kvcache tests: page sizes (none, 1, 4, 16,
128, 256), seqlen_q 1 to 16, per-sequence cache lengths (0, lengths that end mid-page, the
full capacity), MHA / GQA / MQA, causal (with seqlen_q > 1) or not, with and without
appended rows, 1 to 128 splits.

``GRID`` is the whole product (run behind the sweep marker); ``sample(seed, n)`` draws the
default run's cases from it. A case is turned into inputs by ``inputs_of``, with lengths
drawn from the case's own seed (always including a 0 and a full-capacity sequence when the
batch has room).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any

import torch

import flashtune
from flashtune import families
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families.base import Inputs, close_enough
from flashtune.families.checks import LSE_TOLERANCE, O_TOLERANCE
from flashtune.families.decode import DECODE, DecodeCase
from flashtune.families.decode.reference import attention_with_kvcache_reference
from flashtune.runtime.backends.emulator import (
    EmulatorBackend,
    EmulatorLoadedKernel,
    LaunchOptions,
)
from flashtune.runtime.launch import PreparedLaunch, prepare

PAGE_SIZES: tuple[int | None, ...] = (None, 1, 4, 16, 128, 256)
SEQLEN_Q = (1, 2, 4, 7, 16)
#: (heads_q, heads_kv): MHA, GQA (group 4), MQA (group 4 on one kv head), GQA group 8.
HEADS = ((2, 2), (8, 2), (4, 1), (8, 1))
NUM_SPLITS = (1, 2, 3, 16, 128)
#: Cache capacity per sequence (keys): small enough for the emulator, several pages deep.
CAPACITY = 300
BATCH = 3


@dataclass(frozen=True)
class GridCase:
    page_size: int | None
    seqlen_q: int
    heads: tuple[int, int]
    causal: bool
    append: bool
    num_splits: int
    seed: int

    @property
    def key(self) -> str:
        paged = "unpaged" if self.page_size is None else f"page{self.page_size}"
        mask = "causal" if self.causal else "full"
        new = "append" if self.append else "noappend"
        return (f"{paged}-q{self.seqlen_q}-h{self.heads[0]}x{self.heads[1]}-{mask}-{new}-"
                f"s{self.num_splits}")

    @property
    def shape(self) -> Shape:
        return Shape(BATCH, self.heads[0], self.heads[1], self.seqlen_q, CAPACITY)

    def decode_case(self) -> DecodeCase:
        """Lengths: one empty sequence, one at the full room, one drawn (mid-page)."""
        probe = DecodeCase(self.page_size, (0,) * BATCH, 0, self.num_splits)
        new = self.seqlen_q if self.append else 0
        room = probe.capacity(self.shape) - new
        drawn = random.Random(self.seed).randrange(1, room)
        page = self.page_size or 1
        if page > 1 and drawn % page == 0:
            drawn -= 1  # end mid-page
        return DecodeCase(self.page_size, (0, room, drawn), new, self.num_splits)


GRID: tuple[GridCase, ...] = tuple(
    GridCase(page, nq, heads, causal, append, splits, seed=i)
    for i, (page, nq, heads, causal, append, splits) in enumerate(itertools.product(
        PAGE_SIZES, SEQLEN_Q, HEADS, (False, True), (False, True), NUM_SPLITS))
    if not (causal and nq == 1)  # causal with one query row is the full mask
)


def sample(seed: int, n: int) -> list[GridCase]:
    """``n`` cases of the grid drawn with ``seed``, covering every page size and both masks
    at least once."""
    rng = random.Random(seed)
    picked: list[GridCase] = []
    for page in PAGE_SIZES:
        causal = len(picked) % 2 == 1
        picked.append(rng.choice([c for c in GRID if c.page_size == page
                                  and c.causal == causal]))
    rest = [c for c in GRID if c not in picked]
    picked += rng.sample(rest, max(0, n - len(picked)))
    return picked


def inputs_of(case: GridCase, problem: Problem, device: str = "cpu") -> Inputs:
    return DECODE.random_inputs(problem, case.shape, device, seed=case.seed,
                                case=case.decode_case())


def problem_of(case: GridCase, head_dim: int = 64, dtype: DType = DType.FP16) -> Problem:
    return Problem(head_dim, dtype, causal=case.causal, op="decode")


def call_api(inputs: Inputs, **kwargs: Any) -> Any:
    """flashtune.attention_with_kvcache on these inputs, with ``kwargs`` (causal, ...)."""
    t = inputs.tensors
    return flashtune.attention_with_kvcache(
        t["q"], t["k_cache"], t["v_cache"], t["cache_seqlens"], block_table=t.get("block_table"),
        k=t.get("k_new"), v=t.get("v_new"), **kwargs)


def assert_close_to_float64(inputs: Inputs, causal: bool, out: torch.Tensor,
                            lse: torch.Tensor) -> None:
    """The API's O and LSE against float64 attention over each sequence's keys."""
    ref_o, ref_lse = attention_with_kvcache_reference(inputs, causal)
    dtype = DType.FP16 if out.dtype == torch.float16 else DType.BF16
    for name, got, want, tol in (("O", out, ref_o, O_TOLERANCE[dtype]),
                                 ("LSE", lse, ref_lse, LSE_TOLERANCE)):
        _, _, wrong = close_enough(name, got, want, tol)
        assert not wrong, wrong


def run_emulated(problem: Problem, shape: Shape, inputs: Inputs, config: KernelConfig,
                 counters: bool = False) -> tuple[PreparedLaunch, EmulatorLoadedKernel]:
    """One launch of ``problem`` x ``config`` on ``inputs`` in the emulator, outputs poisoned
    with NaN (its verdict against float64 is ``launch.verdict()``; with ``counters``, the
    launch's counters are ``kernel.last_counters``)."""
    kernel = EmulatorBackend(options=LaunchOptions(counters=counters)).load(
        families.render(problem, config))
    launch = prepare(kernel, shape, "cpu", inputs=inputs, poison=True)
    launch.run()
    return launch, kernel
