"""``attention_with_kvcache``: split-KV decoding over a (paged) KV cache.

One call is two launches on the current stream: the ``decode`` family's kernel writes
float32 partial O and LSE per split (the query heads of a GQA group packed into the rows of
one block, the new rows appended to the cache in place), and the ``combine`` family's kernel
merges the splits; a launch of one split writes O and the LSE itself and the combine is not
launched. The bucket's tile is raised to cover the group's packed rows (group x query rows)
in one row block (``space.covering_config``), so each K/V element is read once per
(sequence, kv head). The lengths live on the device and are never read back: a call never
synchronises and can be captured in a CUDA graph.

How each sequence's keys are split (``split_mode``): the caller's ``num_splits``; else, in
batch-invariant mode or when the problem has tuned split sizes, the split table
(``splits.SplitTable``, from the tuned ``splitsize`` of each sequence bucket, else
``DEFAULT_SPLIT_TABLE``), which the kernel reads on the device with each sequence's own
length: a captured launch serves every context length with its bucket's split size, and a
sequence's splits never depend on the rest of the batch; else the tuned bucket's ``splits``
count, else FlashAttention-2's wave-efficiency rule over the SM count, batch x kv heads x
row blocks and the cache capacity in key blocks. Batch-invariant calls also run one tile
for every capacity (the ``INVARIANT_BUCKET``'s), so a sequence's O and LSE are bitwise the
same whatever else is in the batch.

Bad cache lengths and block-table entries, and pages that a sequence appends into while
another slot uses them, are reported as InvalidInput before the launch (nothing is written)
on the emulator and, after a synchronisation, on the GPU with ``FLASHTUNE_CHECK_INPUTS=1``
(``validate_kvcache.check_cache_values``). The kernel checks the lengths and pages again
and never follows a bad one: in the emulator it reports it, on a GPU it stops with a trap
that surfaces at the next synchronisation (without the setting, the only check there: rerun
with it for the message; a trap loses the CUDA context, cache included). Without the setting
shared pages are not looked for on a GPU: that would cost a synchronisation per call.

The two kernels' plans (``runtime.plans``) are memoised with every other op's. The decode
kernel's bucket is the cache capacity and the call's shape class (``shape_class_of``: its
GQA group, query rows and page size, ``families.decode.shape_class``), so a class tuned on
its own serves its calls and any other class takes the bucket tuned without one; the
combine's is the capacity alone. Attention sinks join where the final O and LSE are
written: the combine kernel of a ``sinks`` problem (the splits' partial LSEs leave the
sink out, so the decode kernel is the one without sinks).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flashtune import settings
from flashtune.api.block_mask import BlockMask
from flashtune.api.forward import in_column_chunks
from flashtune.api.validate_kvcache import (
    FP8_CACHE_DTYPE,
    KvCacheLayout,
    check_cache_values,
)
from flashtune.api.variants import Variant, kernel_features
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import (
    MAX_HEAD_DIM,
    MAX_SEQ_BUCKET,
    MIN_SEQ_BUCKET,
    KernelConfig,
    ProblemBucket,
)
from flashtune.errors import InvalidInput
from flashtune.families.combine import combine_grid, pack_combine_args
from flashtune.families.decode import NOMINAL_SMS
from flashtune.families.decode.args import decode_grid, m_blocks, pack_decode_args
from flashtune.families.decode.shape_class import ShapeClass
from flashtune.families.decode.space import config_split_size, config_splits, covering_config
from flashtune.families.decode.splits import (
    DEFAULT_SPLIT_TABLE,
    SplitTable,
    fitting_split_size,
    heuristic_splits,
)
from flashtune.families.decode.status import STATUS_WORDS, describe
from flashtune.families.fwd.args import feature_values
from flashtune.runtime import plans
from flashtune.runtime.dispatch import Decision
from flashtune.runtime.plans import AS_Q, Operands, Plan, clear_caches

__all__ = ["INVARIANT_BUCKET", "choose_splits", "clear_caches", "covering_plan", "decide",
           "decode_op", "decode_problems", "default_num_splits", "plan_for", "run_decode",
           "shape_class_of", "split_mode", "tuned_split_table"]

#: The sequence bucket whose tile batch-invariant calls run, whatever the capacity (the
#: capacity follows the longest sequence of a batch, so it must not pick the tile).
INVARIANT_BUCKET = MAX_SEQ_BUCKET


def shape_class_of(layout: KvCacheLayout) -> str:
    """The shape class of a call (``families.decode.shape_class``): its GQA group, query
    rows and page size (an unpaged cache: none), each rounded up to a power of two."""
    return ShapeClass.of_call(layout.heads_q // layout.heads_kv, layout.seqlen_q,
                              layout.page_size if layout.paged else None).word


def decode_op(kv_dtype: torch.dtype | None) -> str:
    """The decode kernel family of a cache of ``kv_dtype`` (None: q's): ``decode8`` for an
    e4m3 cache (``families.decode.fp8``), else ``decode``."""
    return "decode8" if kv_dtype == FP8_CACHE_DTYPE else "decode"


def decode_problems(q: torch.Tensor, causal: bool, capacity: int, shape_class: str = "",
                    operands: Operands = AS_Q) -> tuple[ProblemBucket, ProblemBucket]:
    """The tuning buckets of the two kernels of a call (by cache capacity, and the decode
    kernel's by the call's shape class); ``operands``: the cache's type where it is not q's
    (an e4m3 cache; ``kv_dtype``) and V's head dim where it is not q's."""
    return (plans.problem_bucket(q, causal, decode_op(operands.kv_dtype), (), capacity,
                                 shape_class, operands),
            plans.problem_bucket(_o_like(q, operands.head_dim_v), False, "combine", (),
                                 capacity))


def decide(q: torch.Tensor, causal: bool, capacity: int, backend: str | None,
           arch: str | None = None, shape_class: str = "", operands: Operands = AS_Q
           ) -> tuple[Decision, Decision]:
    """The dispatcher's decisions for the decode and combine kernels of a call (nothing is
    loaded); ``arch`` asks about a virtual GPU of that arch; ``operands`` as in
    ``plan_for``."""
    decode, _ = plans.decide(q, causal, backend, decode_op(operands.kv_dtype), (), capacity,
                             arch, shape_class=shape_class, operands=operands)
    combine, _ = plans.decide(_o_like(q, operands.head_dim_v), False, backend, "combine", (),
                              capacity, arch)
    return decode, combine


def _o_like(q: torch.Tensor, head_dim_v: int | None) -> torch.Tensor:
    """q, or a view of it with V's head dim (no copy): what the combine's bucket reads."""
    return q if head_dim_v is None else q.as_strided((*q.shape[:3], head_dim_v), (0,) * 4)


def plan_for(q: torch.Tensor, causal: bool, capacity: int, backend: str,
             features: tuple[str, ...] = (), shape_class: str = "",
             operands: Operands = AS_Q) -> tuple[Plan, Plan]:
    """The memoised plans of the decode and combine kernels of this call with the feature
    switches ``features`` (the decode kernel's but sinks, the combine's only sinks), the
    call's ``shape_class`` and ``operands``: the cache's type where it is not q's (an e4m3
    cache: ``decode8``) and V's head dim where it is not q's (at most MAX_HEAD_DIM: one
    column chunk), which the combine merges."""
    combine = ("sinks",) if "sinks" in features else ()
    op = decode_op(operands.kv_dtype)
    return (plans.plan_for(q, causal, backend, op, kernel_features(op, features), capacity,
                           shape_class, operands),
            plans.plan_for(_o_like(q, operands.head_dim_v), False, backend, "combine",
                           combine, capacity))


_status: dict[int, torch.Tensor] = {}
_covers: dict[tuple[object, ...], Plan] = plans.derived_cache()
_tables: dict[tuple[object, ...], tuple[SplitTable, bool]] = plans.derived_cache()
_table_words: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}


def covering_plan(plan: Plan, q: torch.Tensor, heads_kv: int, backend: str) -> Plan:
    """``plan`` with its tile raised to cover the call's packed rows (group x query rows) in
    one row block (``space.covering_config``; memoised)."""
    rows = q.shape[2] // heads_kv * q.shape[1]
    key = (backend, q.get_device(), plan.source.problem, plan.source.config,
           plan.decision.arch, rows)
    made = _covers.get(key)
    if made is None:
        config = covering_config(plan.source.problem, plan.source.config, rows,
                                 get_arch(plan.decision.arch))
        made = _covers.setdefault(key, plans.retiled(plan, config, q, backend))
    return made


def tuned_split_table(q: torch.Tensor, causal: bool, backend: str,
                      features: tuple[str, ...] = (), shape_class: str = "",
                      operands: Operands = AS_Q) -> tuple[SplitTable, bool]:
    """The split table of this problem and shape class and whether any of it is tuned: each
    sequence bucket's tuned ``splitsize`` (raised, as the tuner timed it, where the bucket's
    lengths would need more than MAX_SPLITS pieces: ``splits.fitting_split_size``), else
    DEFAULT_SPLIT_TABLE's size for the bucket, adjacent buckets of one
    size merged; memoised (the dispatcher is asked once per bucket, on the first call).
    ``operands`` as in ``plan_for``."""
    key = (backend, q.get_device(), q.dtype, q.shape[3], causal, features, shape_class,
           operands)
    found = _tables.get(key)
    if found is not None:
        return found
    sizes: list[tuple[int, int]] = []
    tuned = False
    bucket = MIN_SEQ_BUCKET
    while bucket <= MAX_SEQ_BUCKET:
        decision, _ = plans.decide(q, causal, backend or None, decode_op(operands.kv_dtype),
                                   features, bucket, shape_class=shape_class,
                                   operands=operands)
        size = config_split_size(decision.config)
        if size > 0:  # as it was timed: raised where the bucket needs more than MAX_SPLITS
            tuned = True
            size = fitting_split_size(size, bucket)
        else:
            size = DEFAULT_SPLIT_TABLE.size_for(bucket)
        if sizes and sizes[-1][1] == size:
            sizes[-1] = (bucket, size)
        else:
            sizes.append((bucket, size))
        bucket *= 2
    table = SplitTable(tuple(b for b, _ in sizes[:-1]), tuple(n for _, n in sizes))
    return _tables.setdefault(key, (table, tuned))


def _device_table(table: SplitTable, device: torch.device) -> torch.Tensor:
    """The kernel's (buckets, 2) int32 words of ``table`` on ``device`` (copied there once)."""
    words = tuple(table.words())
    key = (-1 if device.type != "cuda" else device.index or 0, words)
    found = _table_words.get(key)
    if found is None:
        found = _table_words.setdefault(key, torch.tensor(
            words, dtype=torch.int32, device=device).view(-1, 2))
    return found


def split_mode(num_splits: int, config: KernelConfig, layout: KvCacheLayout, sm_count: int,
               table: SplitTable | None) -> tuple[SplitTable | None, int]:
    """The split table the kernel reads (None: even splits) and the grid's split count:
    the caller's count, else ``table``'s pieces by length (batch-invariant, or tuned), else
    ``choose_splits``."""
    if num_splits > 0 or table is None:
        return None, choose_splits(num_splits, config, layout, sm_count)
    return table, table.grid_splits(layout.capacity)


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
               variant: Variant | None = None, batch_invariant: bool = False,
               descales: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """O (like q) and the float32 LSE (batch, heads_q, seqlen_q) of validated inputs,
    launched on the current stream, with the features ``variant`` (None: none);
    ``num_splits`` 0 means the split mode's choice (``split_mode``); ``backend`` "" means
    the FLASHTUNE_BACKEND setting; ``batch_invariant``: splits of fixed sizes by each
    sequence's own length and one tile for every capacity (bitwise the same result for a
    sequence whatever the batch); InvalidInput with a caller's ``num_splits``.
    ``descales``: an e4m3 cache's validated (k_descale, v_descale), float32 (batch,
    heads_kv) (the ``decode8`` family's kernel); None for a 16-bit cache.

    V's head dim (``layout.v_head_dim``, v_cache's last dim) may differ from q's: O is as
    wide as V; a V wider than MAX_HEAD_DIM (Gemma 4's 512) runs in column chunks
    (``_in_column_chunks``), as the forward does."""
    if layout.v_head_dim > MAX_HEAD_DIM:
        return _in_column_chunks(q, k_cache, v_cache, cache_seqlens, block_table, k, v, layout,
                                 causal, softmax_scale, num_splits, backend, variant,
                                 batch_invariant, descales)
    if batch_invariant and num_splits:
        raise InvalidInput(f"num_splits={num_splits} with batch_invariant=True: a "
                           "batch-invariant call splits each sequence by a fixed number of "
                           "keys for its own length; pass num_splits=None")
    name = backend or settings.BACKEND.get()
    features = variant.features if variant is not None else ()
    shape_class = shape_class_of(layout)
    head_dim_v = layout.head_dim_v
    operands = (AS_Q if descales is None and head_dim_v is None
                else Operands(kv_dtype=None if descales is None else k_cache.dtype,
                              head_dim_v=head_dim_v))
    decode, combine = plan_for(q, causal, INVARIANT_BUCKET if batch_invariant
                               else layout.capacity, name, features, shape_class, operands)
    decode = covering_plan(decode, q, layout.heads_kv, name)
    sinks = variant.sinks if variant is not None else None
    features = decode.source.problem.features  # the decode kernel's (sinks: the combine's)
    config = decode.source.config
    table = None
    if not num_splits:
        tuned, any_tuned = tuned_split_table(q, causal, name, features, shape_class,
                                             operands)
        table = tuned if batch_invariant or any_tuned else None
    split_table, splits = split_mode(num_splits, config, layout,
                                     decode.sm_count or NOMINAL_SMS, table)
    wrong = _misaligned({"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v})
    if wrong is not None:
        raise wrong
    if not decode.on_gpu or settings.CHECK_INPUTS.get():  # before the launch: a refused call
        check_cache_values(cache_seqlens, block_table, layout)  # appends nothing
    # The kernel's own check backs it up: on a GPU it traps (no synchronisation to read a
    # report), in the emulator it reports in the status buffer, read for free.
    trap = decode.on_gpu
    status = _status_buffer(q, trap=trap)
    batch, seqlen_q, heads_q, _ = q.shape
    dim = layout.v_head_dim  # O's
    out = torch.empty_like(q) if head_dim_v is None else q.new_empty(batch, seqlen_q, heads_q,
                                                                       dim)
    lse = torch.empty(batch, heads_q, seqlen_q, dtype=torch.float32, device=q.device)
    # One split: the kernel writes O and LSE itself, no partials, no combine; but the sinks
    # join in the combine, where the final O and LSE are written.
    direct = splits == 1 and sinks is None
    part = (0,) if direct else (splits, batch, heads_q, seqlen_q)
    o_part = torch.empty(*part, *(() if direct else (dim,)), dtype=torch.float32,
                         device=q.device)
    lse_part = o_part if direct else torch.empty(*part, dtype=torch.float32, device=q.device)
    stream = decode.stream()
    decode.kernel.launch(
        decode_grid(batch, heads_q, layout.heads_kv, seqlen_q, config.block_m, splits),
        pack_decode_args(q, k_cache, v_cache, k, v, block_table, cache_seqlens, o_part,
                         lse_part, status, num_splits=splits, softmax_scale=softmax_scale,
                         trap_on_error=trap,
                         split_table=None if split_table is None
                         else _device_table(split_table, q.device),
                         o=out if direct else None, lse=lse if direct else None,
                         features=features,
                         feature_args=feature_values(decode.source.problem, variant)
                         if features else None, descales=descales),
        stream=stream)
    if not direct:
        combine.kernel.launch(combine_grid(batch * heads_q * seqlen_q, combine.block_m),
                              pack_combine_args(o_part, lse_part, out, lse, sinks),
                              stream=stream)
    if not trap:
        report_status(status, layout)
    return out, lse


#: The granularity of a block mask's ranges in the decode kernel (decode_traits.cuh
#: kMaskBlock): per query block of this many absolute positions, in key blocks as wide.
MASK_BLOCK = 16


def check_block_mask(block_mask: object, layout: KvCacheLayout) -> BlockMask:
    """``block_mask`` for a decoding call of ``layout``, or InvalidInput saying what is wrong:
    a flashtune BlockMask whose B is 1 or the batch, H 1 or heads_q, and whose Q_LEN and
    KV_LEN cover the cache's capacity (a new row's q_idx is its absolute position, up to
    capacity - 1: the lengths live on the device, so every position the cache can hold)."""
    if not isinstance(block_mask, BlockMask):
        raise InvalidInput(f"block_mask is a {type(block_mask).__name__}; expected a "
                           "flashtune BlockMask from flashtune.create_block_mask")
    b, h, q_len, kv_len = block_mask.shape
    capacity = layout.capacity
    if b not in (1, layout.batch) or h not in (1, layout.heads_q) or min(q_len, kv_len) < (
            capacity):
        raise InvalidInput(
            f"block_mask was made for (B, H, Q_LEN, KV_LEN) = {block_mask.shape} but the call "
            f"has batch {layout.batch}, {layout.heads_q} query heads and a cache of capacity "
            f"{capacity} (q_idx and kv_idx are absolute positions up to {capacity - 1}); "
            f"expected B in (1, {layout.batch}), H in (1, {layout.heads_q}) and Q_LEN, KV_LEN "
            f">= {capacity}. Make one with flashtune.create_block_mask(mask_mod, "
            f"{layout.batch}, {layout.heads_q}, {capacity}, {capacity})")
    return block_mask


def decode_tile_ranges(block_mask: BlockMask, device: torch.device) -> torch.Tensor:
    """The decode kernel's form of ``block_mask``'s ranges: int32 (Bm, Hm, query blocks, 4),
    per query block of MASK_BLOCK absolute positions the key blocks [lo, hi) of MASK_BLOCK
    keys holding a visible position (and the full run, ``BlockMask.tiles``); a mask of a
    larger BLOCK_SIZE is spread over its MASK_BLOCK-sized blocks."""
    ranges = block_mask.tiles(block_mask.block, block_mask.block, device)
    spread = block_mask.block // MASK_BLOCK
    if spread == 1:
        return ranges
    return (ranges.repeat_interleave(spread, dim=2) * spread).contiguous()


def kernel_head_dim_v(layout: KvCacheLayout) -> int | None:
    """V's head dim in the decode kernels of a call where it is not q's (a V wider than
    MAX_HEAD_DIM: its first column chunk's), else None."""
    width = min(layout.v_head_dim, MAX_HEAD_DIM)
    return None if width == layout.head_dim else width


def _in_column_chunks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cache_seqlens: torch.Tensor, block_table: torch.Tensor | None,
                      k: torch.Tensor | None, v: torch.Tensor | None, layout: KvCacheLayout,
                      causal: bool, softmax_scale: float, num_splits: int, backend: str,
                      variant: Variant | None, batch_invariant: bool,
                      descales: tuple[torch.Tensor, torch.Tensor] | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``run_decode`` of a V wider than MAX_HEAD_DIM, by ``api.forward.in_column_chunks``:
    each chunk a column view of v_cache and of the new rows v (K is read once per chunk).
    Every chunk appends the new keys (the same rows: the later writes change nothing) and
    its own V columns."""
    def attend(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = replace(layout, head_dim_v=end - start)
        chunk = replace(chunk, head_dim_v=kernel_head_dim_v(chunk))
        return run_decode(q, k_cache, v_cache[..., start:end], cache_seqlens, block_table, k,
                          None if v is None else v[..., start:end], chunk, causal,
                          softmax_scale, num_splits, backend, variant, batch_invariant,
                          descales)
    return in_column_chunks(layout.v_head_dim, attend)


def report_status(status: torch.Tensor, layout: KvCacheLayout) -> None:
    """InvalidInput with the kernel's report of a bad input, if it made one (the emulator's
    status buffer, read on the host: the emulator's tensors are host memory)."""
    words = status.tolist()
    if any(words):
        raise InvalidInput(describe(words, seqlen_new=layout.seqlen_new,
                                    capacity=layout.capacity,
                                    num_pages=layout.num_pages if layout.paged else None))
