"""DeviceInfo: virtual devices from the arch table, the real one from torch.cuda."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from flashtune.codegen.arch import ARCHS
from flashtune.errors import DeviceError, InvalidConfig, SettingError
from flashtune.runtime import device as device_mod
from flashtune.runtime.device import DeviceInfo

_SAFE = re.compile(r"^[A-Za-z0-9._-]+$")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_virtual_device_follows_the_arch_table(arch: str) -> None:
    info = DeviceInfo.virtual(arch)
    spec = ARCHS[arch]
    assert info.name == f"virtual-{arch}" and info.is_virtual
    assert info.arch == arch == spec.name
    assert info.compute_capability == (spec.major, spec.minor)
    assert info.smem_per_block_optin == spec.max_smem_per_block
    assert info.smem_per_sm == spec.smem_per_sm
    assert info.smem_per_block == 48 * 1024
    assert info.driver_version is None and info.runtime_version is None
    assert info.nvrtc_version is not None and re.fullmatch(r"\d+\.\d+", info.nvrtc_version)
    assert info.key() == f"virtual-{arch}" and _SAFE.match(info.key())
    assert info.spec is spec


def test_virtual_accepts_other_spellings_and_sizes() -> None:
    info = DeviceInfo.virtual("9.0", sm_count=132, total_memory=80 << 30)
    assert info.arch == "sm_90" and info.sm_count == 132 and info.total_memory == 80 << 30
    with pytest.raises(ValueError, match="sm_count must be a positive int"):
        DeviceInfo.virtual("sm_90", sm_count=0)


def test_unknown_arch_is_rejected() -> None:
    with pytest.raises(InvalidConfig, match="expected one of"):
        DeviceInfo.virtual("sm_70")


def test_current_without_a_gpu_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"no CUDA device.*DeviceInfo.virtual"):
        DeviceInfo.current()


def _props(**over: object) -> SimpleNamespace:
    base: dict[str, object] = dict(
        name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
        shared_memory_per_block=48 * 1024, shared_memory_per_block_optin=227 * 1024,
        shared_memory_per_multiprocessor=228 * 1024, total_memory=85_000_000_000,
    )
    base.update(over)
    return SimpleNamespace(**base)


def test_current_reads_torch_properties(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    seen: list[int] = []

    def get_props(index: int) -> SimpleNamespace:
        seen.append(index)
        return _props()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", get_props)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(device_mod, "_driver_version", lambda: "13.0")
    info = DeviceInfo.current()
    assert seen == [3]
    assert info.name == "NVIDIA H100 80GB HBM3" and not info.is_virtual
    assert (info.arch, info.compute_capability) == ("sm_90", (9, 0))
    assert info.sm_count == 132 and info.total_memory == 85_000_000_000
    assert info.smem_per_block_optin == 227 * 1024 and info.smem_per_sm == 228 * 1024
    assert (info.driver_version, info.runtime_version) == ("13.0", "12.8")
    assert info.key() == "nvidia-h100-80gb-hbm3-132sm" and _SAFE.match(info.key())
    DeviceInfo.current(1)
    assert seen == [3, 1]


def test_key_separates_sm_counts_and_stays_filename_safe() -> None:
    a = DeviceInfo.from_properties(_props(name="NVIDIA A100-SXM4-40GB MIG 3g.20gb", major=8,
                                          minor=0, multi_processor_count=42),
                                   driver_version=None, runtime_version=None)
    b = DeviceInfo.from_properties(_props(name="NVIDIA A100-SXM4-40GB MIG 3g.20gb", major=8,
                                          minor=0, multi_processor_count=98),
                                   driver_version=None, runtime_version=None)
    assert a.key() != b.key()
    assert _SAFE.match(a.key()) and "/" not in a.key() and " " not in a.key()


def test_unsupported_gpu_is_a_device_error() -> None:
    pattern = r"V100 \(compute capability 7\.0\) is not supported.*sm_80 or newer"
    with pytest.raises(DeviceError, match=pattern):
        DeviceInfo.from_properties(_props(name="Tesla V100", major=7, minor=0),
                                   driver_version=None, runtime_version=None)


def test_inconsistent_fields_are_rejected() -> None:
    info = DeviceInfo.virtual("sm_80")
    with pytest.raises(ValueError, match="does not match"):
        DeviceInfo(**{**info.__dict__, "compute_capability": (9, 0)})
    with pytest.raises(ValueError, match="canonical"):
        DeviceInfo(**{**info.__dict__, "arch": "80"})


def test_driver_version_text() -> None:
    assert device_mod._version_text(12040) == "12.4"
    assert device_mod._version_text(13000) == "13.0"


def test_gpus_run_arch_specific_kernels_unless_the_knob_says_no(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cc 9.0 GPU runs the sm_90a kernels (each after its first-use check) unless
    FLASHTUNE_ARCH_SPECIFIC=0 keeps the mma.sync kernels."""
    def h100() -> DeviceInfo:
        return DeviceInfo.from_properties(_props(name="NVIDIA H100 80GB HBM3", major=9,
                                                 minor=0),
                                          driver_version=None, runtime_version=None)

    monkeypatch.delenv("FLASHTUNE_ARCH_SPECIFIC", raising=False)
    assert h100().arch_specific_kernels
    monkeypatch.setenv("FLASHTUNE_ARCH_SPECIFIC", "0")
    assert not h100().arch_specific_kernels
    monkeypatch.setenv("FLASHTUNE_ARCH_SPECIFIC", "maybe")
    with pytest.raises(SettingError, match="FLASHTUNE_ARCH_SPECIFIC"):
        h100()
