"""SASS (the GPU's machine code) of a cubin, through nvdisasm; no GPU needed."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from flashtune.errors import ToolchainNotFound
from flashtune.runtime.toolchain import find_toolchain, require_nvdisasm

NVDISASM_TIMEOUT_S = 120


def disassemble(cubin: bytes, nvdisasm: Path | None = None) -> str:
    """The SASS listing of the code sections of ``cubin``.

    Raises ToolchainNotFound when nvdisasm is not installed, RuntimeError when it rejects
    the cubin (its stderr is included).
    """
    tool = nvdisasm if nvdisasm is not None else require_nvdisasm(find_toolchain())
    with tempfile.TemporaryDirectory(prefix="flashtune-sass-") as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        try:
            done = subprocess.run(
                [str(tool), "--print-code", str(path)],
                capture_output=True, text=True, timeout=NVDISASM_TIMEOUT_S, check=False,
            )
        except OSError as exc:
            raise ToolchainNotFound(f"cannot run nvdisasm at {tool}: {exc}") from exc
    if done.returncode != 0:
        raise RuntimeError(f"nvdisasm failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout
