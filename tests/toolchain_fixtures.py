"""Fixtures of the code generation and compilation tests (CPU tier: NVRTC, no GPU), used by
the conftest.py of tests/codegen and tests/toolchain."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import jinja2
import pytest

from flashtune.codegen import render
from flashtune.toolchain import compiler
from flashtune.toolchain.cache import ArtifactCache
from flashtune.toolchain.cuda import Toolchain, find_toolchain
from flashtune.toolchain.nvrtc import Nvrtc, NvrtcResult


@pytest.fixture(autouse=True)
def _fresh_memo() -> Iterator[None]:
    """Each test starts with an empty in-process compile memo."""
    compiler.clear_memo()
    yield
    compiler.clear_memo()


@pytest.fixture
def cache(tmp_path: Path) -> ArtifactCache:
    """A private, empty artifact cache."""
    return ArtifactCache(tmp_path / "cache")


@pytest.fixture(scope="session")
def toolchain() -> Toolchain:
    return find_toolchain()


@pytest.fixture
def nvrtc_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Entries NVRTC is asked to compile in this process, in order."""
    calls: list[str] = []
    real = compiler._run_nvrtc

    def counting(lib: Nvrtc, source: object, options: object) -> NvrtcResult:
        calls.append(source.entry)  # type: ignore[attr-defined]
        return real(lib, source, options)  # type: ignore[arg-type]

    monkeypatch.setattr(compiler, "_run_nvrtc", counting)
    return calls


@pytest.fixture
def template_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of the templates directory that render() reads from."""
    root = tmp_path / "templates"
    shutil.copytree(render.templates_dir(), root)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    monkeypatch.setattr(render, "environment", lambda: env)
    monkeypatch.setattr(render, "templates_dir", lambda: root)
    return root
