"""Plans: a call's decided and loaded kernel, memoised for every op (forward, backward,
decoding).

A *plan* is everything a launch of one kernel family needs that does not change between
calls of one (backend, device, dtype, head dim, causal, feature switches, sequence bucket,
op): the dispatcher's decision, the rendered source, the loaded kernel, the current-stream
lookup and the family's hot-path packer (``KernelFamily.hot_packer``). Plans live in one
dictionary, so a warm call costs one lookup: no compile, no database, no file access.

A decision for an arch-specific family (one that ``serves`` the op on this device, e.g. the
sm_90a forward) is loaded and passes its first-use check against float64 on the device
before its plan is kept; a failure refuses the device those families (``first_use``) and the
portable family's plan is made instead.

The op-specific compositions (``forward``, ``backward``, ``decode``) ask for plans here and
keep only their own launches.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from flashtune import families, settings
from flashtune.codegen.spec import (
    MAX_SEQ_BUCKET,
    MIN_SEQ_BUCKET,
    KernelConfig,
    KernelSource,
    Problem,
    ProblemBucket,
)
from flashtune.errors import FlashtuneError, InvalidInput
from flashtune.families import render
from flashtune.families.base import element_type, operand_type
from flashtune.runtime import first_use
from flashtune.runtime.backends import BackendEntry, backend_entry, get_backend
from flashtune.runtime.backends.base import LoadedKernel
from flashtune.runtime.dispatch import Decision, DeviceLike, get_dispatcher


def seqlen_bucket(seqlen: int) -> int:
    """``codegen.spec.seq_bucket`` for seqlen >= 1, with integer arithmetic only."""
    bucket = 1 << (seqlen - 1).bit_length()
    return MIN_SEQ_BUCKET if bucket < MIN_SEQ_BUCKET else min(bucket, MAX_SEQ_BUCKET)


def emulator_arch() -> str:
    """The arch of the emulator's virtual device: the configs it runs are chosen as for a GPU
    of this arch (the tuned results of that arch family, else its defaults)."""
    return settings.EMULATOR_ARCH.get()


def resolve_backend(name: str | None, device: torch.device) -> BackendEntry:
    """The backend that serves tensors on ``device``; InvalidInput if they do not fit.

    ``None`` or ``""`` means the FLASHTUNE_BACKEND setting; ``auto`` means cuda for CUDA tensors.
    CPU tensors are only served when the emulator is asked for explicitly.
    """
    chosen = name or settings.BACKEND.get()
    if chosen == "auto":
        if device.type == "cpu":
            raise InvalidInput(
                "the tensors are on the CPU; flashtune runs on CUDA tensors. Move them with "
                ".cuda(), or run the CPU emulator (slow, for verification) with "
                "backend='emulator' or FLASHTUNE_BACKEND=emulator")
        chosen = "cuda"
    entry = backend_entry(chosen)
    if device.type not in ("meta", entry.device_type):
        where = "CUDA" if entry.device_type == "cuda" else "CPU"
        fix = (".cuda()" if entry.device_type == "cuda" else
               ".cpu() (the emulator runs on CPU tensors), or backend='cuda'")
        raise InvalidInput(f"backend {chosen!r} runs on {where} tensors but the tensors are on "
                           f"{device}; move them with {fix}")
    return entry


def device_info(entry: BackendEntry, device: torch.device) -> DeviceLike:
    """The device the dispatcher chooses for: the GPU, or the emulator's virtual GPU."""
    from flashtune.runtime.device import DeviceInfo

    info = (DeviceInfo.current(device.index) if entry.device_type == "cuda"
            else DeviceInfo.virtual(emulator_arch()))
    served: DeviceLike = first_use.without_refused(info)
    return served


class Operands(NamedTuple):
    """Where a call's operands differ from q (None: as q): O's type (FP8 inputs give a
    16-bit O), K/V's type (an FP8 KV cache beside a 16-bit q) and V's head dim (V's own:
    FeatureNotSupported where the family does not take it). Part of a plan's key (a tuple:
    hashed on every call of the hot path)."""

    o_dtype: torch.dtype | None = None
    kv_dtype: torch.dtype | None = None
    head_dim_v: int | None = None


#: Every operand as q.
AS_Q = Operands()


def problem_bucket(q: torch.Tensor, causal: bool, op: str, features: tuple[str, ...],
                   seqlen: int, shape_class: str = "", operands: Operands = AS_Q
                   ) -> ProblemBucket:
    """The tuning bucket of a call of kernel family ``op`` with q's head dim and dtype, the
    Problem feature switches ``features`` on (FeatureNotSupported if the family has not got
    one of them), ``seqlen`` the length that picks the bucket, the call's ``shape_class``
    (``ProblemBucket.shape_class``) and its ``operands`` where they are not q's."""
    o, kv = operands.o_dtype, operands.kv_dtype
    problem = Problem(head_dim=q.shape[3], dtype=operand_type(q.dtype), causal=causal, op=op,
                      features=features, o_dtype=None if o is None else element_type(o),
                      head_dim_v=operands.head_dim_v,
                      kv_dtype=None if kv is None else operand_type(kv))
    if features or problem.split_head_dims:
        families.get(op).check_problem(problem)
    return ProblemBucket(problem, seqlen_bucket(max(1, seqlen)), shape_class)


def decide(q: torch.Tensor, causal: bool, backend: str | None, op: str,
           features: tuple[str, ...], seqlen: int, arch: str | None = None,
           shape_class: str = "", operands: Operands = AS_Q
           ) -> tuple[Decision, BackendEntry]:
    """The dispatcher's decision for a call (nothing is loaded or compiled); ``arch``
    overrides the device with a virtual GPU of that arch; the rest as in
    ``problem_bucket``."""
    from flashtune.runtime.device import DeviceInfo

    entry = resolve_backend(backend, q.device)
    device = DeviceInfo.virtual(arch) if arch else device_info(entry, q.device)
    bucket = problem_bucket(q, causal, op, features, seqlen, shape_class, operands)
    return get_dispatcher().decide(bucket, device), entry


@dataclass(frozen=True)
class Plan:
    """A decided and loaded kernel for one (backend, device, problem bucket).

    ``stream``: the current stream's handle (0 off the GPU); ``on_gpu``: the backend runs on
    CUDA tensors; ``sm_count``: the device's SMs (None for a virtual device); ``pack``: the
    family's hot-path packer (``KernelFamily.hot_packer``; its calling convention is the
    op's), None where the op packs itself."""

    decision: Decision
    source: KernelSource
    kernel: LoadedKernel
    stream: Callable[[], int]
    on_gpu: bool
    sm_count: int | None = None
    pack: Any = None

    @property
    def block_m(self) -> int:
        return self.source.config.block_m


def _cuda_stream(device: torch.device) -> Callable[[], int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return lambda: int(raw(index))
    return lambda: int(torch.cuda.current_stream(index).cuda_stream)


def _no_stream() -> int:
    return 0


def _load(decision: Decision, entry: BackendEntry, device: torch.device) -> Plan:
    source = render(decision.problem, decision.config)
    loader = get_backend(entry.name)
    pack = families.of(decision.problem).hot_packer(decision.problem, decision.config)
    sm_count = getattr(device_info(entry, device), "sm_count", None)
    if entry.device_type == "cuda":
        with torch.cuda.device(device):
            kernel = loader.load(source)
        return Plan(decision, source, kernel, _cuda_stream(device), True, sm_count, pack)
    return Plan(decision, source, loader.load(source), _no_stream, False, sm_count, pack)


def _make(q: torch.Tensor, causal: bool, backend: str, op: str, features: tuple[str, ...],
          seqlen: int, shape_class: str, operands: Operands) -> Plan:
    """The decided and loaded kernel; one of an arch-specific family (served in place of
    ``op``) passes its first-use check first, else the portable family's is decided."""
    decision, entry = decide(q, causal, backend, op, features, seqlen,
                             shape_class=shape_class, operands=operands)
    if decision.problem.op == op:
        return _load(decision, entry, q.device)
    try:
        plan = _load(decision, entry, q.device)
    except FlashtuneError as exc:
        entry_point = render(decision.problem, decision.config).entry
        first_use.load_failed(entry_point, decision.device, exc)
    else:
        if first_use.check(plan.kernel, q.device, decision.device) is None:
            return plan
    # the device is refused the arch-specific families now: the portable family's plan
    decision, entry = decide(q, causal, backend, op, features, seqlen,
                             shape_class=shape_class, operands=operands)
    return _load(decision, entry, q.device)


_plans: dict[tuple[object, ...], Plan] = {}
_plans_lock = threading.Lock()


def plan_for(q: torch.Tensor, causal: bool, backend: str, op: str,
             features: tuple[str, ...], seqlen: int, shape_class: str = "",
             operands: Operands = AS_Q) -> Plan:
    """The memoised plan of a call of kernel family ``op`` on q's device, dtype and head
    dim, with the feature switches ``features``, ``seqlen`` the length that picks the
    sequence bucket, the call's ``shape_class`` and its ``operands`` where they are not
    q's (made, and its kernel loaded, on first use)."""
    # get_device(): the CUDA index, -1 for CPU tensors (the only other kind that gets here).
    key = (backend, q.get_device(), q.dtype, q.shape[3], causal, seqlen_bucket(seqlen),
           features, shape_class, operands, op)
    plan = _plans.get(key)
    if plan is None:
        with _plans_lock:
            plan = _plans.get(key)
            if plan is None:
                plan = _make(q, causal, backend, op, features, seqlen, shape_class, operands)
                _plans[key] = plan
    return plan


def retiled(plan: Plan, config: KernelConfig, q: torch.Tensor, backend: str) -> Plan:
    """``plan`` with its kernel rendered for ``config`` (the same problem, decision tier and
    backend): for an op that adapts its decided tile to a call's shape (decoding raises
    block_m to cover a GQA group's rows); memoised with the plans."""
    if config == plan.source.config:
        return plan
    key = ("retiled", backend, q.get_device(), plan.source.problem, config)
    made = _plans.get(key)
    if made is None:
        with _plans_lock:
            made = _plans.get(key)
            if made is None:
                entry = resolve_backend(backend, q.device)
                made = _load(dataclasses.replace(plan.decision, config=config), entry,
                             q.device)
                _plans[key] = made
    return made


def cached() -> dict[tuple[object, ...], Plan]:
    """A copy of the memoised plans by key: (backend, device index, dtype, head dim,
    causal, sequence bucket, features, shape class, O's dtype, V's head dim, op)."""
    with _plans_lock:
        return dict(_plans)


#: Memos an op derives from plans (decoding's row covers and split tables), emptied with
#: the plans.
_derived: list[dict[Any, Any]] = []


def derived_cache() -> dict[Any, Any]:
    """A new memo that ``clear_caches`` empties with the plans (for what an op derives from
    plans or from the dispatcher's decisions)."""
    cache: dict[Any, Any] = {}
    _derived.append(cache)
    return cache


def clear_caches() -> None:
    """Forget every plan and every derived memo (loaded kernels stay in their backends'
    caches)."""
    with _plans_lock:
        _plans.clear()
        for cache in _derived:
            cache.clear()
