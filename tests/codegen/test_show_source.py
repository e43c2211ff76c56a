"""`flashtune show` prints the exact CUDA source of a kernel: the rendered template with
every flashtune header inlined (the README's promise), a translation unit that NVRTC
compiles on its own to the same kernel; `--bindings` prints the template alone."""

from __future__ import annotations

import dataclasses
import hashlib
import re

import pytest
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.codegen.render import translation_unit
from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.families import render
from flashtune.toolchain.compiler import compile_source

runner = CliRunner()
_QUOTED = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def _unresolved(code: str) -> list[str]:
    """Quoted includes left in ``code``, except the emulator's own header (included only
    in the CPU build's FLASHTUNE_EMULATOR branch, which NVRTC never takes)."""
    return [name for name in _QUOTED.findall(code) if not name.startswith("flashtune_emu/")]


@pytest.mark.parametrize("args", [
    ["--head-dim", "128", "--dtype", "bf16", "--causal"],
    ["--op", "lse", "--head-dim", "64"],
    ["--op", "fwd90a", "--arch", "sm_90a", "--head-dim", "128"],
])
def test_show_prints_the_whole_translation_unit(args: list[str]) -> None:
    result = runner.invoke(app, ["show", *args])
    assert result.exit_code == 0, result.output
    code = result.stdout
    assert _unresolved(code) == []
    assert not re.search(r"^\s*#\s*pragma\s+once", code, re.MULTILINE)
    # the main loop's code is there, not only the bindings
    assert re.search(r"mma\.sync|wgmma\.mma_async|ldmatrix|__global__", code)
    bindings = runner.invoke(app, ["show", *args, "--bindings"]).stdout
    assert _unresolved(bindings) and len(bindings.splitlines()) < len(code.splitlines()) / 5
    assert code.startswith(bindings.split("#include")[0])  # same header comment first


def test_the_forward_includes_its_main_loop_and_each_header_once() -> None:
    source = render(Problem(128, DType.BF16, causal=True), KernelConfig(128, 64, 4, 2))
    code = translation_unit(source)
    assert "mma.sync.aligned.m16n8k16" in code and "ldmatrix" in code and "cp.async" in code
    for name in source.headers:
        assert code.count(f"// ===== begin {name} ") == 1, name
    # the header text itself, verbatim
    assert source.headers["fwd_mainloop.cuh"].split("namespace ft {", 1)[1][:400] in code


def test_the_translation_unit_compiles_alone_to_the_same_kernel() -> None:
    source = render(Problem(64, DType.FP16, causal=False), KernelConfig(64, 64, 4, 2))
    code = translation_unit(source)
    alone = dataclasses.replace(source, code=code, headers={},
                                digest=hashlib.sha256(code.encode()).hexdigest())
    original = compile_source(source, "sm_80").resources
    inlined = compile_source(alone, "sm_80").resources
    assert (inlined.registers, inlined.spill_bytes, inlined.static_smem) == (
        original.registers, original.spill_bytes, original.static_smem)
