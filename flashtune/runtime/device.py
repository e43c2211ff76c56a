"""GPU identity: name, arch, limits and software versions, for a real or a virtual device.

``DeviceInfo.current()`` asks torch.cuda about the current GPU (DeviceError without one);
``DeviceInfo.virtual("sm_90")`` describes a named arch from flashtune.codegen.arch's tables,
so code paths that only need limits (static pruning, compilation, the cost model) run on
machines without a GPU.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from typing import Protocol

from flashtune import settings
from flashtune.codegen.arch import ArchSpec, get_arch
from flashtune.errors import DeviceError, FlashtuneError

_UNSAFE = re.compile(r"[^a-z0-9]+")
_VIRTUAL_PREFIX = "virtual-"


class CudaProperties(Protocol):
    """The fields of torch's device properties that DeviceInfo needs (others are optional:
    shared_memory_per_block, shared_memory_per_block_optin, shared_memory_per_multiprocessor)."""

    name: str
    major: int
    minor: int
    multi_processor_count: int
    total_memory: int


def _positive(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"DeviceInfo.{what} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class DeviceInfo:
    """What flashtune needs to know about a GPU.

    ``arch`` is the canonical arch name (``sm_90``); tuning results of another device of the
    same arch serve as a fallback. Memory sizes are bytes. Versions are ``"major.minor"``
    strings, None where unknown (a virtual device has no driver or runtime). ``sm_count`` and
    ``total_memory`` are None for a virtual device unless given.
    """

    name: str
    arch: str
    compute_capability: tuple[int, int]
    sm_count: int | None
    smem_per_block: int
    smem_per_block_optin: int
    smem_per_sm: int
    total_memory: int | None
    driver_version: str | None
    runtime_version: str | None
    nvrtc_version: str | None
    #: Whether the dispatcher serves calls with arch-specific families (sm_90a, wgmma) where
    #: the compute capability allows: for a GPU, the setting FLASHTUNE_ARCH_SPECIFIC (on unless
    #: set to 0; each kernel passes a first-use check, runtime.first_use); a virtual device
    #: only when its arch is the arch-specific target itself (``virtual("sm_90a")``), so a
    #: virtual sm_90 (the emulator's default, ``--arch sm_90`` listings and precompiles)
    #: keeps the mma.sync kernels.
    arch_specific_kernels: bool = True

    def __post_init__(self) -> None:
        if not self.name or not self.name.isprintable():
            raise ValueError(f"DeviceInfo.name must be printable text, got {self.name!r}")
        spec = get_arch(self.arch)
        if spec.name != self.arch:
            raise ValueError(f"DeviceInfo.arch must be canonical ({spec.name!r}), got "
                             f"{self.arch!r}")
        if self.compute_capability != spec.compute_capability:
            raise ValueError(f"compute capability {self.compute_capability} does not match "
                             f"{self.arch} {spec.compute_capability}")
        for what in ("smem_per_block", "smem_per_block_optin", "smem_per_sm"):
            _positive(getattr(self, what), what)
        for what in ("sm_count", "total_memory"):
            if getattr(self, what) is not None:
                _positive(getattr(self, what), what)

    @property
    def spec(self) -> ArchSpec:
        """The arch table entry of this device."""
        return get_arch(self.arch)

    @property
    def is_virtual(self) -> bool:
        return self.name.startswith(_VIRTUAL_PREFIX)

    def key(self) -> str:
        """Canonical, filename-safe identity, e.g. ``nvidia-h100-80gb-hbm3-132sm`` or
        ``virtual-sm_90``. Devices with one name but different SM counts (MIG slices,
        cut-down parts) get different keys."""
        if self.is_virtual:
            return f"{_VIRTUAL_PREFIX}{self.arch}"
        slug = _UNSAFE.sub("-", self.name.lower()).strip("-")
        return f"{slug}-{self.sm_count}sm"

    @classmethod
    def virtual(cls, arch: str, *, sm_count: int | None = None,
                total_memory: int | None = None) -> DeviceInfo:
        """A GPU-less description of ``arch`` (InvalidConfig for an unknown arch); it runs the
        arch-specific families only when ``arch`` is their target (sm_90a)."""
        spec = get_arch(arch)
        return cls(
            name=f"{_VIRTUAL_PREFIX}{spec.name}",
            arch=spec.name,
            compute_capability=spec.compute_capability,
            sm_count=sm_count,
            smem_per_block=48 * 1024,
            smem_per_block_optin=spec.max_smem_per_block,
            smem_per_sm=spec.smem_per_sm,
            total_memory=total_memory,
            driver_version=None,
            runtime_version=None,
            nvrtc_version=_nvrtc_version(),
            arch_specific_kernels=spec.arch_specific,
        )

    @classmethod
    def current(cls, index: int | None = None) -> DeviceInfo:
        """The CUDA device ``index`` (default: torch's current device).

        Raises DeviceError when no CUDA device is usable, and when its arch is not one
        flashtune compiles for.
        """
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - torch is a dependency
            raise DeviceError(f"torch is needed to query the GPU: {exc}") from exc
        if not torch.cuda.is_available():
            raise DeviceError(
                "no CUDA device is available (torch.cuda.is_available() is False); run on a "
                "machine with an NVIDIA GPU and a CUDA build of torch, or use "
                "DeviceInfo.virtual('sm_90') to work without one"
            )
        idx = torch.cuda.current_device() if index is None else index
        props = torch.cuda.get_device_properties(idx)
        return cls.from_properties(props, driver_version=_driver_version(),
                                   runtime_version=torch.version.cuda)

    @classmethod
    def from_properties(cls, props: CudaProperties, *, driver_version: str | None,
                        runtime_version: str | None) -> DeviceInfo:
        """Build from a torch ``_CudaDeviceProperties``-like object."""
        major, minor = int(props.major), int(props.minor)
        try:
            spec = get_arch(f"sm_{major}{minor}")
        except FlashtuneError as exc:
            raise DeviceError(f"{props.name} (compute capability {major}.{minor}) "
                              f"is not supported: {exc}") from exc
        return cls(
            name=str(props.name),
            arch=spec.name,
            compute_capability=(major, minor),
            sm_count=int(props.multi_processor_count),
            smem_per_block=int(getattr(props, "shared_memory_per_block", 48 * 1024)),
            smem_per_block_optin=int(getattr(props, "shared_memory_per_block_optin",
                                             spec.max_smem_per_block)),
            smem_per_sm=int(getattr(props, "shared_memory_per_multiprocessor",
                                    spec.smem_per_sm)),
            total_memory=int(props.total_memory),
            driver_version=driver_version,
            runtime_version=runtime_version,
            nvrtc_version=_nvrtc_version(),
            arch_specific_kernels=settings.ARCH_SPECIFIC.get(),
        )


def _version_text(encoded: int) -> str:
    """CUDA's integer versions (12040) as text ("12.4")."""
    return f"{encoded // 1000}.{encoded % 1000 // 10}"


def _driver_version() -> str | None:
    """The CUDA version the installed driver supports, via libcuda (None without one)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        value = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(value)) != 0:
            return None
        return _version_text(value.value)
    except (OSError, AttributeError):
        return None


def _nvrtc_version() -> str | None:
    """The version of the NVRTC flashtune compiles with, None when it is not installed."""
    from flashtune.toolchain import nvrtc
    from flashtune.toolchain.cuda import find_toolchain

    try:
        major, minor = nvrtc.load(find_toolchain().nvrtc_path).version
    except FlashtuneError:
        return None
    return f"{major}.{minor}"
