"""The CUDA backend: cubins from the compiler (and its disk cache), loaded and launched with CuPy.

``CudaBackend.load(source)`` takes the cubin for the arch of the current CUDA device from a
precompiled cache (``flashtune precompile``; no NVRTC needed) or else from the compiler (its
disk cache, else NVRTC), loads it as a CuPy module and returns a ``CudaKernel``. Loaded
kernels are kept per (source digest, device), so each kernel is loaded once per device and
process. ``CudaKernel.launch`` enqueues the kernel on the given raw CUDA stream handle (the
caller passes torch's current stream): no host synchronisation and no allocation.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from flashtune.codegen.abi import ArgType, ArgValue
from flashtune.codegen.spec import KernelSource
from flashtune.codegen.tensormap import TensorMap
from flashtune.errors import DeviceError, OutOfResources
from flashtune.runtime.precompile import load_shipped
from flashtune.runtime.tma import encode_driver

log = logging.getLogger("flashtune.cuda")

#: Dynamic shared memory above this needs an explicit per-function opt-in.
DEFAULT_SMEM_LIMIT = 48 * 1024

#: A CUtensorMap by value: 128 bytes, 64-byte aligned (the parameter offset is the cubin's).
_TENSOR_MAP_DTYPE = np.dtype({"names": ["opaque"], "formats": [("<u8", (16,))],
                              "itemsize": 128})


def _tensor_map(value: Any) -> Any:
    """A driver-encoded tensor map as a one-element NumPy structured array, the form CuPy
    passes by value as a struct argument (its custom-struct examples)."""
    if not isinstance(value, TensorMap):
        raise TypeError(f"a tensor-map argument needs a TensorMap, got {type(value).__name__}")
    return np.frombuffer(encode_driver(value), dtype=_TENSOR_MAP_DTYPE).copy()


# CuPy passes a Python int as a 64-bit integer; 32-bit arguments need sized numpy scalars.
_CONVERT: dict[ArgType, Callable[[Any], Any]] = {
    ArgType.PTR: int,
    ArgType.I64: int,
    ArgType.I32: np.int32,
    ArgType.F32: np.float32,
    ArgType.TMAP: _tensor_map,
}


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:  # the cu13 / cu12 extra is not installed
        raise DeviceError(
            "the cuda backend needs CuPy; install it with pip install 'flashtune[cu13]' "
            "(or 'flashtune[cu12]' for CUDA 12 drivers)"
        ) from exc
    return cupy


class _StreamHandle:
    """A raw CUDA stream handle offered through the CUDA stream protocol."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


#: CuPy stream objects wrapping raw handles, per (handle, device); bounded because streams
#: come and go (a handle reused by a new stream is still the right handle).
_streams: dict[tuple[int, int], Any] = {}
MAX_STREAMS = 256


def cupy_stream(handle: int, device_index: int) -> Any:
    """A CuPy stream object for the raw CUDA stream ``handle`` (owned by torch)."""
    key = (handle, device_index)
    stream = _streams.get(key)
    if stream is None:
        cupy = _cupy()
        if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14
            stream = cupy.cuda.Stream.from_external(_StreamHandle(handle))
        else:
            stream = cupy.cuda.ExternalStream(handle, device_index)
        if len(_streams) >= MAX_STREAMS:
            _streams.clear()
        _streams[key] = stream
    return stream


class CudaKernel:
    """One kernel loaded on one device; ``launch`` is safe inside CUDA graph capture."""

    def __init__(self, source: KernelSource, function: Any, device_index: int) -> None:
        self.source = source
        self.device_index = device_index
        self._function = function
        self._block = (source.threads, 1, 1)
        self._smem = source.smem_bytes
        cupy = _cupy()
        self._get_device = cupy.cuda.runtime.getDevice
        self._device = cupy.cuda.Device

    def launch(
        self,
        grid: tuple[int, int, int],
        args: Sequence[tuple[ArgType, ArgValue]],
        *,
        stream: int = 0,
    ) -> None:
        """Enqueue the kernel on the raw stream handle ``stream`` (0: the legacy default).

        Nothing is synchronised or allocated; the kernel runs on this kernel's device.
        """
        values = tuple([_CONVERT[kind](value) for kind, value in args])
        wrapped = cupy_stream(stream, self.device_index)
        if self._get_device() != self.device_index:
            with self._device(self.device_index):
                self._function(grid, self._block, values, shared_mem=self._smem,
                               stream=wrapped)
            return
        self._function(grid, self._block, values, shared_mem=self._smem, stream=wrapped)

    def bind(
        self,
        grid: tuple[int, int, int],
        args: Sequence[tuple[ArgType, ArgValue]],
        *,
        stream: int = 0,
    ) -> Callable[[], None]:
        """A launch with its arguments converted once; the caller keeps this kernel's
        device current while it calls the result (the tuner's timing loop does)."""
        values = tuple([_CONVERT[kind](value) for kind, value in args])
        wrapped = cupy_stream(stream, self.device_index)
        function, block, smem = self._function, self._block, self._smem
        grid = tuple(int(g) for g in grid)  # type: ignore[assignment]

        def run() -> None:
            function(grid, block, values, shared_mem=smem, stream=wrapped)

        return run


class CudaBackend:
    """Loads kernels on CUDA devices; one loaded module per (source digest, device)."""

    name = "cuda"

    def __init__(self) -> None:
        self._loaded: dict[tuple[str, int], CudaKernel] = {}
        self._lock = threading.Lock()

    def load(self, source: KernelSource, device_index: int | None = None) -> CudaKernel:
        """The kernel of ``source`` on ``device_index`` (default: the current device)."""
        cupy = _cupy()
        index = cupy.cuda.runtime.getDevice() if device_index is None else device_index
        key = (source.digest, index)
        kernel = self._loaded.get(key)
        if kernel is not None:
            return kernel
        with self._lock:
            kernel = self._loaded.get(key)
            if kernel is None:
                with cupy.cuda.Device(index):
                    kernel = self._load_on_current(source, index)
                self._loaded[key] = kernel
        return kernel

    def _load_on_current(self, source: KernelSource, index: int) -> CudaKernel:
        from flashtune.runtime.device import DeviceInfo

        info = DeviceInfo.current(index)
        if source.smem_bytes > info.smem_per_block_optin:
            raise OutOfResources("dynamic shared memory", source.smem_bytes,
                                 info.smem_per_block_optin,
                                 f"choose a config with smaller tiles for {info.name}")
        shipped = load_shipped(source, info.arch)
        if shipped is not None:
            try:
                return self._load_cubin(source, shipped, index)
            except DeviceError as exc:  # e.g. a driver older than the shipping toolchain
                log.warning("the precompiled cubin of %s for %s did not load (%s); compiling "
                            "it here instead", source.entry, info.arch, exc)
        return self._load_cubin(source, compile_cubin(source, info.arch), index)

    def _load_cubin(self, source: KernelSource, cubin: bytes, index: int) -> CudaKernel:
        cupy = _cupy()
        module = cupy.cuda.function.Module()
        try:
            module.load(cubin)
            function = module.get_function(source.entry)
            if source.smem_bytes > DEFAULT_SMEM_LIMIT:
                driver = cupy.cuda.driver
                driver.funcSetAttribute(
                    function.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    source.smem_bytes)
        except (cupy.cuda.driver.CUDADriverError, cupy.cuda.runtime.CUDARuntimeError) as exc:
            raise DeviceError(f"loading kernel {source.entry} on CUDA device {index} failed: "
                              f"{exc}") from exc
        return CudaKernel(source, function, index)


def compile_cubin(source: KernelSource, arch: str) -> bytes:
    """The cubin of ``source`` for ``arch`` from the compiler (its memo, disk cache or NVRTC)."""
    from flashtune.toolchain.compiler import compile_source

    return bytes(compile_source(source, arch).cubin)
