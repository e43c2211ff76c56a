"""SASS (the GPU's machine code) of a cubin: nvdisasm (the nvidia pip wheel), else cuobjdump
from a CUDA toolkit. Neither needs a GPU; the cubin goes to a private temporary file (both
tools read files only). A listing is kept in the artifact cache, keyed by the cubin and the
tool (its path, size and modification time), since one takes half a second to make and the
profile, the default rule and the SASS budget ask for the same cubins again."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from flashtune import settings
from flashtune.errors import InvalidInput, ToolchainNotFound, ToolError
from flashtune.toolchain.cache import ArtifactCache
from flashtune.toolchain.cuda import SYSTEM_CUDA, find_toolchain, require_nvdisasm

TIMEOUT_S = 120
NAMESPACE = "sass"


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


def disassemble(cubin: bytes, nvdisasm: Path | None = None,
                cache: ArtifactCache | None = None) -> str:
    """The SASS listing of the code sections of ``cubin``: nvdisasm (``nvdisasm`` or the
    toolchain's), else cuobjdump; from ``cache`` (default: the kernel cache) when that tool
    made it before.

    Raises ToolchainNotFound, saying what to install, when neither tool is available,
    ToolError when the tool rejects the cubin (its stderr is included; nothing is kept) and
    CacheError when the cache is unsafe or cannot take the listing.
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
        return _cached(fallback, ["-sass"], cubin, cache)
    return _cached(tool, ["--print-code"], cubin, cache)


def _cached(tool: Path, flags: list[str], cubin: bytes, cache: ArtifactCache | None) -> str:
    store = cache if cache is not None else ArtifactCache()
    try:
        st = tool.stat()
    except OSError:
        return _run(tool, flags, cubin)  # which says why the tool cannot be run
    h = hashlib.sha256(f"{tool.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    h.update("\0".join(flags).encode() + b"\0")
    h.update(cubin)
    key = h.hexdigest()
    kept = store.load_bytes(NAMESPACE, key, ".sass")
    if kept is not None:
        return kept.decode()
    listing = _run(tool, flags, cubin)
    store.put_bytes(NAMESPACE, key, ".sass", listing.encode())
    return listing
