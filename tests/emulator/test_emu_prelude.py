"""The precompiled prelude: under GCC, kernel builds include flashtune_emu/runtime.h in its
precompiled form (parsing it is about half of a kernel build); other compilers, and a
precompile that fails, fall back to the plain header."""

from __future__ import annotations

import logging
import stat
import subprocess
from pathlib import Path

import pytest

from flashtune.runtime.backends.emulator import build
from flashtune.toolchain import host
from flashtune.toolchain.cache import ArtifactCache

pytestmark = pytest.mark.emulator

#: Uses what the prelude declares (half types, the launch model) and nothing of its own.
SOURCE = r"""
extern "C" __global__ void halve(__half* x) {
  x[threadIdx.x] = __hmul(x[threadIdx.x], __float2half(0.5f));
}
"""

#: Any runtime name: the prelude's key hashes it, nothing reads the file.
RUNTIME = Path("libftemu-rt-test.so")


def _flags() -> list[str]:
    return build._flags(False, build.KERNEL_OPT)


def test_the_compiler_is_recognised() -> None:
    assert host.is_gcc(host.host_compiler()) is ("clang" not in host.compiler_identity(
        host.host_compiler()).lower())
    assert host.is_gcc("/nonexistent/g++") is False


@pytest.mark.skipif(not host.is_gcc(host.host_compiler()), reason="GCC builds the prelude")
def test_gcc_builds_and_uses_the_precompiled_prelude(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    cxx = host.host_compiler()
    include = build.prelude_include(cache, RUNTIME, _flags(), cxx)
    assert Path(include).is_file() and Path(include).is_relative_to(cache.root)
    assert Path(include + ".gch").stat().st_size > 1_000_000
    assert build.prelude_include(cache, RUNTIME, _flags(), cxx) == include
    # A macro the prelude never reads (a kernel's own knob) shares the precompiled header;
    # one it reads makes another (GCC would refuse this one under it).
    own = [*_flags(), "-DFTEMU_TEST_OWN_KNOB=3", "-DNDEBUG"]
    assert build.prelude_include(cache, RUNTIME, own, cxx) == include
    read = [*_flags(), "-DFT_DYNAMIC_SMEM=1"]  # primitives.h defines it unless set
    other = build.prelude_include(cache, RUNTIME, read, cxx)
    assert other != include and Path(other + ".gch").is_file()

    src = tmp_path / "halve.cu"
    src.write_text(SOURCE)

    def first_header(flags: list[str], prelude: str) -> str:
        # -H lists each header read: "!" marks a precompiled header GCC used, "x" one it
        # found and refused (then it parses the plain header).
        proc = subprocess.run([cxx, *flags, *build._include_flags(()), "-H", "-fsyntax-only",
                               "-include", prelude, "-x", "c++", str(src)],
                              capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stderr.splitlines()[0]

    assert f"! {include}.gch" in first_header(_flags(), include)
    assert f"! {include}.gch" in first_header(own, include)
    assert f"! {other}.gch" in first_header(read, other)
    assert f"x {include}.gch" in first_header(read, include)


def test_the_prelude_is_keyed_by_the_defines_it_can_read() -> None:
    flags = ["-O1", "-DNDEBUG", "-D_GLIBCXX_ASSERTIONS", "-DFT_DYNAMIC_SMEM=1",
             "-DFLASHTUNE_EMULATOR=1", "-DFT_WS_PLANTED_BUG=2"]
    assert build.prelude_flags(flags) == ["-O1", "-D_GLIBCXX_ASSERTIONS", "-DFT_DYNAMIC_SMEM=1",
                                          "-DFLASHTUNE_EMULATOR=1"]


def test_other_compilers_parse_the_plain_header(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "is_gcc", lambda cxx: False)
    cache = ArtifactCache(tmp_path / "cache")
    assert build.prelude_include(cache, RUNTIME, _flags(), host.host_compiler()) == build.PRELUDE
    assert not list(cache.root.rglob("*.gch"))


def test_a_failed_precompile_falls_back_once_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A GCC that fails every header build, counting its attempts.
    attempts = tmp_path / "attempts"
    fake = tmp_path / "g++-broken"
    fake.write_text(f"#!/bin/sh\ncase \"$*\" in *c++-header*) echo x >> {attempts}; "
                    "echo 'broken precompile' >&2; exit 1;; esac\n"
                    f"exec {host.host_compiler()} \"$@\"\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert host.is_gcc(str(fake)) is host.is_gcc(host.host_compiler())
    monkeypatch.setattr(host, "is_gcc", lambda cxx: True)
    cache = ArtifactCache(tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="flashtune.emulator"):
        for _ in range(3):
            assert build.prelude_include(cache, RUNTIME, _flags(), str(fake)) == build.PRELUDE
    assert attempts.read_text().count("x") == 1  # not retried for every kernel
    assert "broken precompile" in caplog.text and build.PRELUDE in caplog.text
    assert not list(cache.root.rglob("*.gch")), "a failed build left a precompiled header"
