"""``attention_with_kvcache``: split-KV decoding over a (paged) KV cache.

One call is two launches on the current stream: the ``decode`` family's kernel writes
float32 partial O and LSE per split (the query heads of a GQA group packed into the rows of
one block, the new rows appended to the cache in place), and the ``combine`` family's kernel
merges the splits. The split count comes from the caller, else from FlashAttention-2's
wave-efficiency rule over the SM count, batch x kv heads x row blocks and the cache
capacity in key blocks (the lengths live on the device and are never read back, so a call
never synchronises and can be captured in a CUDA graph), unless the tuned config of the
bucket fixes it (the decode family's ``splits`` knob).

Bad cache lengths and block-table entries, and pages that a sequence appends into while
another slot uses them, are reported as InvalidInput before the launch (nothing is written)
on the emulator and, after a synchronisation, on the GPU with ``FLASHTUNE_CHECK_INPUTS=1``
(``validate_kvcache.check_cache_values``). The kernel checks the lengths and pages again
and never follows a bad one: in the emulator it reports it, on a GPU it stops with a trap
that surfaces at the next synchronisation (without the setting, the only check there: rerun
with it for the message; a trap loses the CUDA context, cache included). Without the setting
shared pages are not looked for on a GPU: that would cost a synchronisation per call.

The two kernels' plans (``runtime.plans``; bucketed by the cache capacity) are memoised with
every other op's. Attention sinks join where the final O and LSE are written: the combine
kernel of a ``sinks`` problem (the splits' partial LSEs leave the sink out, so the decode
kernel is the one without sinks).
"""

from __future__ import annotations

import torch

from flashtune import settings
from flashtune.api.validate_kvcache import KvCacheLayout, check_cache_values
from flashtune.api.variants import Variant, kernel_features
from flashtune.codegen.spec import KernelConfig, ProblemBucket
from flashtune.errors import InvalidInput
from flashtune.families.combine import combine_grid, pack_combine_args
from flashtune.families.decode import NOMINAL_SMS
from flashtune.families.decode.args import decode_grid, m_blocks, pack_decode_args
from flashtune.families.decode.space import config_splits
from flashtune.families.decode.splits import heuristic_splits
from flashtune.families.decode.status import STATUS_WORDS, describe
from flashtune.families.fwd.args import feature_values
from flashtune.runtime import plans
from flashtune.runtime.dispatch import Decision
from flashtune.runtime.plans import Plan, clear_caches

__all__ = ["choose_splits", "clear_caches", "decide", "decode_problems", "default_num_splits",
           "plan_for", "run_decode"]


def decode_problems(q: torch.Tensor, causal: bool, capacity: int
                    ) -> tuple[ProblemBucket, ProblemBucket]:
    """The tuning buckets of the two kernels of a call (by cache capacity)."""
    return (plans.problem_bucket(q, causal, "decode", (), capacity),
            plans.problem_bucket(q, False, "combine", (), capacity))


def decide(q: torch.Tensor, causal: bool, capacity: int, backend: str | None,
           arch: str | None = None) -> tuple[Decision, Decision]:
    """The dispatcher's decisions for the decode and combine kernels of a call (nothing is
    loaded); ``arch`` asks about a virtual GPU of that arch."""
    decode, _ = plans.decide(q, causal, backend, "decode", (), capacity, arch)
    combine, _ = plans.decide(q, False, backend, "combine", (), capacity, arch)
    return decode, combine


def plan_for(q: torch.Tensor, causal: bool, capacity: int, backend: str,
             features: tuple[str, ...] = ()) -> tuple[Plan, Plan]:
    """The memoised plans of the decode and combine kernels of this call with the feature
    switches ``features`` (the decode kernel's but sinks, the combine's only sinks)."""
    combine = ("sinks",) if "sinks" in features else ()
    return (plans.plan_for(q, causal, backend, "decode", kernel_features("decode", features),
                           capacity),
            plans.plan_for(q, False, backend, "combine", combine, capacity))


_status: dict[int, torch.Tensor] = {}


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
    """Where the kernel reports a bad input. A trapping kernel (on a GPU) never leaves a
    report behind in a usable context, so one zeroed buffer per GPU serves every call; a
    reporting one (the emulator) gets a fresh one."""
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
               causal: bool, softmax_scale: float, num_splits: int, backend: str,
               variant: Variant | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """O (like q) and the float32 LSE (batch, heads_q, seqlen_q) of validated inputs,
    launched on the current stream, with the features ``variant`` (None: none);
    ``num_splits`` 0 means the heuristic; ``backend`` "" means the FLASHTUNE_BACKEND
    setting."""
    name = backend or settings.BACKEND.get()
    features = variant.features if variant is not None else ()
    decode, combine = plan_for(q, causal, layout.capacity, name, features)
    features = decode.source.problem.features  # the decode kernel's (sinks: the combine's)
    config = decode.decision.config
    splits = choose_splits(num_splits, config, layout, decode.sm_count or NOMINAL_SMS)
    wrong = _misaligned({"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v})
    if wrong is not None:
        raise wrong
    if not decode.on_gpu or settings.CHECK_INPUTS.get():  # before the launch: a refused call
        check_cache_values(cache_seqlens, block_table, layout)  # appends nothing
    # The kernel's own check backs it up: on a GPU it traps (no synchronisation to read a
    # report), in the emulator it reports in the status buffer, read for free.
    trap = decode.on_gpu
    status = _status_buffer(q, trap=trap)
    batch, seqlen_q, heads_q, dim = q.shape
    o_part = torch.empty(splits, batch, heads_q, seqlen_q, dim, dtype=torch.float32,
                         device=q.device)
    lse_part = torch.empty(splits, batch, heads_q, seqlen_q, dtype=torch.float32,
                           device=q.device)
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads_q, seqlen_q, dtype=torch.float32, device=q.device)
    stream = decode.stream()
    decode.kernel.launch(
        decode_grid(batch, heads_q, layout.heads_kv, seqlen_q, config.block_m, splits),
        pack_decode_args(q, k_cache, v_cache, k, v, block_table, cache_seqlens, o_part,
                         lse_part, status, num_splits=splits, softmax_scale=softmax_scale,
                         trap_on_error=trap, features=features,
                         feature_args=feature_values(decode.source.problem, variant)
                         if features else None),
        stream=stream)
    # The sinks join where the final O and LSE are written: here, in the combine.
    combine.kernel.launch(combine_grid(batch * heads_q * seqlen_q, combine.block_m),
                          pack_combine_args(o_part, lse_part, out, lse,
                                            variant.sinks if variant is not None else None),
                          stream=stream)
    if not trap:
        words = status.tolist()
        if any(words):
            raise InvalidInput(describe(words, seqlen_new=layout.seqlen_new,
                                        capacity=layout.capacity,
                                        num_pages=layout.num_pages if layout.paged else None))
    return out, lse
