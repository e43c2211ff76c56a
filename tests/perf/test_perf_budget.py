"""The forward kernel's loop budget (perf.sass.budget): classes, FA2's same-tile figures, and the
budget the issue sets: the unmasked loop of the 128 x 32 d128 tile on sm_90 at or below
FA2's 536 instructions per iteration per warp, and every default with a same-tile figure at
or below it."""

from __future__ import annotations

import pytest

from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.families import render
from flashtune.perf.sass.budget import (
    BUDGET_CLASSES,
    budget_classes,
    budget_row,
    default_problems,
    fa2_figure,
    reference_problems,
)
from flashtune.perf.sass.disasm import sass_listing
from flashtune.perf.sass.loops import main_loops
from flashtune.perf.sass.parse import Instruction, InstructionMix
from flashtune.toolchain.compiler import compile_source


def test_every_instruction_lands_in_one_class() -> None:
    mix = InstructionMix.of([
        Instruction(0, "HMMA.16816.F32.BF16", "R0, R4, R8, R0"),
        Instruction(0x10, "FMNMX", "R1, R2, R3, !PT"),
        Instruction(0x20, "IMAD.MOV.U32", "R1, RZ, RZ, R2"),
        Instruction(0x30, "LDGSTS.E.BYPASS.128", "[R1], desc[UR4][R2.64]"),
        Instruction(0x40, "VOTE.ANY", "P0, P0"),
        Instruction(0x50, "FSEL", "R1, R1, -INF, P0"),
    ])
    classes = budget_classes(mix)
    assert set(classes) == set(BUDGET_CLASSES)
    assert sum(classes.values()) == mix.total == 6
    assert (classes["HMMA"], classes["FMNMX"], classes["int/addr/pred"], classes["LDGSTS"],
            classes["other"], classes["FSEL"]) == (1, 1, 1, 1, 1, 1)


def test_fa2_figures_match_only_the_same_tile() -> None:
    d128 = Problem(128, DType.BF16)
    figure = fa2_figure(d128, KernelConfig(128, 32, 4, 2), "sm_90")
    assert figure is not None and figure.instructions == 536
    figure = fa2_figure(d128, KernelConfig(128, 64, 4, 1), "sm_90")
    assert figure is not None and figure.instructions == 933
    assert fa2_figure(d128, KernelConfig(128, 32, 8, 2), "sm_90") is None  # other warps
    assert fa2_figure(d128, KernelConfig(128, 32, 4, 2), "sm_80") is None  # not measured
    assert fa2_figure(Problem(64, DType.BF16), KernelConfig(128, 32, 4, 2), "sm_90") is None


def test_default_problems_cover_both_masks_and_archs() -> None:
    rows = default_problems((64, 128), (DType.BF16,), ("sm_80", "sm_90"))
    assert len(rows) == 8
    assert {(p.head_dim, p.causal, a) for p, _, a in rows} == {
        (d, c, a) for d in (64, 128) for c in (False, True) for a in ("sm_80", "sm_90")}


def test_reference_problems_are_fa2_tiles_that_are_not_the_default() -> None:
    rows = reference_problems((64, 128), (DType.BF16,), ("sm_80", "sm_90"))
    assert rows and all(a == "sm_90" and p.head_dim == 128 for p, _, a in rows)
    defaults = default_problems((128,), (DType.BF16,), ("sm_90",))
    for problem, config, arch in rows:
        assert fa2_figure(problem, config, arch) is not None
        assert (problem, config, arch) not in defaults
    # 128 x 32 is the reference tile: listed unless it is the default
    tiles = {(p.causal, c.block_n) for p, c, _ in rows + defaults if c.block_m == 128
             and c.num_warps == 4}
    assert {(False, 32), (True, 32)} <= tiles


def test_every_d128_default_on_sm_90_with_a_fa2_figure_is_within_it(
        compile_cubin: object) -> None:
    for problem, config, arch in default_problems((128,), (DType.BF16,), ("sm_90",)):
        source = render(problem, config)
        kernel = compile_source(source, arch)
        loops = main_loops(sass_listing(kernel.cubin, arch).function(source.entry))
        row = budget_row(problem, config, arch, loops)
        assert row.ratio is None or row.ratio <= 1.0, row.to_dict()


@pytest.mark.parametrize("causal", [False, True])
def test_reference_d128_tile_on_sm_90_is_within_fa2_budget(compile_cubin: object,
                                                         causal: bool) -> None:
    problem = Problem(128, DType.BF16, causal=causal)
    config = KernelConfig(128, 32, 4, 2)
    source = render(problem, config)
    kernel = compile_source(source, "sm_90")
    loops = main_loops(sass_listing(kernel.cubin, "sm_90").function(source.entry))
    row = budget_row(problem, config, "sm_90", loops)
    assert row.unmasked is not None and row.fa2 is not None
    assert row.ratio is not None and row.ratio <= 1.0, row.to_dict()
    classes = budget_classes(row.unmasked.mix)
    # The lean loop: no mask or guard selects, one barrier, the int budget.
    assert classes["FSEL"] == 0 and classes["BAR"] == 1
    assert classes["int/addr/pred"] <= 30
    # The vote skips the O rescale: 2 m16 tiles x 16 n8 tiles x 4 elements.
    assert row.unmasked.static - row.unmasked.executed_min == 128
    # Causal: the tiles across the diagonal run in their own loop (128 rows > 2 x 32 keys).
    assert (row.masked is not None) == causal
