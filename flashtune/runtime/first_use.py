"""The first-use check of arch-specific kernels (the sm_90a families on compute capability 9.0).

An arch-specific family serves a device's calls by default (FLASHTUNE_ARCH_SPECIFIC). Its
kernels are verified in the CPU emulator, whose wgmma, TMA and mbarrier models follow the
PTX documentation; the hardware is the final word. So before a kernel of such a family first
serves a call in a process, it runs once on fresh random inputs of ``CHECK_SHAPE``
(NaN-poisoned outputs) and is compared with the family's float64 reference, on the same
device and backend. If it disagrees, or fails to run, or the kernel cannot be built or
loaded at all (no NVRTC beside a precompiled directory of the portable kernels), the device
is refused the arch-specific families for the rest of the process: a warning names the
kernel and what was wrong, and the call (and every later one) is served by the portable
family, as with FLASHTUNE_ARCH_SPECIFIC=0.

A kernel that crashes the CUDA context (an illegal instruction or address) cannot be
recovered from in the process; the error then names the setting that turns these families off.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING

import torch

from flashtune.codegen.spec import Shape
from flashtune.errors import FlashtuneError
from flashtune.runtime.backends.base import LoadedKernel

if TYPE_CHECKING:
    from flashtune.runtime.device import DeviceInfo

log = logging.getLogger(__name__)

#: GQA (two query heads per KV head), lengths off every tile grid, more keys than queries (a
#: causal call sees a bottom-right diagonal): small enough to cost milliseconds on a GPU.
CHECK_SHAPE = Shape(batch=1, heads_q=2, heads_kv=1, seqlen_q=130, seqlen_k=200)

_lock = threading.Lock()
_checked: set[tuple[str, str]] = set()   # (device name, kernel entry) that passed
_refused: dict[str, str] = {}            # device name -> why its arch-specific kernels failed



def refused(device_name: str) -> str | None:
    """Why ``device_name``'s arch-specific kernels were turned off in this process, or None."""
    return _refused.get(device_name)


def without_refused(device: DeviceInfo) -> DeviceInfo:
    """``device`` with arch-specific kernels off if it was refused them in this process."""
    if device.arch_specific_kernels and refused(device.name):
        return dataclasses.replace(device, arch_specific_kernels=False)
    return device


def check(kernel: LoadedKernel, device: torch.device | str, device_name: str) -> str | None:
    """Verify ``kernel`` once per (device, kernel) in this process; None when it matches the
    float64 reference, else what was wrong (and ``device_name`` is refused from then on)."""
    from flashtune.runtime.launch import verify

    key = (device_name, kernel.source.entry)
    if key in _checked:
        return None
    with _lock:
        if key in _checked:
            return None
        why = refused(device_name)
        if why is not None:
            return why
        try:
            verdict = verify(kernel, CHECK_SHAPE, device)
            failure = None if verdict.ok else verdict.message
        except (FlashtuneError, RuntimeError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        if failure is None:
            _checked.add(key)
            return None
        return _refuse(device_name, f"{kernel.source.entry} failed its first-use check "
                                    f"against float64 on {device_name} ({failure})")


def load_failed(entry: str, device_name: str, error: Exception) -> str:
    """Refuse ``device_name`` the arch-specific families because kernel ``entry`` could not
    be built or loaded there (e.g. no NVRTC beside a precompiled directory made for the
    portable kernels only); the reason, also logged."""
    with _lock:
        return _refuse(device_name, f"{entry} could not be loaded on {device_name} "
                                    f"({type(error).__name__}: {error})")


def _refuse(device_name: str, why: str) -> str:
    _refused[device_name] = why
    log.warning("%s; serving %s with the portable kernels from now on (set "
                "FLASHTUNE_ARCH_SPECIFIC=0 to skip the arch-specific ones)", why, device_name)
    return why


def forget() -> None:
    """Forget every check and refusal (tests; a process that changed its device setup)."""
    with _lock:
        _checked.clear()
        _refused.clear()
