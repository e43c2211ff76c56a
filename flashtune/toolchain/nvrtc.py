"""A minimal ctypes binding of NVRTC: compile CUDA C++ to cubin and PTX without a GPU.

ctypes on the located ``libnvrtc`` (rather than CuPy's binding) because it needs neither a
driver nor CuPy, loads in milliseconds in every compile worker, and compiles with exactly
the library whose version and fingerprint go into the compile key.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from flashtune.errors import ToolchainNotFound, ToolError

NVRTC_SUCCESS = 0


@dataclass(frozen=True)
class NvrtcResult:
    """Outcome of one compilation: ``ok`` with cubin and PTX, or the failing status."""

    ok: bool
    status: str
    log: str
    cubin: bytes
    ptx: str


class Nvrtc:
    """One loaded libnvrtc; each compile() works on its own NVRTC program object."""

    def __init__(self, path: Path) -> None:
        try:
            self._lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise ToolchainNotFound(
                f"cannot load NVRTC from {path}: {exc}. Reinstall it: "
                "pip install 'flashtune[cu13]'"
            ) from exc
        self.path = path
        lib = self._lib
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
        self._builtins = self._load_builtins()

    def _load_builtins(self) -> ctypes.CDLL | None:
        """Load ``libnvrtc-builtins.so.X.Y`` from NVRTC's own directory, if it is there.

        NVRTC opens its builtins library by bare name at the first compile, and some
        releases (the 13.0 wheel) do not look next to themselves: the compile then fails
        with NVRTC_ERROR_BUILTIN_OPERATION_FAILURE unless LD_LIBRARY_PATH names the wheel's
        directory. A library already loaded under that name satisfies NVRTC's own lookup.
        """
        major, minor = self.version
        builtins = self.path.parent / f"libnvrtc-builtins.so.{major}.{minor}"
        if not builtins.is_file():
            return None  # a system install: the loader's search path has it
        try:
            return ctypes.CDLL(str(builtins))
        except OSError as exc:
            raise ToolchainNotFound(
                f"cannot load NVRTC's builtins {builtins}: {exc}. Reinstall it: "
                "pip install 'flashtune[cu13]'"
            ) from exc

    def _check(self, status: int, what: str) -> None:
        if status != NVRTC_SUCCESS:
            raise ToolError(f"{what} failed: {self.error_string(status)}")

    def error_string(self, status: int) -> str:
        raw = self._lib.nvrtcGetErrorString(status)
        return raw.decode() if raw else f"NVRTC status {status}"

    @functools.cached_property
    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)),
                    "nvrtcVersion")
        return (major.value, minor.value)

    @functools.cached_property
    def supported_archs(self) -> tuple[int, ...]:
        """SM numbers NVRTC can emit code for, e.g. (75, 80, 86, ..., 120)."""
        count = ctypes.c_int()
        self._check(self._lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)),
                    "nvrtcGetNumSupportedArchs")
        archs = (ctypes.c_int * count.value)()
        self._check(self._lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
        return tuple(archs)

    def compile(
        self,
        code: str,
        name: str,
        headers: Mapping[str, str],
        options: Sequence[str],
    ) -> NvrtcResult:
        """Compile ``code`` (file name ``name``) with in-memory ``headers`` and ``options``.

        Returns the result of a compilation that ran, failed or not; raises RuntimeError
        only when NVRTC itself misbehaves (out of memory, bad program handle).
        """
        lib = self._lib
        prog = ctypes.c_void_p()
        hdr_names = list(headers)
        n = len(hdr_names)
        contents = (ctypes.c_char_p * n)(*(headers[h].encode() for h in hdr_names))
        names = (ctypes.c_char_p * n)(*(h.encode() for h in hdr_names))
        self._check(
            lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), name.encode(), n,
                                   contents, names),
            "nvrtcCreateProgram",
        )
        try:
            opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            status = lib.nvrtcCompileProgram(prog, len(options), opts)
            log = self._read(prog, "ProgramLog", text=True).decode(errors="replace")
            if status != NVRTC_SUCCESS:
                return NvrtcResult(False, self.error_string(status), log, b"", "")
            cubin = self._read(prog, "CUBIN", text=False)
            ptx = self._read(prog, "PTX", text=True).decode()
            return NvrtcResult(True, "NVRTC_SUCCESS", log, cubin, ptx)
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    def _read(self, prog: ctypes.c_void_p, what: str, *, text: bool) -> bytes:
        size = ctypes.c_size_t()
        self._check(getattr(self._lib, f"nvrtcGet{what}Size")(prog, ctypes.byref(size)),
                    f"nvrtcGet{what}Size")
        buf = ctypes.create_string_buffer(size.value)
        self._check(getattr(self._lib, f"nvrtcGet{what}")(prog, buf), f"nvrtcGet{what}")
        # Text outputs are NUL-terminated; the cubin is binary and must keep every byte.
        return buf.value if text else buf.raw


@functools.lru_cache(maxsize=4)
def load(path: Path) -> Nvrtc:
    """The NVRTC library at ``path``, loaded once per process."""
    return Nvrtc(path)
