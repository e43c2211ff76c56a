"""``attention_with_kvcache``: split-KV decoding over a (paged) KV cache.

One call is two launches on the current stream: the ``decode`` family's kernel writes
float32 partial O and LSE per split (the query heads of a GQA group packed into the rows of
one block, the new rows appended to the cache in place), and the ``combine`` family's kernel
merges the splits. The split count comes from the caller, else from FlashAttention-2's
wave-efficiency rule over the SM count, batch x kv heads x row blocks and the cache
capacity in key blocks (the lengths live on the device and are never read back, so a call
never synchronises and can be captured in a CUDA graph), unless the tuned config of the
bucket fixes it (the decode family's ``splits`` knob).

Bad cache lengths and block-table entries are never followed by the kernel; they are
reported as InvalidInput immediately on the emulator, after a synchronisation on the GPU
with ``FLASHTUNE_CHECK_INPUTS=1``, and otherwise by a trap in the kernel, which surfaces at
the next synchronisation (rerun with the knob for the message).

Plans (the dispatcher's decisions and the loaded kernels of one backend, device, dtype,
head dim, mask and capacity bucket) are memoised as in ``forward``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashtune import knobs
from flashtune.codegen.spec import KernelConfig, Problem, ProblemBucket
from flashtune.errors import InvalidInput
from flashtune.families import render
from flashtune.families.base import element_type
from flashtune.families.combine import combine_grid, pack_combine_args
from flashtune.families.decode import NOMINAL_SMS
from flashtune.families.decode.args import decode_grid, m_blocks, pack_decode_args
from flashtune.families.decode.space import config_splits
from flashtune.families.decode.splits import heuristic_splits
from flashtune.families.decode.status import STATUS_WORDS, describe
from flashtune.runtime.backends import get_backend
from flashtune.runtime.backends.base import LoadedKernel
from flashtune.runtime.dispatch import Decision, get_dispatcher
from flashtune.runtime.forward import device_info, resolve_backend, seqlen_bucket
from flashtune.runtime.validate_kvcache import KvCacheLayout


@dataclass(frozen=True)
class DecodePlan:
    """Decided and loaded decode and combine kernels for one (backend, device, problem,
    capacity bucket)."""

    decode: Decision
    combine: Decision
    decode_kernel: LoadedKernel
    combine_kernel: LoadedKernel
    stream: Callable[[], int]
    sm_count: int
    on_gpu: bool


def decode_problems(dtype: torch.dtype, head_dim: int, causal: bool,
                    capacity: int) -> tuple[ProblemBucket, ProblemBucket]:
    """The tuning buckets of the two kernels of a call (by cache capacity)."""
    bucket = seqlen_bucket(capacity)
    dt = element_type(dtype)
    return (ProblemBucket(Problem(head_dim, dt, causal=causal, op="decode"), bucket),
            ProblemBucket(Problem(head_dim, dt, op="combine"), bucket))


def decide(q: torch.Tensor, causal: bool, capacity: int, backend: str | None,
           arch: str | None = None) -> tuple[Decision, Decision]:
    """The dispatcher's decisions for the decode and combine kernels of a call (nothing is
    loaded); ``arch`` asks about a virtual GPU of that arch."""
    from flashtune.runtime.device import DeviceInfo

    entry = resolve_backend(backend, q.device)
    device = DeviceInfo.virtual(arch) if arch else device_info(entry, q.device)
    decode, combine = decode_problems(q.dtype, q.shape[3], causal, capacity)
    dispatcher = get_dispatcher()
    return dispatcher.decide(decode, device), dispatcher.decide(combine, device)


def _make_plan(q: torch.Tensor, causal: bool, capacity: int, backend: str) -> DecodePlan:
    from flashtune.runtime.forward import _cuda_stream, _no_stream

    entry = resolve_backend(backend, q.device)
    device = device_info(entry, q.device)
    decode, combine = decide(q, causal, capacity, backend)
    loader = get_backend(entry.name)
    on_gpu = entry.device_type == "cuda"
    sm_count = getattr(device, "sm_count", None) or NOMINAL_SMS
    if on_gpu:
        with torch.cuda.device(q.device):
            kernels = [loader.load(render(d.problem, d.config)) for d in (decode, combine)]
        stream = _cuda_stream(q.device)
    else:
        kernels = [loader.load(render(d.problem, d.config)) for d in (decode, combine)]
        stream = _no_stream
    return DecodePlan(decode, combine, kernels[0], kernels[1], stream, sm_count, on_gpu)


_plans: dict[tuple[object, ...], DecodePlan] = {}
_plans_lock = threading.Lock()
_status: dict[int, torch.Tensor] = {}


def plan_for(q: torch.Tensor, causal: bool, capacity: int, backend: str) -> DecodePlan:
    """The memoised plan of this call (made, and its kernels loaded, on first use)."""
    key = (backend, q.get_device(), q.dtype, q.shape[3], causal, seqlen_bucket(capacity))
    plan = _plans.get(key)
    if plan is None:
        with _plans_lock:
            plan = _plans.get(key)
            if plan is None:
                plan = _make_plan(q, causal, capacity, backend)
                _plans[key] = plan
    return plan


def clear_caches() -> None:
    """Forget every decode plan (loaded kernels stay in their backends' caches)."""
    with _plans_lock:
        _plans.clear()


def default_num_splits(layout: KvCacheLayout, block_m: int, block_n: int,
                       sm_count: int) -> int:
    """FlashAttention-2's split count for this call on ``sm_count`` SMs."""
    blocks = layout.batch * layout.heads_kv * m_blocks(layout.heads_q, layout.heads_kv,
                                                       layout.seqlen_q, block_m)
    return heuristic_splits(blocks, sm_count, -(-layout.capacity // block_n))


def choose_splits(num_splits: int, config: KernelConfig, layout: KvCacheLayout,
                  sm_count: int) -> int:
    """The split count of a call: the caller's (``num_splits`` > 0), else the one the
    bucket's config fixes (a tuned ``splits`` knob), else the heuristic."""
    return num_splits or config_splits(config) or default_num_splits(
        layout, config.block_m, config.block_n, sm_count)


def _status_buffer(q: torch.Tensor, trap: bool) -> torch.Tensor:
    """Where the kernel reports a bad input. A trapping kernel never leaves a report behind
    in a usable context, so one zeroed buffer per GPU serves every call; a checked call gets
    a fresh one."""
    if not trap:
        return torch.zeros(STATUS_WORDS, dtype=torch.int32, device=q.device)
    index = q.get_device()
    buffer = _status.get(index)
    if buffer is None:
        buffer = _status.setdefault(index, torch.zeros(STATUS_WORDS, dtype=torch.int32,
                                                       device=q.device))
    return buffer


def _misaligned(named: dict[str, torch.Tensor | None]) -> InvalidInput | None:
    bad = [n for n, t in named.items() if t is not None and t.data_ptr() % 16]
    if not bad:
        return None
    return InvalidInput(f"{', '.join(bad)} start(s) at an address that is not 16-byte aligned "
                        "(a view with an odd storage offset); the kernel moves 16-byte chunks. "
                        "Pass a copy made with .clone() or .contiguous()")


def run_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
               k: torch.Tensor | None, v: torch.Tensor | None, layout: KvCacheLayout,
               causal: bool, softmax_scale: float, num_splits: int, backend: str
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """O (like q) and the float32 LSE (batch, heads_q, seqlen_q) of validated inputs,
    launched on the current stream; ``num_splits`` 0 means the heuristic; ``backend`` ""
    means the FLASHTUNE_BACKEND knob."""
    name = backend or knobs.BACKEND.get()
    plan = plan_for(q, causal, layout.capacity, name)
    splits = choose_splits(num_splits, plan.decode.config, layout, plan.sm_count)
    config = plan.decode.config
    wrong = _misaligned({"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v})
    if wrong is not None:
        raise wrong
    checked = not plan.on_gpu or knobs.CHECK_INPUTS.get()
    status = _status_buffer(q, trap=not checked)
    batch, seqlen_q, heads_q, dim = q.shape
    o_part = torch.empty(splits, batch, heads_q, seqlen_q, dim, dtype=torch.float32,
                         device=q.device)
    lse_part = torch.empty(splits, batch, heads_q, seqlen_q, dtype=torch.float32,
                           device=q.device)
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads_q, seqlen_q, dtype=torch.float32, device=q.device)
    stream = plan.stream()
    plan.decode_kernel.launch(
        decode_grid(batch, heads_q, layout.heads_kv, seqlen_q, config.block_m, splits),
        pack_decode_args(q, k_cache, v_cache, k, v, block_table, cache_seqlens, o_part,
                         lse_part, status, num_splits=splits, softmax_scale=softmax_scale,
                         trap_on_error=not checked),
        stream=stream)
    plan.combine_kernel.launch(combine_grid(batch * heads_q * seqlen_q,
                                            plan.combine.config.block_m),
                               pack_combine_args(o_part, lse_part, out, lse), stream=stream)
    if checked:
        if plan.on_gpu:
            torch.cuda.current_stream(q.device).synchronize()
        words = status.tolist()
        if any(words):
            raise InvalidInput(describe(words, seqlen_new=layout.seqlen_new,
                                        capacity=layout.capacity,
                                        num_pages=layout.num_pages if layout.paged else None))
    return out, lse
