"""SASS (the GPU's machine code) of a cubin: nvdisasm (the nvidia pip wheel), else cuobjdump
from a CUDA toolkit. Neither needs a GPU; the cubin goes to a private temporary file (both
tools read files only) and nothing is kept."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from flashtune import settings
from flashtune.errors import InvalidInput, ToolchainNotFound, ToolError
from flashtune.toolchain.cuda import SYSTEM_CUDA, find_toolchain, require_nvdisasm

TIMEOUT_S = 120


def _run(tool: Path, flags: list[str], cubin: bytes) -> str:
    with tempfile.TemporaryDirectory(prefix="flashtune-sass-") as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        try:
            done = subprocess.run([str(tool), *flags, str(path)], capture_output=True,
                                  text=True, timeout=TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ToolchainNotFound(f"cannot run {tool.name} at {tool}: {exc}") from exc
    if done.returncode != 0:
        raise ToolError(f"{tool.name} failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[:2000]}")
    return done.stdout


def find_cuobjdump() -> Path | None:
    """cuobjdump from FLASHTUNE_CUDA_HOME/bin, /usr/local/cuda/bin or PATH, else None."""
    for home in (settings.CUDA_HOME.get(), SYSTEM_CUDA):
        if home is not None and (home / "bin" / "cuobjdump").is_file():
            return home / "bin" / "cuobjdump"
    found = shutil.which("cuobjdump")
    return Path(found) if found else None


def disassemble(cubin: bytes, nvdisasm: Path | None = None) -> str:
    """The SASS listing of the code sections of ``cubin``: nvdisasm (``nvdisasm`` or the
    toolchain's), else cuobjdump.

    Raises ToolchainNotFound, saying what to install, when neither tool is available, and
    ToolError when the tool rejects the cubin (its stderr is included).
    """
    if not cubin:
        raise InvalidInput("the cubin is empty; compile the kernel first")
    try:
        tool = nvdisasm if nvdisasm is not None else require_nvdisasm(find_toolchain())
    except ToolchainNotFound as missing:
        fallback = find_cuobjdump()
        if fallback is None:
            raise ToolchainNotFound(
                f"{missing}; cuobjdump was not found either (FLASHTUNE_CUDA_HOME/bin, "
                f"{SYSTEM_CUDA}/bin, PATH)") from missing
        return _run(fallback, ["-sass"], cubin)
    return _run(tool, ["--print-code"], cubin)
