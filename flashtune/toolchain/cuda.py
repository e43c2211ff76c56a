"""Locating the CUDA compile toolchain: NVRTC, the CUDA headers and nvdisasm.

Nothing here needs a GPU or a driver. Search order, first match wins:

1. the nvidia pip wheels on ``sys.path``: the CUDA 13 layout ``nvidia/cu13/{lib,include,bin}``,
   then the CUDA 12 layout (``nvidia/cuda_nvrtc/lib``, ``nvidia/cuda_runtime/include``,
   ``nvidia/cuda_nvcc/bin``);
2. the toolkit named by ``FLASHTUNE_CUDA_HOME`` (settings.CUDA_HOME);
3. ``/usr/local/cuda``.

The CUDA headers are taken from the same layout as NVRTC when it has them, so that the
compiler and its headers come from one release; otherwise from the first layout that has
them.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from flashtune import settings
from flashtune.errors import ToolchainNotFound

INSTALL_HINT = "pip install 'flashtune[cu13]'"
SYSTEM_CUDA = Path("/usr/local/cuda")

#: Toolkit headers a flashtune kernel includes (directly or through its device headers).
#: Their contents are part of every compile key.
CUDA_HEADERS: tuple[str, ...] = ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp")

_NVRTC_NAME = re.compile(r"^libnvrtc\.so(\.\d+)*$")


@dataclass(frozen=True)
class Layout:
    """Where one installation keeps NVRTC, headers and binaries (each a list of dirs)."""

    name: str
    lib_dirs: tuple[Path, ...]
    include_dirs: tuple[Path, ...]
    bin_dirs: tuple[Path, ...]


@dataclass(frozen=True)
class Toolchain:
    """A located NVRTC library, the CUDA include directory and (optionally) nvdisasm."""

    nvrtc_path: Path
    include_dir: Path
    nvdisasm: Path | None
    layout: str

    def header_digest(self, names: Iterable[str] = CUDA_HEADERS) -> str:
        """sha256 over the names and contents of toolkit headers ``names``.

        Memoised per file size and modification time, so an edited header is re-read.
        """
        ordered = tuple(sorted(set(names)))
        stamps = []
        for name in ordered:
            try:
                st = (self.include_dir / name).stat()
                stamps.append((st.st_size, st.st_mtime_ns))
            except OSError:
                stamps.append((-1, -1))
        return _header_digest(self.include_dir, ordered, tuple(stamps))

    @functools.cached_property
    def nvrtc_fingerprint(self) -> str:
        """Identity of the NVRTC binaries beyond their version: file names and sizes.

        Cheap (no hashing of the ~100 MiB library), and a patch release changes the sizes.
        """
        parts = []
        for path in sorted(self.nvrtc_path.parent.glob("libnvrtc*.so*")):
            if path.is_file():
                parts.append(f"{path.name}:{path.stat().st_size}")
        return ";".join(parts)


@functools.lru_cache(maxsize=64)
def _header_digest(include_dir: Path, names: tuple[str, ...],
                   stamps: tuple[tuple[int, int], ...]) -> str:
    del stamps  # part of the memo key only
    h = hashlib.sha256()
    for name in names:
        path = include_dir / name
        h.update(name.encode() + b"\0")
        h.update(path.read_bytes() if path.is_file() else b"<missing>")
        h.update(b"\0")
    return h.hexdigest()


def wheel_layouts(site_dir: Path) -> list[Layout]:
    """The nvidia wheel layouts (CUDA 13, then 12) under one site-packages directory."""
    nv = site_dir / "nvidia"
    return [
        Layout("cu13 wheels", (nv / "cu13" / "lib",), (nv / "cu13" / "include",),
               (nv / "cu13" / "bin",)),
        Layout("cu12 wheels", (nv / "cuda_nvrtc" / "lib",), (nv / "cuda_runtime" / "include",),
               (nv / "cuda_nvcc" / "bin", nv / "cuda_nvdisasm" / "bin")),
    ]


def toolkit_layout(root: Path, name: str) -> Layout:
    """The layout of a CUDA toolkit installed at ``root``."""
    target = root / "targets" / "x86_64-linux"
    return Layout(
        name,
        (root / "lib64", root / "lib", target / "lib"),
        (root / "include", target / "include"),
        (root / "bin",),
    )


def search_layouts(site_dirs: Iterable[Path], cuda_home: Path | None) -> list[Layout]:
    """Every layout to search, in order (see the module docstring)."""
    out: list[Layout] = []
    seen: set[Path] = set()
    for site_dir in site_dirs:
        resolved = site_dir.resolve()
        if resolved in seen or not (resolved / "nvidia").is_dir():
            continue
        seen.add(resolved)
        out.extend(wheel_layouts(resolved))
    if cuda_home is not None:
        out.append(toolkit_layout(cuda_home, f"FLASHTUNE_CUDA_HOME={cuda_home}"))
    out.append(toolkit_layout(SYSTEM_CUDA, str(SYSTEM_CUDA)))
    return out


def _find_nvrtc(layout: Layout) -> Path | None:
    for lib_dir in layout.lib_dirs:
        if not lib_dir.is_dir():
            continue
        names = sorted(p for p in lib_dir.iterdir() if _NVRTC_NAME.match(p.name))
        if names:
            # Prefer the versioned soname (libnvrtc.so.13) over the dev symlink libnvrtc.so.
            return max(names, key=lambda p: (len(p.name), p.name))
    return None


def _find_include(layout: Layout) -> Path | None:
    for inc in layout.include_dirs:
        if (inc / CUDA_HEADERS[0]).is_file():
            return inc
    return None


def _find_bin(layout: Layout, tool: str) -> Path | None:
    for bin_dir in layout.bin_dirs:
        if (bin_dir / tool).is_file():
            return bin_dir / tool
    return None


def locate(layouts: Sequence[Layout]) -> Toolchain:
    """Pick NVRTC, the include dir and nvdisasm from ``layouts`` (in order)."""
    searched = "; ".join(f"{lay.name}: {', '.join(map(str, lay.lib_dirs))}" for lay in layouts)
    for layout in layouts:
        nvrtc = _find_nvrtc(layout)
        if nvrtc is None:
            continue
        include = _find_include(layout)
        if include is None:
            include = next((inc for lay in layouts if (inc := _find_include(lay))), None)
        if include is None:
            raise ToolchainNotFound(
                f"found NVRTC at {nvrtc} but no CUDA headers ({CUDA_HEADERS[0]}) in any of "
                f"{[str(d) for lay in layouts for d in lay.include_dirs]}; install the "
                f"nvidia-cuda-runtime wheel: {INSTALL_HINT}"
            )
        nvdisasm = next((b for lay in layouts if (b := _find_bin(lay, "nvdisasm"))), None)
        return Toolchain(nvrtc_path=nvrtc, include_dir=include, nvdisasm=nvdisasm,
                         layout=layout.name)
    raise ToolchainNotFound(
        f"NVRTC (libnvrtc.so) was not found; searched {searched}. Install the CUDA compile "
        f"toolchain with {INSTALL_HINT}, or set FLASHTUNE_CUDA_HOME to a CUDA toolkit root"
    )


@functools.lru_cache(maxsize=8)
def _locate_cached(site_dirs: tuple[str, ...], cuda_home: Path | None) -> Toolchain:
    dirs = [Path(p) for p in site_dirs if p and Path(p).is_dir()]
    return locate(search_layouts(dirs, cuda_home))


def find_toolchain() -> Toolchain:
    """The toolchain for the current ``sys.path`` and FLASHTUNE_CUDA_HOME (memoised).

    Raises ToolchainNotFound, saying what to install, when NVRTC or the headers are missing.
    """
    return _locate_cached(tuple(sys.path), settings.CUDA_HOME.get())


def require_nvdisasm(toolchain: Toolchain) -> Path:
    """nvdisasm's path, or ToolchainNotFound saying how to install it."""
    if toolchain.nvdisasm is None:
        raise ToolchainNotFound(
            "nvdisasm (needed for SASS) was not found next to NVRTC, in FLASHTUNE_CUDA_HOME or "
            f"in {SYSTEM_CUDA}/bin; install the nvidia-cuda-nvdisasm wheel ({INSTALL_HINT} "
            "includes it)"
        )
    return toolchain.nvdisasm
