"""Disassemble a cubin to parsed SASS: nvdisasm (from the nvidia pip wheel, through
flashtune.runtime.sass) or, when nvdisasm is missing, cuobjdump from a CUDA toolkit.

Neither tool needs a GPU. The cubin is written to a private temporary file (both tools read
files only); nothing is kept.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from flashtune import knobs
from flashtune.codegen.arch import get_arch
from flashtune.errors import ToolchainNotFound
from flashtune.perf.sass import SassListing, parse_sass
from flashtune.runtime import sass as runtime_sass
from flashtune.runtime.toolchain import SYSTEM_CUDA

TIMEOUT_S = 120.0


def find_cuobjdump() -> Path | None:
    """cuobjdump from FLASHTUNE_CUDA_HOME/bin, /usr/local/cuda/bin or PATH, else None."""
    for home in (knobs.CUDA_HOME.get(), SYSTEM_CUDA):
        if home is not None and (home / "bin" / "cuobjdump").is_file():
            return home / "bin" / "cuobjdump"
    found = shutil.which("cuobjdump")
    return Path(found) if found else None


def cuobjdump_text(cubin: bytes, tool: Path) -> str:
    """``cuobjdump -sass`` of ``cubin``."""
    with tempfile.TemporaryDirectory(prefix="flashtune-sass-") as tmp:
        image = Path(tmp) / "kernel.cubin"
        image.write_bytes(cubin)
        try:
            done = subprocess.run([str(tool), "-sass", str(image)], capture_output=True,
                                  text=True, timeout=TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ToolchainNotFound(f"cannot run cuobjdump at {tool}: {exc}") from exc
    if done.returncode != 0:
        raise RuntimeError(f"cuobjdump failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[:2000]}")
    return done.stdout


def disassemble_text(cubin: bytes) -> str:
    """SASS text of every function in ``cubin`` (nvdisasm, else cuobjdump).

    Raises ToolchainNotFound, saying what to install, when neither tool is available.
    """
    if not cubin:
        raise ValueError("the cubin is empty; compile the kernel first")
    try:
        return runtime_sass.disassemble(cubin)
    except ToolchainNotFound as missing:
        tool = find_cuobjdump()
        if tool is None:
            raise ToolchainNotFound(
                f"{missing}; cuobjdump was not found either (FLASHTUNE_CUDA_HOME/bin, "
                f"{SYSTEM_CUDA}/bin, PATH)") from missing
        return cuobjdump_text(cubin, tool)


def disassemble(cubin: bytes, arch: str) -> SassListing:
    """Disassemble and parse ``cubin``, checking that it was built for ``arch``.

    Raises ValueError when the listing names a different target arch.
    """
    want = get_arch(arch).name
    listing = parse_sass(disassemble_text(cubin))
    if listing.arch is not None and listing.arch.rstrip("af") != want:
        raise ValueError(f"the cubin targets {listing.arch}, not {want}; compile it for {want}")
    return listing
