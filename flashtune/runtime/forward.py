"""Running the forward family's kernel on validated tensors: backend, plan, outputs,
arguments, launch.

A *plan* is everything a call needs that does not change between calls of one (backend,
device, dtype, head dim, causal, features, sequence bucket): the dispatcher's decision and
the loaded kernel. Plans are memoised in one dictionary, so a warm call costs one lookup, two output
allocations, the argument tuple and the launch: no compile, no database, no file access.

``forward`` is the implementation of the ``flashtune::attention_fwd`` op; it expects inputs
that passed ``validate.check_attention_inputs``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashtune import families, knobs
from flashtune.codegen.spec import (
    MAX_SEQ_BUCKET,
    MIN_SEQ_BUCKET,
    KernelSource,
    Problem,
    ProblemBucket,
)
from flashtune.errors import FlashtuneError, InvalidInput
from flashtune.families import render
from flashtune.families.base import element_type
from flashtune.families.fwd.args import grid, pack_args, variant_args
from flashtune.runtime import first_use
from flashtune.runtime.backends import BackendEntry, backend_entry, get_backend
from flashtune.runtime.backends.base import LoadedKernel
from flashtune.runtime.dispatch import Decision, DeviceLike, get_dispatcher
from flashtune.runtime.variants import Variant


def seqlen_bucket(seqlen: int) -> int:
    """``codegen.spec.seq_bucket`` for seqlen >= 1, with integer arithmetic only."""
    bucket = 1 << (seqlen - 1).bit_length()
    return MIN_SEQ_BUCKET if bucket < MIN_SEQ_BUCKET else min(bucket, MAX_SEQ_BUCKET)


def emulator_arch() -> str:
    """The arch of the emulator's virtual device: the configs it runs are chosen as for a GPU
    of this arch (the tuned results of that arch family, else its defaults)."""
    return knobs.EMULATOR_ARCH.get()


def resolve_backend(name: str | None, device: torch.device) -> BackendEntry:
    """The backend that serves tensors on ``device``; InvalidInput if they do not fit.

    ``None`` or ``""`` means the FLASHTUNE_BACKEND knob; ``auto`` means cuda for CUDA tensors.
    CPU tensors are only served when the emulator is asked for explicitly.
    """
    chosen = name or knobs.BACKEND.get()
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


def problem_bucket(q: torch.Tensor, k: torch.Tensor, causal: bool, op: str = "fwd",
                   features: tuple[str, ...] = (), longest: tuple[int, int] | None = None
                   ) -> ProblemBucket:
    """The tuning bucket of a call of kernel family ``op`` on these tensors, with the
    Problem feature switches ``features`` on (FeatureNotSupported if the family has not
    got one of them). ``longest``: the longest query and key sequences when they are not
    q's and k's second dims (varlen)."""
    problem = Problem(head_dim=q.shape[3], dtype=element_type(q.dtype), causal=causal, op=op,
                      features=features)
    if features:
        families.get(op).check_problem(problem)
    lengths = longest if longest is not None else (q.shape[1], k.shape[1])
    return ProblemBucket(problem, seqlen_bucket(max(1, *lengths)))


def decide(q: torch.Tensor, k: torch.Tensor, causal: bool, backend: str | None,
           arch: str | None = None, op: str = "fwd", features: tuple[str, ...] = (),
           longest: tuple[int, int] | None = None) -> tuple[Decision, BackendEntry]:
    """The dispatcher's decision for these tensors (no kernel is loaded or compiled), for
    kernel family ``op`` (the forward unless named) with the feature switches ``features``.

    ``arch`` overrides the device with a virtual GPU of that arch.
    """
    from flashtune.runtime.device import DeviceInfo

    entry = resolve_backend(backend, q.device)
    device = DeviceInfo.virtual(arch) if arch else device_info(entry, q.device)
    bucket = problem_bucket(q, k, causal, op, features, longest)
    return get_dispatcher().decide(bucket, device), entry


@dataclass(frozen=True)
class Plan:
    """A decided and loaded kernel for one (backend, device, problem bucket)."""

    decision: Decision
    source: KernelSource
    kernel: LoadedKernel
    stream: Callable[[], int]

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


def _make_plan(q: torch.Tensor, k: torch.Tensor, causal: bool, backend: str, op: str,
               features: tuple[str, ...], longest: tuple[int, int]) -> Plan:
    """The decided and loaded kernel; one of an arch-specific family (served in place of
    ``op``) passes its first-use check first, else the portable family's is decided."""
    decision, entry = decide(q, k, causal, backend, op=op, features=features, longest=longest)
    if decision.problem.op == op:
        return _load_plan(decision, entry, q.device)
    try:
        plan = _load_plan(decision, entry, q.device)
    except FlashtuneError as exc:
        entry_point = render(decision.problem, decision.config).entry
        first_use.load_failed(entry_point, decision.device, exc)
    else:
        if first_use.check(plan.kernel, q.device, decision.device) is None:
            return plan
    # the device is refused the arch-specific families now: the portable family's plan
    decision, entry = decide(q, k, causal, backend, op=op, features=features, longest=longest)
    return _load_plan(decision, entry, q.device)


def _load_plan(decision: Decision, entry: BackendEntry, device: torch.device) -> Plan:
    source = render(decision.problem, decision.config)
    loader = get_backend(entry.name)
    if entry.device_type == "cuda":
        with torch.cuda.device(device):
            kernel = loader.load(source)
        return Plan(decision, source, kernel, _cuda_stream(device))
    return Plan(decision, source, loader.load(source), _no_stream)


_plans: dict[tuple[object, ...], Plan] = {}
_plans_lock = threading.Lock()


def plan_for(q: torch.Tensor, k: torch.Tensor, causal: bool, backend: str, op: str = "fwd",
             features: tuple[str, ...] = (), longest: tuple[int, int] | None = None) -> Plan:
    """The memoised plan of this call of kernel family ``op`` with the Problem feature
    switches ``features`` (made, and its kernel loaded, on first use); ``longest`` as in
    ``problem_bucket``."""
    _, seqlen_q, _, head_dim = q.shape
    seqlen_k = k.shape[1]
    if longest is not None:
        seqlen_q, seqlen_k = longest
    bucket = seqlen_bucket(seqlen_q if seqlen_q > seqlen_k else seqlen_k)
    # get_device(): the CUDA index, -1 for CPU tensors (the only other kind that gets here).
    key = (backend, q.get_device(), q.dtype, head_dim, causal, bucket, features, op)
    plan = _plans.get(key)
    if plan is None:
        with _plans_lock:
            plan = _plans.get(key)
            if plan is None:
                plan = _make_plan(q, k, causal, backend, op, features, (seqlen_q, seqlen_k))
                _plans[key] = plan
    return plan


def clear_caches() -> None:
    """Forget every plan (loaded kernels stay in their backends' caches)."""
    with _plans_lock:
        _plans.clear()


def _misaligned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> InvalidInput:
    bad = [name for name, t in (("q", q), ("k", k), ("v", v)) if t.data_ptr() % 16]
    return InvalidInput(f"{', '.join(bad)} start(s) at an address that is not 16-byte aligned "
                        "(a view with an odd storage offset); the kernel loads 16-byte chunks. "
                        "Pass a copy made with .clone() or .contiguous()")


def empty_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised O (like q, same strides when q is dense) and LSE (B, Hq, Nq) float32."""
    batch, seqlen_q, heads_q, _ = q.shape
    # Sizes as separate ints: torch parses them several times faster than a tuple.
    return (torch.empty_like(q),
            torch.empty(batch, heads_q, seqlen_q, dtype=torch.float32, device=q.device))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            softmax_scale: float, backend: str, variant: Variant | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """O (like q) and the float32 LSE (B, Hq, Nq) of validated inputs, launched on the
    current stream. ``backend`` "" means the FLASHTUNE_BACKEND knob. ``variant``: the
    call's validated features (``runtime.variants.resolve``; its ``causal`` is ignored in
    favour of ``causal``), None for none."""
    name = backend or knobs.BACKEND.get()
    features = variant.features if variant is not None else ()
    varlen = variant.varlen if variant is not None else None
    longest = None if varlen is None else (varlen.max_seqlen_q, varlen.max_seqlen_k)
    plan = plan_for(q, k, causal, name, features=features, longest=longest)
    out, lse = empty_outputs(q)
    args = pack_args(q, k, v, out, lse, softmax_scale)
    if variant is not None and features:
        args += variant_args(plan.decision.problem, variant.window, variant.softcap,
                             variant.alibi_slopes, varlen)
    if (args[0][1] | args[1][1] | args[2][1]) & 15:  # type: ignore[operator]  # pointers
        raise _misaligned(q, k, v)
    batch, seqlen_q, heads_q, _ = q.shape
    if varlen is not None:
        batch, seqlen_q = varlen.batch, varlen.max_seqlen_q
    plan.kernel.launch(grid(seqlen_q, heads_q, batch, plan.block_m), args,
                       stream=plan.stream())
    return out, lse
