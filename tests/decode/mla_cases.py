"""The MLA decode tests' grid and runner: one case is a dtype, page size (None: unpaged),
query rows (2 rows: causal among them), query heads and split count over three sequences of
uneven cache lengths, one of them empty; ``fp8_cache``: bf16 queries over FlashMLA's FP8
latent cache (``FP8_GRID``, ``fp8_sample``)."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.dtypes import Fp8Type
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families.base import Inputs, Tensors
from flashtune.families.decode import DecodeCase
from flashtune.families.mla import MLA, ROPE_DIM
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions
from flashtune.runtime.backends.emulator.counters import EmulatorCounters
from flashtune.runtime.launch import prepare

PAGE_SIZES: tuple[int | None, ...] = (None, 1, 3, 16, 64, 100, 256)
#: Page sizes only the sweep runs (the default sample draws from the rest).
SWEEP_PAGES = (100, 256)
SEQLEN_Q = (1, 2)
HEADS = (16, 32, 64, 128)
SPLITS = (1, 3)
DTYPES = (DType.BF16, DType.FP16)
#: Cache capacity per sequence: several 32-key tiles and pages of every size.
CAPACITY = 150


@dataclass(frozen=True)
class MlaCase:
    dtype: DType
    page_size: int | None
    seqlen_q: int
    heads: int
    num_splits: int
    fp8_cache: bool = False

    @property
    def key(self) -> str:
        page = "unpaged" if self.page_size is None else f"page{self.page_size}"
        kv = "-e4m3" if self.fp8_cache else ""
        return (f"{self.dtype.value}{kv}-{page}-q{self.seqlen_q}-h{self.heads}-"
                f"s{self.num_splits}")

    @property
    def causal(self) -> bool:
        return self.seqlen_q > 1

    @property
    def problem(self) -> Problem:
        return Problem(ROPE_DIM, self.dtype, causal=self.causal, op="mla",
                       kv_dtype=Fp8Type.E4M3 if self.fp8_cache else None)

    @property
    def shape(self) -> Shape:
        return Shape(3, self.heads, 1, self.seqlen_q, CAPACITY)

    def lengths(self, rng: random.Random) -> tuple[int, ...]:
        """Uneven cache lengths: the full capacity, one drawn below it (at least the query
        rows), and an empty cache."""
        return (CAPACITY, rng.randrange(self.seqlen_q, CAPACITY), 0)


GRID = tuple(MlaCase(*c) for c in itertools.product(DTYPES, PAGE_SIZES, SEQLEN_Q, HEADS,
                                                    SPLITS))
#: The FP8 latent cache's grid: bf16 queries (the format's RoPE part is bf16).
FP8_GRID = tuple(MlaCase(DType.BF16, *c, fp8_cache=True)
                 for c in itertools.product(PAGE_SIZES, SEQLEN_Q, HEADS, SPLITS))


def sample(seed: int) -> list[MlaCase]:
    """One case per default-run page size (unpaged, 1, 3, 16, 64), 16 or 32 heads, rows,
    splits and dtype drawn with ``seed``, covering both row counts, both head counts and both
    split counts."""
    rng = random.Random(seed)
    pages = [p for p in PAGE_SIZES if p not in SWEEP_PAGES]
    rows = [SEQLEN_Q[i % 2] for i in range(len(pages))]
    heads = [(16, 32)[i // 2 % 2] for i in range(len(pages))]
    splits = [SPLITS[(i + 1) % 2] for i in range(len(pages))]
    for values in (rows, heads, splits):
        rng.shuffle(values)
    return [MlaCase(rng.choice(DTYPES), p, r, h, s)
            for p, r, h, s in zip(pages, rows, heads, splits, strict=True)]


def fp8_sample(seed: int) -> list[MlaCase]:
    """``sample``'s page sizes, rows, heads and splits over an FP8 latent cache (bf16)."""
    return [MlaCase(DType.BF16, c.page_size, c.seqlen_q, c.heads, c.num_splits, True)
            for c in sample(seed)]


def run_case(case: MlaCase, seed: str, config: KernelConfig | None = None
             ) -> tuple[Inputs, Tensors, EmulatorCounters, KernelConfig]:
    """Run the case's default sm_90 config (or ``config``) in the emulator on fresh inputs
    drawn from ``seed``, outputs poisoned with NaN; the inputs, outputs and counters."""
    rng = random.Random(seed)
    problem = case.problem
    config = config or MLA.default_config(problem, get_arch("sm_90"))
    decode_case = DecodeCase(case.page_size, case.lengths(rng), 0, case.num_splits)
    inputs = MLA.random_inputs(problem, case.shape, "cpu", seed=rng.randrange(1 << 30),
                               case=decode_case)
    kernel = EmulatorBackend(options=LaunchOptions(counters=True)).load(
        families.render(problem, config))
    launch = prepare(kernel, case.shape, "cpu", inputs=inputs, poison=True)
    launch.run()
    assert kernel.last_counters is not None
    return inputs, launch.outputs, kernel.last_counters, config
