"""Locating NVRTC, the CUDA headers and nvdisasm in the wheel layouts and toolkits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flashtune.errors import ToolchainNotFound
from flashtune.toolchain import cuda as tc_mod
from flashtune.toolchain.cuda import (
    CUDA_HEADERS,
    find_toolchain,
    locate,
    search_layouts,
    toolkit_layout,
    wheel_layouts,
)


def _touch(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _fake_cu12(site: Path) -> None:
    _touch(site / "nvidia" / "cuda_nvrtc" / "lib" / "libnvrtc.so.12")
    _touch(site / "nvidia" / "cuda_nvrtc" / "lib" / "libnvrtc-builtins.so.12.4")
    for name in CUDA_HEADERS:
        _touch(site / "nvidia" / "cuda_runtime" / "include" / name, f"// {name}")


def test_installed_wheels_are_found(toolchain: tc_mod.Toolchain) -> None:
    assert toolchain.nvrtc_path.is_file()
    assert toolchain.nvrtc_path.name.startswith("libnvrtc.so")
    assert (toolchain.include_dir / "cuda_fp16.h").is_file()
    assert (toolchain.include_dir / "cuda_bf16.hpp").is_file()
    if toolchain.layout == "cu13 wheels":
        assert toolchain.nvrtc_path.parent.parts[-3:] == ("nvidia", "cu13", "lib")
        assert toolchain.nvdisasm is not None and toolchain.nvdisasm.name == "nvdisasm"


def test_cu12_wheel_layout(tmp_path: Path) -> None:
    _fake_cu12(tmp_path)
    found = locate(search_layouts([tmp_path], None)[:2])
    assert found.layout == "cu12 wheels"
    assert found.nvrtc_path == tmp_path / "nvidia" / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"
    assert found.include_dir == tmp_path / "nvidia" / "cuda_runtime" / "include"
    assert found.nvdisasm is None


def test_cu13_layout_wins_over_cu12_in_the_same_site_dir(tmp_path: Path) -> None:
    _fake_cu12(tmp_path)
    _touch(tmp_path / "nvidia" / "cu13" / "lib" / "libnvrtc.so.13")
    _touch(tmp_path / "nvidia" / "cu13" / "include" / "cuda_fp16.h")
    _touch(tmp_path / "nvidia" / "cu13" / "bin" / "nvdisasm")
    found = locate(wheel_layouts(tmp_path))
    assert found.layout == "cu13 wheels"
    assert found.include_dir == tmp_path / "nvidia" / "cu13" / "include"
    assert found.nvdisasm == tmp_path / "nvidia" / "cu13" / "bin" / "nvdisasm"


def test_toolkit_root_prefers_versioned_soname(tmp_path: Path) -> None:
    root = tmp_path / "cuda-12.4"
    _touch(root / "lib64" / "libnvrtc.so")
    _touch(root / "lib64" / "libnvrtc.so.12")
    _touch(root / "lib64" / "libnvrtc-builtins.so.12.4")
    _touch(root / "include" / "cuda_fp16.h")
    found = locate([toolkit_layout(root, "toolkit")])
    assert found.nvrtc_path == root / "lib64" / "libnvrtc.so.12"


def test_headers_from_another_layout_when_nvrtc_has_none(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _touch(a / "lib64" / "libnvrtc.so.13")
    _touch(b / "include" / "cuda_fp16.h")
    found = locate([toolkit_layout(a, "a"), toolkit_layout(b, "b")])
    assert found.nvrtc_path.parent == a / "lib64"
    assert found.include_dir == b / "include"


def test_cuda_home_knob_is_searched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "toolkit"
    _touch(root / "lib64" / "libnvrtc.so.13")
    _touch(root / "include" / "cuda_fp16.h")
    _touch(root / "bin" / "nvdisasm")
    monkeypatch.setenv("FLASHTUNE_CUDA_HOME", str(root))
    monkeypatch.setattr(sys, "path", [str(tmp_path / "empty-site")])
    monkeypatch.setattr(tc_mod, "SYSTEM_CUDA", tmp_path / "no-system-cuda")
    found = find_toolchain()
    assert found.nvrtc_path == root / "lib64" / "libnvrtc.so.13"
    assert found.nvdisasm == root / "bin" / "nvdisasm"
    assert "FLASHTUNE_CUDA_HOME" in found.layout


def test_missing_nvrtc_says_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(ToolchainNotFound) as info:
        locate(search_layouts([tmp_path], None)[:2])
    text = str(info.value)
    assert "pip install 'flashtune[cu13]'" in text
    assert "FLASHTUNE_CUDA_HOME" in text


def test_missing_headers_say_what_to_install(tmp_path: Path) -> None:
    _touch(tmp_path / "nvidia" / "cu13" / "lib" / "libnvrtc.so.13")
    with pytest.raises(ToolchainNotFound) as info:
        locate(wheel_layouts(tmp_path))
    assert "nvidia-cuda-runtime" in str(info.value)
    assert "pip install 'flashtune[cu13]'" in str(info.value)


def test_missing_nvdisasm_says_what_to_install(tmp_path: Path) -> None:
    _fake_cu12(tmp_path)
    found = locate(wheel_layouts(tmp_path))
    with pytest.raises(ToolchainNotFound, match="nvidia-cuda-nvdisasm"):
        tc_mod.require_nvdisasm(found)


def test_header_digest_follows_contents_not_path(tmp_path: Path,
                                                 toolchain: tc_mod.Toolchain) -> None:
    copy = tmp_path / "include"
    copy.mkdir()
    for name in CUDA_HEADERS:
        (copy / name).write_bytes((toolchain.include_dir / name).read_bytes())
    moved = tc_mod.Toolchain(toolchain.nvrtc_path, copy, toolchain.nvdisasm, "copy")
    assert moved.header_digest() == toolchain.header_digest()
    with (copy / "cuda_bf16.hpp").open("ab") as f:
        f.write(b" ")
    assert moved.header_digest() != toolchain.header_digest()


def test_importing_flashtune_needs_no_cupy() -> None:
    code = (
        "import sys\n"
        "import flashtune, flashtune.cli, flashtune.toolchain.compiler, flashtune.runtime.device\n"
        "from flashtune.toolchain.compiler import compile_source\n"
        "print('cupy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_loading_nvrtc_loads_its_builtins_from_its_own_directory(
        toolchain: tc_mod.Toolchain) -> None:
    """NVRTC 13.0 (the GPU image's wheel) opens libnvrtc-builtins by bare name and fails to
    compile anything unless that library is already loaded: loading NVRTC must load it, from
    NVRTC's own directory, before any compile."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from flashtune.toolchain import nvrtc\n"
        "lib = nvrtc.load(Path(sys.argv[1]))\n"
        "major, minor = lib.version\n"
        "maps = Path('/proc/self/maps').read_text()\n"
        "print(f'{major}.{minor}')\n"
        "print(sorted({line.split()[-1] for line in maps.splitlines()\n"
        "              if 'libnvrtc-builtins' in line}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(toolchain.nvrtc_path)],
                         capture_output=True, text=True, check=True, timeout=120)
    version, loaded = out.stdout.splitlines()
    expected = toolchain.nvrtc_path.parent / f"libnvrtc-builtins.so.{version}"
    if not expected.is_file():
        pytest.skip(f"{expected.name} is not next to NVRTC here (a system install)")
    assert loaded == repr([str(expected)])
