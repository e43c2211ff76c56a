"""A compiled kernel as a value, and its on-disk artifact format.

CompiledKernel is what the compiler returns; ``pack``/``unpack`` convert it to and from the
bytes stored in the artifact cache.
"""

from __future__ import annotations

import io
import json
import logging
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from flashtune.errors import CompileError
from flashtune.toolchain.resources import Resources

#: Bump when the artifact layout or the compile key recipe changes.
ARTIFACT_FORMAT = 1

log = logging.getLogger("flashtune.compiler")


@dataclass(frozen=True)
class CompiledKernel:
    """A kernel compiled for one arch: its cubin, optional PTX and resource usage."""

    entry: str
    arch: str
    compile_key: str
    source_digest: str
    resources: Resources
    nvrtc_version: tuple[int, int]
    options: tuple[str, ...]
    cubin: bytes = field(repr=False)
    ptx: str | None = field(default=None, repr=False)
    log: str = field(default="", repr=False, compare=False)  # has timings: not identity


@dataclass(frozen=True)
class CompileFailure:
    """Why a compilation failed, as plain data (crosses process boundaries intact)."""

    message: str
    log: str
    source_path: str | None

    def error(self) -> CompileError:
        path = Path(self.source_path) if self.source_path else None
        return CompileError(self.message, log=self.log, source_path=path)


def pack(kernel: CompiledKernel, ptx: str) -> bytes:
    """The on-disk form of ``kernel`` and its PTX: an uncompressed zip holding meta.json,
    kernel.cubin and kernel.ptx (inspectable with any zip tool)."""
    meta = {
        "format": ARTIFACT_FORMAT,
        "entry": kernel.entry,
        "arch": kernel.arch,
        "compile_key": kernel.compile_key,
        "source_digest": kernel.source_digest,
        "nvrtc_version": list(kernel.nvrtc_version),
        "options": list(kernel.options),
        "resources": kernel.resources.to_dict(),
        "log": kernel.log,
    }
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("meta.json", json.dumps(meta, indent=1, sort_keys=True))
        zf.writestr("kernel.cubin", kernel.cubin)
        zf.writestr("kernel.ptx", ptx)
    return buf.getvalue()


def unpack(data: bytes, key: str, *, want_ptx: bool) -> CompiledKernel | None:
    """The kernel stored in ``data``, or None if it is unreadable or not for ``key``."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            meta = json.loads(zf.read("meta.json"))
            if meta.get("format") != ARTIFACT_FORMAT or meta.get("compile_key") != key:
                return None
            major, minor = meta["nvrtc_version"]
            return CompiledKernel(
                entry=meta["entry"],
                arch=meta["arch"],
                compile_key=key,
                source_digest=meta["source_digest"],
                resources=Resources.from_dict(meta["resources"]),
                nvrtc_version=(int(major), int(minor)),
                options=tuple(meta["options"]),
                cubin=zf.read("kernel.cubin"),
                ptx=zf.read("kernel.ptx").decode() if want_ptx else None,
                log=meta["log"],
            )
    except (zipfile.BadZipFile, KeyError, ValueError, TypeError) as exc:
        log.warning(
            "unreadable kernel artifact for key %s (%s); rebuilding", key[:16], exc)
        return None
