"""Fixtures of the perf tests: compiling CUDA sources with NVRTC (no GPU needed)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest

from flashtune.errors import ToolchainNotFound
from flashtune.perf.sass.parse import SassListing

#: compile_cubin(code, arch, headers={}, options=()) -> cubin bytes
CompileCubin = Callable[..., bytes]
#: compile_sass(code, arch, headers={}, options=()) -> parsed SASS
CompileSass = Callable[..., SassListing]


@pytest.fixture(scope="session")
def compile_cubin() -> CompileCubin:
    """Compile a CUDA source (with in-memory headers) for an arch; skip without NVRTC or
    nvdisasm."""
    from flashtune.toolchain import nvrtc
    from flashtune.toolchain.cuda import find_toolchain, require_nvdisasm

    try:
        toolchain = find_toolchain()
        require_nvdisasm(toolchain)
    except ToolchainNotFound as exc:
        pytest.skip(f"CUDA compile toolchain missing: {exc}")
    lib = nvrtc.load(toolchain.nvrtc_path)

    def run(code: str, arch: str, headers: Mapping[str, str] | None = None,
            options: tuple[str, ...] = ()) -> bytes:
        result = lib.compile(code, "micro.cu", dict(headers or {}),
                             (*options, f"--gpu-architecture={arch}",
                              f"-I{toolchain.include_dir}"))
        assert result.ok, result.log
        return result.cubin

    return run


@pytest.fixture(scope="session")
def compile_sass(compile_cubin: CompileCubin) -> CompileSass:
    """Compile, disassemble and parse a CUDA source for an arch."""
    from flashtune.perf.sass.disasm import sass_listing

    def run(code: str, arch: str, headers: Mapping[str, str] | None = None,
            options: tuple[str, ...] = ()) -> SassListing:
        return sass_listing(compile_cubin(code, arch, headers, options), arch)

    return run
