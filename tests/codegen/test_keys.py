"""Digests and compile keys: stable across processes, changed by anything that changes the
binary (template or header byte, option, arch, CUDA header, NVRTC version)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashtune.codegen import render as render_mod
from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.families import render
from flashtune.toolchain import compiler, nvrtc
from flashtune.toolchain.compiler import compile_key
from flashtune.toolchain.cuda import CUDA_HEADERS, Toolchain, find_toolchain

CASES = [
    (Problem(128, DType.FP16, causal=False), KernelConfig(128, 64, 4, 2), "sm_90"),
    (Problem(64, DType.BF16, causal=True), KernelConfig(64, 32, 4, 1), "sm_80"),
    (Problem(96, DType.BF16, causal=False), KernelConfig(128, 128, 8, 3), "sm_89"),
]

_CHILD = """
import json, sys
from flashtune.families import render
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.toolchain.compiler import compile_key
out = []
for pk, ck, arch in json.loads(sys.argv[1]):
    src = render(Problem.from_key(pk), KernelConfig.from_key(ck))
    out.append([src.digest, compile_key(src, arch)])
print(json.dumps(out))
"""


def _keys() -> list[list[str]]:
    out = []
    for problem, config, arch in CASES:
        src = render(problem, config)
        out.append([src.digest, compile_key(src, arch)])
    return out


def test_same_inputs_same_keys_across_processes() -> None:
    args = json.dumps([[p.key(), c.key(), a] for p, c, a in CASES])
    runs = [
        json.loads(subprocess.run([sys.executable, "-c", _CHILD, args], capture_output=True,
                                  text=True, check=True).stdout)
        for _ in range(2)
    ]
    here = _keys()
    assert runs[0] == runs[1] == here
    flat = [k for pair in here for k in pair]
    assert len(set(flat)) == len(flat)


def test_digest_covers_the_rendered_parameters() -> None:
    problem, config, _ = CASES[0]
    base = render(problem, config).digest
    assert render(problem, config).digest == base
    variants = [
        (Problem(128, DType.BF16), config),
        (Problem(128, DType.FP16, causal=True), config),
        (Problem(120, DType.FP16), config),
        (problem, KernelConfig(128, 64, 4, 3)),
        (problem, KernelConfig(128, 64, 8, 2)),
        (problem, KernelConfig(128, 32, 4, 2)),
    ]
    digests = {render(p, c).digest for p, c in variants}
    assert base not in digests and len(digests) == len(variants)


def _edit(path: Path, extra: str) -> None:
    with path.open("a") as f:
        f.write(extra)


def test_copied_templates_render_the_same(template_copy: Path) -> None:
    problem, config, arch = CASES[0]
    before = _keys()[0]
    src = render(problem, config)
    assert [src.digest, compile_key(src, arch)] == before


@pytest.mark.parametrize("target", ["flash_fwd.cu.jinja", "flash_fwd.cuh", "*included*"])
def test_a_template_or_header_byte_changes_the_keys(template_copy: Path, target: str) -> None:
    problem, config, arch = CASES[0]
    src = render(problem, config)
    if target == "*included*":
        # A header reached only through other headers: the deepest one of the include tree.
        nested = sorted(set(src.headers) - {"flash_fwd.cuh"})
        assert nested, "the kernel includes no nested flashtune header"
        target = nested[0]
    _edit(template_copy / target, "\n// flashtune key test\n")
    changed = render(problem, config)
    assert changed.digest != src.digest
    assert compile_key(changed, arch) != compile_key(src, arch)


def test_a_template_option_changes_the_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    problem, config, arch = CASES[0]
    src = render(problem, config)
    monkeypatch.setattr(render_mod, "COMPILE_OPTIONS", (*render_mod.COMPILE_OPTIONS, "-DX=1"))
    changed = render(problem, config)
    assert changed.options[-1] == "-DX=1"
    assert changed.digest != src.digest
    assert compile_key(changed, arch) != compile_key(src, arch)


def test_a_compiler_option_changes_the_compile_key(monkeypatch: pytest.MonkeyPatch) -> None:
    problem, config, arch = CASES[0]
    src = render(problem, config)
    before = compile_key(src, arch)
    monkeypatch.setattr(compiler, "COMPILER_OPTIONS",
                        (*compiler.COMPILER_OPTIONS, "--extra-device-vectorization"))
    assert compile_key(src, arch) != before
    assert "--extra-device-vectorization" in compiler.nvrtc_options(
        src, arch, find_toolchain())


def test_every_arch_has_its_own_key() -> None:
    from flashtune.codegen.arch import ARCHS

    src = render(CASES[0][0], CASES[0][1])
    keys = {compile_key(src, arch) for arch in ARCHS}
    assert len(keys) == len(ARCHS)


def test_a_cuda_header_byte_changes_the_compile_key(tmp_path: Path,
                                                    toolchain: Toolchain) -> None:
    src = render(CASES[0][0], CASES[0][1])
    include = tmp_path / "include"
    include.mkdir()
    for name in CUDA_HEADERS:
        shutil.copy(toolchain.include_dir / name, include / name)
    moved = Toolchain(toolchain.nvrtc_path, include, toolchain.nvdisasm, "copy")
    assert compile_key(src, "sm_90", moved) == compile_key(src, "sm_90", toolchain)
    _edit(include / "cuda_fp16.hpp", "\n// flashtune key test\n")
    assert compile_key(src, "sm_90", moved) != compile_key(src, "sm_90", toolchain)


def test_the_nvrtc_version_changes_the_compile_key(monkeypatch: pytest.MonkeyPatch,
                                                   toolchain: Toolchain) -> None:
    src = render(CASES[0][0], CASES[0][1])
    before = compile_key(src, "sm_90", toolchain)
    lib = nvrtc.load(toolchain.nvrtc_path)
    major, minor = lib.version
    monkeypatch.setitem(lib.__dict__, "version", (major, minor + 1))
    assert compile_key(src, "sm_90", toolchain) != before
