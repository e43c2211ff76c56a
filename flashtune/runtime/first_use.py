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

The check cannot hang the process: it runs in a worker thread and is given
FLASHTUNE_FIRST_USE_TIMEOUT_S. A kernel that has not finished by then is hung (a deadlock in
the kernel keeps running on the device, so the process cannot use the device any more):
``KernelHung`` names the kernel and says how to continue (FLASHTUNE_ARCH_SPECIFIC=0), and the
hang is recorded so that no later process runs that kernel again. No check runs inside
CUDA-graph capture: ``CheckDuringCapture`` asks for one warm call first.

Checks ahead (``flashtune check --gpu``, ``check_ahead``): every arch-specific kernel the
runtime would serve on a device is checked once, each result recorded in the private cache
(namespace ``RECORDS``, keyed by device name and kernel digest). A serving process reads the
record before it checks: a recorded pass serves with no check (so inside capture too), a
recorded failure or hang refuses the device those kernels at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flashtune import settings
from flashtune._version import __version__
from flashtune.codegen.spec import KernelSource, Shape
from flashtune.errors import CheckDuringCapture, FlashtuneError, KernelHung
from flashtune.runtime.backends.base import LoadedKernel
from flashtune.toolchain.cache import ArtifactCache

if TYPE_CHECKING:
    from flashtune.runtime.device import DeviceInfo

log = logging.getLogger(__name__)

#: GQA (two query heads per KV head), lengths off every tile grid, more keys than queries (a
#: causal call sees a bottom-right diagonal): small enough to cost milliseconds on a GPU.
CHECK_SHAPE = Shape(batch=1, heads_q=2, heads_kv=1, seqlen_q=130, seqlen_k=200)

_lock = threading.Lock()
_checked: set[tuple[str, str]] = set()   # (device name, kernel entry) that passed
_refused: dict[str, str] = {}            # device name -> why its arch-specific kernels failed

#: The cache namespace of the recorded check results.
RECORDS = "first-use"


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
    float64 reference (or a recorded check ahead says it did), else what was wrong (and
    ``device_name`` is refused from then on).

    Raises CheckDuringCapture when a check is needed inside CUDA-graph capture, and
    KernelHung (after refusing the device and recording the hang) when the kernel does not
    finish within FLASHTUNE_FIRST_USE_TIMEOUT_S."""
    source = kernel.source
    key = (device_name, source.entry)
    if key in _checked:
        return None
    with _lock:
        if key in _checked:
            return None
        why = refused(device_name)
        if why is not None:
            return why
        ahead = recorded(device_name, source)
        if ahead is not None:
            if ahead.ok:
                _checked.add(key)
                return None
            return _refuse(device_name, f"{source.entry} failed its recorded check on "
                                        f"{device_name} ({ahead.reason})")
        if _capturing(device):
            raise CheckDuringCapture(
                f"{source.entry} (an arch-specific kernel) is checked against float64 on "
                f"{device_name} before it first serves a call, and the check cannot run "
                "inside CUDA-graph capture: make one call of the same kind before capturing "
                "(a warm call), or run `flashtune check --gpu` once on this device (its "
                "results are recorded, so no serving process needs a check), or set "
                "FLASHTUNE_ARCH_SPECIFIC=0 (the portable kernels)")
        try:
            failure = run_check(kernel, device, device_name)
        except KernelHung as exc:
            _record_quietly(device_name, source, False, _hung_reason(exc))
            _refuse(device_name, str(exc))
            raise
        if failure is None:
            _checked.add(key)
            return None
        return _refuse(device_name, f"{source.entry} failed its first-use check "
                                    f"against float64 on {device_name} ({failure})")


def run_check(kernel: LoadedKernel, device: torch.device | str, device_name: str,
              timeout_s: float | None = None) -> str | None:
    """One check of ``kernel`` on ``CHECK_SHAPE``: None when it matches float64, else what was
    wrong. It runs in a worker thread given ``timeout_s`` (default the setting
    FLASHTUNE_FIRST_USE_TIMEOUT_S); KernelHung, naming the kernel, if it is not done by then
    (the worker is left behind: a hung kernel cannot be stopped)."""
    from flashtune.runtime.launch import verify

    limit = settings.FIRST_USE_TIMEOUT_S.get() if timeout_s is None else timeout_s
    box: list[str | None | BaseException] = []

    def work() -> None:
        try:
            if torch.device(device).type == "cuda":
                with torch.cuda.device(device):
                    verdict = verify(kernel, CHECK_SHAPE, device)
            else:
                verdict = verify(kernel, CHECK_SHAPE, device)
            box.append(None if verdict.ok else verdict.message)
        except (FlashtuneError, RuntimeError) as exc:
            box.append(f"{type(exc).__name__}: {exc}")
        except BaseException as exc:  # re-raised in the caller's thread
            box.append(exc)

    worker = threading.Thread(target=work, name=f"flashtune-check-{kernel.source.entry}",
                              daemon=True)
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        raise KernelHung(
            f"{kernel.source.entry} did not finish its first-use check on {device_name} "
            f"within {limit:g} s (FLASHTUNE_FIRST_USE_TIMEOUT_S): the kernel is hung. It keeps "
            "running on the device, so this process cannot use the device any more: restart "
            "it with FLASHTUNE_ARCH_SPECIFIC=0 (the portable kernels). The hang is recorded, "
            "so later processes on this device skip the arch-specific kernels; `flashtune "
            "check --gpu --recheck` checks them again")
    result = box[0]
    if isinstance(result, BaseException):
        raise result
    return result


def _capturing(device: torch.device | str) -> bool:
    """Whether the current stream of CUDA ``device`` is capturing a CUDA graph."""
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def _hung_reason(exc: KernelHung) -> str:
    return str(exc).partition(": the kernel is hung")[0] + ": hung"


# ---------------------------------------------------------------------- recorded results


@dataclass(frozen=True)
class Recorded:
    """A recorded check of one kernel on one device: ``ok``, else ``reason`` says why not."""

    device: str
    entry: str
    ok: bool
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.device or not self.entry:
            raise ValueError(f"Recorded(device={self.device!r}, entry={self.entry!r}): both "
                             "must be non-empty")
        if self.ok == bool(self.reason):
            raise ValueError(f"Recorded(ok={self.ok}, reason={self.reason!r}): a failure "
                             "needs its reason and a pass has none")


def _records() -> ArtifactCache:
    """Where check results are recorded: the private kernel cache (FLASHTUNE_CACHE_DIR)."""
    return ArtifactCache()


def _record_key(device_name: str, source: KernelSource) -> str:
    text = f"{device_name}\0{source.target}\0{source.digest}"
    return hashlib.sha256(text.encode()).hexdigest()


def recorded(device_name: str, source: KernelSource) -> Recorded | None:
    """The recorded check of ``source`` on ``device_name``, or None (none, or unreadable:
    then the kernel is checked as if none was recorded)."""
    try:
        raw = _records().load_bytes(RECORDS, _record_key(device_name, source), ".json")
        if raw is None:
            return None
        data = json.loads(raw)
        found = Recorded(str(data["device"]), str(data["entry"]), data["ok"] is True,
                         str(data["reason"]))
    except (FlashtuneError, OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("the recorded check of %s on %s cannot be read (%s); checking it again",
                    source.entry, device_name, exc)
        return None
    return found if (found.device, found.entry) == (device_name, source.entry) else None


def record(device_name: str, source: KernelSource, ok: bool, reason: str = "") -> Recorded:
    """Record the check of ``source`` on ``device_name`` (replacing an earlier one)."""
    result = Recorded(device_name, source.entry, ok, reason)
    key = _record_key(device_name, source)
    data = json.dumps({"device": result.device, "entry": result.entry, "ok": result.ok,
                       "reason": result.reason, "flashtune": __version__}).encode()
    store = _records()
    store.discard(RECORDS, key, ".json")
    store.put_bytes(RECORDS, key, ".json", data)
    return result


def _record_quietly(device_name: str, source: KernelSource, ok: bool, reason: str) -> None:
    try:
        record(device_name, source, ok, reason)
    except FlashtuneError as exc:  # a read-only cache: the hang is still reported
        log.warning("could not record the check of %s: %s", source.entry, exc)


def check_ahead(kernels: Iterable[LoadedKernel], device: torch.device | str,
                device_name: str, *, recheck: bool = False,
                timeout_s: float | None = None,
                on_start: Callable[[KernelSource], None] | None = None
                ) -> Iterator[tuple[Recorded, bool]]:
    """Check each of ``kernels`` on ``device`` and record the result; yields (result, fresh):
    fresh False for a kernel recorded before (skipped unless ``recheck``). A hung kernel is
    recorded and its KernelHung raised: nothing more can run on the device in this process
    (run the checks again in a new one; the hung kernel is then skipped)."""
    for kernel in kernels:
        source = kernel.source
        before = None if recheck else recorded(device_name, source)
        if before is not None:
            yield before, False
            continue
        if on_start is not None:
            on_start(source)
        try:
            failure = run_check(kernel, device, device_name, timeout_s)
        except KernelHung as exc:
            record(device_name, source, False, _hung_reason(exc))
            raise
        yield record(device_name, source, failure is None, failure or ""), True


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
