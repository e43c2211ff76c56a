"""Typed failures raised by flashtune.

Every message says what was wrong, the value that was expected and how to fix it, so a
caller can act on it without reading flashtune's source.
"""

from __future__ import annotations

from pathlib import Path


class FlashtuneError(Exception):
    """Base class of every error flashtune raises on purpose."""


class InvalidConfig(FlashtuneError, ValueError):
    """A KernelConfig (or a value meant for one) violates the legal values or constraints."""


class InvalidProblem(FlashtuneError, ValueError):
    """A Problem (head dim, dtype, op, ...) is outside what flashtune can compile."""


class FeatureNotSupported(InvalidProblem, NotImplementedError):
    """An attention feature (sliding window, softcap, ALiBi, ...) that a kernel family, or
    the operation that runs it, does not implement: refused rather than computed without."""


class InvalidInput(FlashtuneError, ValueError):
    """Tensors or arguments handed to the public API do not fit (shape, dtype, device...)."""


class SettingError(FlashtuneError, ValueError):
    """An environment variable holds a value that cannot be parsed."""


class CacheError(FlashtuneError, RuntimeError):
    """The on-disk kernel cache (or a precompiled directory) cannot be used safely: it is
    writable by another user, owned by someone else, damaged, unwritable or on a full disk."""


class ToolchainNotFound(FlashtuneError, RuntimeError):
    """NVRTC, the CUDA headers, a host compiler or a disassembler could not be located."""


class ToolError(FlashtuneError, RuntimeError):
    """A located tool (NVRTC's API, nvdisasm, cuobjdump) failed; the message has its output."""


class CompileError(FlashtuneError, RuntimeError):
    """NVRTC (or the emulator's host compiler) rejected a kernel.

    ``log`` holds the compiler's output; ``source_path`` is where the failing source was
    saved so it can be inspected or compiled by hand.
    """

    def __init__(self, message: str, *, log: str = "", source_path: Path | None = None) -> None:
        detail = message
        if source_path is not None:
            detail += f"\n  failing source saved at: {source_path}"
        if log:
            detail += "\n  compiler log:\n" + "\n".join("    " + ln for ln in log.splitlines())
        super().__init__(detail)
        self.message = message
        self.log = log
        self.source_path = source_path

    def __reduce__(self) -> tuple[object, ...]:
        # Keep the log and path across process pools (the default pickles args only).
        return (_rebuild_compile_error, (self.message, self.log, self.source_path))


def _rebuild_compile_error(message: str, log: str, source_path: Path | None) -> CompileError:
    return CompileError(message, log=log, source_path=source_path)


class OutOfResources(FlashtuneError, RuntimeError):
    """A kernel needs more of a resource (shared memory, registers, threads) than allowed."""

    def __init__(self, resource: str, value: int, limit: int, fix: str) -> None:
        super().__init__(f"{resource} = {value} exceeds the limit {limit}; {fix}")
        self.resource = resource
        self.value = value
        self.limit = limit


class BackwardNotAvailable(FlashtuneError, NotImplementedError):
    """A gradient was requested but flashtune has no backward kernel yet."""


class DeviceError(FlashtuneError, RuntimeError):
    """No usable CUDA device, or a launch failed on it."""


class KernelHung(DeviceError):
    """A kernel did not finish within its deadline (an arch-specific kernel's first-use
    check): it is hung, and the device it runs on cannot be used by this process any more."""


class CheckDuringCapture(FlashtuneError, RuntimeError):
    """A first-use check was needed inside CUDA-graph capture, where it cannot run."""


class EmulatorError(FlashtuneError, RuntimeError):
    """The CPU emulator detected a fault in a kernel (bad address, poison read, ...)."""


class EmulatorDeadlock(EmulatorError):
    """A barrier or warp collective in the emulator can never complete."""


class DatabaseError(FlashtuneError, RuntimeError):
    """The tuning database could not be opened, read or written."""


class SchemaVersionError(DatabaseError):
    """The database was written by a different schema version than this code expects."""


class BundleError(FlashtuneError, ValueError):
    """A tuning bundle (export file) is malformed, hostile or from an unknown schema."""


class TuningError(FlashtuneError, RuntimeError):
    """The tuner cannot proceed (no candidates, no device, bad study parameters)."""
