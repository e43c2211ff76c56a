"""benchmarks/toolchain_compat.py and nvrtc13_compat.sh: the toolchain check, the families'
kernels, the compile report and its exit status (the full run needs the scratch
environment: bash benchmarks/nvrtc13_compat.sh)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
import toolchain_compat as tcc

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import COMPILED_HEAD_DIMS, DType, KernelConfig, Problem
from flashtune.families import render
from flashtune.runtime.precompile import default_kernels
from flashtune.toolchain.cuda import Toolchain

REPO = Path(__file__).resolve().parents[2]


def test_check_toolchain_names_what_differs(tmp_path: Path) -> None:
    inside = tmp_path / "scratch"
    tc = Toolchain(nvrtc_path=inside / "lib" / "libnvrtc.so.13",
                   include_dir=tmp_path / "elsewhere" / "include", nvdisasm=None,
                   layout="cu13 wheels")
    assert tcc.check_toolchain(tc, (13, 0), "13.0", None) == []
    problems = tcc.check_toolchain(tc, (13, 5), "13.0", inside)
    assert problems == ["NVRTC 13.5 was found, not 13.0",
                        f"the CUDA headers came from {tc.include_dir}, not from under "
                        f"{inside.resolve()}"]


def test_forward_defaults_are_the_runtime_defaults() -> None:
    sources = tcc.default_sources(families.get("fwd"), "sm_90")
    assert len(sources) == len(COMPILED_HEAD_DIMS) * len(DType) * 2
    assert len({s.entry for s in sources}) == len(sources)
    assert [s.digest for s in sources] == [render(p, c).digest
                                           for p, c in default_kernels("sm_90")]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_registered_family_has_default_kernels(arch: str) -> None:
    for family in families.all_families():
        sources = tcc.default_sources(family, arch)
        if family.target_arch is not None and not get_arch(family.target_arch).runs_on(
                get_arch(arch)):
            assert sources == [], family.op  # sm_90a code is not built for sm_80
            continue
        if all(dtypes.fp8 for dtypes in family.dtypes) and arch == "sm_80":
            assert sources == []  # no FP8 tensor cores nor e4m3 conversions on sm_80
            continue
        assert sources and {s.problem.op for s in sources} == {family.op}


SMALL = render(Problem(head_dim=32, dtype=DType.FP16),
               KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=1))


def test_main_compiles_and_reports(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tcc, "default_sources", lambda family, arch: [SMALL])
    assert tcc.main(["--arch", "sm_90", "--family", "fwd", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "fwd      sm_90  1/1 compiled" in out and "0 kernel(s) spill" in out
    assert "every default kernel compiled" in out


def test_main_fails_on_a_kernel_that_does_not_compile(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    broken = dataclasses.replace(SMALL, code=SMALL.code + "\nthis is not C++;\n",
                                 digest="0" * 64)
    monkeypatch.setattr(tcc, "default_sources", lambda family, arch: [SMALL, broken])
    assert tcc.main(["--arch", "sm_80", "--family", "fwd", "--workers", "1"]) == 1
    captured = capsys.readouterr()
    assert "fwd      sm_80  1/2 compiled" in captured.out
    assert f"FAILED {broken.entry} for sm_80" in captured.err
    assert "NVRTC could not compile" in captured.err and "error" in captured.err
    assert "1 kernel(s) failed to compile" in captured.err
    kept = captured.err.rsplit("kept under ", 1)[1].strip()
    assert Path(kept).is_dir()  # the failing source stays for a look
    shutil.rmtree(kept)


def test_main_refuses_another_toolchain(capsys: pytest.CaptureFixture[str]) -> None:
    assert tcc.main(["--expect-nvrtc", "0.1"]) == 2
    assert "not the toolchain under test: NVRTC" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("argv", [["--cuda", "12.4"], ["--bogus"]])
def test_compat_script_rejects_bad_arguments(argv: list[str]) -> None:
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "nvrtc13_compat.sh"), *argv],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "error:" in proc.stderr
