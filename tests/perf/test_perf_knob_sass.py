"""What the forward template's structure knobs change in the compiled kernel (NVRTC, no
GPU): Q held in registers leaves the main loop's Q loads behind, __launch_bounds__
min-blocks caps the registers, a swizzled layout needs no more instructions than padding
beyond its few lane offsets, and every knob compiles for sm_80 and sm_90."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.perf.sass.disasm import sass_listing
from flashtune.perf.sass.loops import MainLoops, main_loops
from flashtune.toolchain.compiler import CompiledKernel, compile_source

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel"))
from knob_render import with_knobs  # noqa: E402

from flashtune.families import render  # noqa: E402

D128 = Problem(128, DType.BF16)
TILE = KernelConfig(128, 32, 4, 2)


def _compile(knobs: dict[str, int | str], arch: str = "sm_90", problem: Problem = D128,
             config: KernelConfig = TILE) -> tuple[CompiledKernel, MainLoops]:
    source = render(problem, with_knobs(config, knobs))
    kernel = compile_source(source, arch)
    return kernel, main_loops(sass_listing(kernel.cubin, arch).function(source.entry))


def test_q_in_registers_leaves_q_loads_out_of_the_loop(compile_cubin: object) -> None:
    _, plain = _compile({})
    _, in_regs = _compile({"qregs": 1})
    assert plain.unmasked is not None and in_regs.unmasked is not None
    # 2 m16 tiles x 8 k16 steps of Q fragments per tile, no longer loaded in the loop.
    assert plain.unmasked.mix["ldsm"] - in_regs.unmasked.mix["ldsm"] == 2 * 8
    assert in_regs.unmasked.mix["mma"] == plain.unmasked.mix["mma"]


def test_min_blocks_caps_registers(compile_cubin: object) -> None:
    kernel, _ = _compile({"minblocks": 3})
    assert kernel.resources.registers <= 65536 // (3 * TILE.threads)


def test_swizzle_costs_only_lane_offsets(compile_cubin: object) -> None:
    _, plain = _compile({})
    _, swizzled = _compile({"swizzle": 1})
    assert plain.unmasked is not None and swizzled.unmasked is not None
    # The same loads, MMAs and math; a few integer adds per tile for the offset variants.
    for cls in ("mma", "ldsm", "ldgsts", "mufu", "shfl", "bar"):
        assert swizzled.unmasked.mix[cls] == plain.unmasked.mix[cls], cls
    assert swizzled.unmasked.static <= plain.unmasked.static + 16


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("knobs", [
    {"swizzle": 1, "qregs": 1},
    {"pipeline": 1, "order": "headsinner"},
    {"persistent": 1, "order": "longest", "minblocks": 2},
], ids=["swizzle-qregs", "pipeline-headsinner", "persistent-longest"])
def test_knobs_compile(compile_cubin: object, arch: str,
                       knobs: dict[str, int | str]) -> None:
    problem = Problem(64, DType.FP16, causal=True)
    kernel, loops = _compile(knobs, arch, problem, KernelConfig(64, 48, 4, 2))
    assert kernel.resources.spill_bytes == 0
    assert loops.unmasked is not None
