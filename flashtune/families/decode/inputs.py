"""Inputs of one decode call: a (paged) KV cache with per-sequence lengths, optional new
rows to append, the query rows and the split count.

``DecodeCase`` names everything a decode call has beyond a ``Shape`` (batch, heads_q,
heads_kv, seqlen_q, seqlen_k = the cache capacity per sequence): the page size (None for an
unpaged cache), each sequence's cache length, how many new rows are appended and the number
of splits (even pieces, or with a ``SplitTable`` the grid's split count and the pieces of
each sequence's own length bucket). ``make_inputs`` draws random tensors for a case. Cache
rows that no sequence may read (past its length, and the spare pages no block table names)
hold NaN, so that a kernel reading them produces NaN and fails verification; block-table
slots a sequence does not use hold -1, which the kernel must never look at.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashtune._lazy import lazy_module
from flashtune.codegen.spec import Problem, Shape
from flashtune.errors import InvalidInput
from flashtune.families.base import Inputs, torch_dtype
from flashtune.families.decode.splits import SplitTable, check_num_splits

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

#: Pages of the pool that no block table names (NaN-filled).
SPARE_PAGES = 3


@dataclass(frozen=True)
class DecodeCase:
    """What a decode call has beyond its Shape (validated against one by ``check``)."""

    page_size: int | None
    cache_seqlens: tuple[int, ...]
    seqlen_new: int
    num_splits: int
    split_table: SplitTable | None = None

    def __post_init__(self) -> None:
        if self.page_size is not None and (isinstance(self.page_size, bool) or
                                           not isinstance(self.page_size, int) or
                                           self.page_size < 1):
            raise InvalidInput(f"page_size={self.page_size!r} must be an int >= 1 or None")
        object.__setattr__(self, "cache_seqlens", tuple(int(n) for n in self.cache_seqlens))
        if any(n < 0 for n in self.cache_seqlens):
            raise InvalidInput(f"cache_seqlens={self.cache_seqlens} must be >= 0")
        if self.seqlen_new < 0:
            raise InvalidInput(f"seqlen_new={self.seqlen_new} must be >= 0")
        check_num_splits(self.num_splits)

    def max_pages(self, shape: Shape) -> int:
        """Block-table slots per sequence (1 for an unpaged cache)."""
        return 1 if self.page_size is None else -(-shape.seqlen_k // self.page_size)

    def capacity(self, shape: Shape) -> int:
        """Rows a sequence can hold: seqlen_k, rounded up to whole pages."""
        return shape.seqlen_k if self.page_size is None else self.max_pages(shape) * self.page_size

    def check(self, shape: Shape) -> None:
        """InvalidInput unless the case fits ``shape``."""
        if len(self.cache_seqlens) != shape.batch:
            raise InvalidInput(f"{len(self.cache_seqlens)} cache lengths for batch "
                               f"{shape.batch}")
        room = self.capacity(shape) - self.seqlen_new
        if any(n > room for n in self.cache_seqlens):
            raise InvalidInput(f"cache_seqlens={self.cache_seqlens} with {self.seqlen_new} new "
                               f"rows exceed the capacity {self.capacity(shape)}")
        if self.split_table is not None:
            need = self.split_table.grid_splits(self.capacity(shape))
            if self.num_splits != need:
                raise InvalidInput(f"num_splits={self.num_splits} with the split table "
                                   f"{self.split_table}: the grid over a capacity of "
                                   f"{self.capacity(shape)} keys needs {need}")

    def key(self) -> str:
        paged = "unpaged" if self.page_size is None else f"page{self.page_size}"
        lengths = "-".join(str(n) for n in self.cache_seqlens)
        table = "" if self.split_table is None else "_table" + "-".join(
            str(w) for w in self.split_table.words()[:-2] + [self.split_table.sizes[-1]])
        return f"{paged}_len{lengths}_new{self.seqlen_new}_splits{self.num_splits}{table}"


def draw_case(shape: Shape, gen: torch.Generator, *, page_sizes: Sequence[int | None],
              append: bool, num_splits: int) -> DecodeCase:
    """A case with a page size drawn from ``page_sizes`` and lengths drawn per sequence in
    [0, room] (room = capacity - appended rows), the first sequence at the full room."""
    pick = int(torch.randint(len(page_sizes), (1,), generator=gen, device=gen.device))
    page_size = page_sizes[pick]
    seqlen_new = shape.seqlen_q if append else 0
    probe = DecodeCase(page_size, (0,) * shape.batch, 0, num_splits)
    room = probe.capacity(shape) - seqlen_new
    if room < 0:
        raise InvalidInput(f"the cache of {shape.key()} cannot hold {seqlen_new} new rows")
    lengths = torch.randint(room + 1, (shape.batch,), generator=gen, device=gen.device)
    lengths[0] = room
    return DecodeCase(page_size, tuple(int(n) for n in lengths), seqlen_new, num_splits)


def _randn(gen: torch.Generator, device: torch.device | str, dtype: torch.dtype,
           *size: int) -> torch.Tensor:
    return torch.randn(*size, generator=gen, device=device).to(dtype)


def make_inputs(problem: Problem, shape: Shape, case: DecodeCase, device: torch.device | str,
                gen: torch.Generator) -> Inputs:
    """Random inputs of ``case`` (see the module docstring for what holds NaN and -1).

    Tensors: q, k_cache, v_cache, cache_seqlens, block_table (paged), k_new and v_new
    (appending), and k_cache_before / v_cache_before, copies of the caches as drawn (the
    reference's view of them: the kernel appends in place), split_table (the case's
    ``SplitTable.words`` as (buckets, 2) int32, when it has one). Scalars: softmax_scale,
    num_splits."""
    case.check(shape)
    dt, d, dv = torch_dtype(problem.dtype), problem.head_dim, problem.v_head_dim
    b, hkv = shape.batch, shape.heads_kv
    q = _randn(gen, device, dt, b, shape.seqlen_q, shape.heads_q, d)
    tensors: dict[str, torch.Tensor] = {"q": q}
    ends = torch.tensor(case.cache_seqlens, device=device)
    if case.page_size is None:
        rows = torch.arange(shape.seqlen_k, device=device)
        live = (rows[None, :] < ends[:, None])[..., None, None]  # (b, len, 1, 1)
        caches = [_randn(gen, device, dt, b, shape.seqlen_k, hkv, dim).masked_fill(
            ~live, float("nan")) for dim in (d, dv)]
    else:
        page, slots = case.page_size, case.max_pages(shape)
        num_pages = b * slots + SPARE_PAGES
        order = torch.randperm(num_pages, generator=gen, device=gen.device).to(device)
        table = order[: b * slots].view(b, slots).to(torch.int32)
        used = -(-(ends + case.seqlen_new) // page)  # slots each sequence uses
        table = table.masked_fill(torch.arange(slots, device=device)[None, :] >= used[:, None],
                                  -1)
        # live[p, r]: row r of page p holds a cached key (page p is slot s of sequence i).
        live = torch.zeros(num_pages, page, dtype=torch.bool, device=device)
        positions = torch.arange(slots * page, device=device).view(slots, page)
        for i in range(b):
            for s in range(int(used[i])):
                live[int(table[i, s])] = positions[s] < int(ends[i])
        caches = [_randn(gen, device, dt, num_pages, page, hkv, dim).masked_fill(
            ~live[..., None, None], float("nan")) for dim in (d, dv)]
        tensors["block_table"] = table.contiguous()
    tensors["k_cache"], tensors["v_cache"] = caches
    tensors["k_cache_before"], tensors["v_cache_before"] = (c.clone() for c in caches)
    tensors["cache_seqlens"] = ends.to(torch.int32)
    if case.seqlen_new:
        for name, dim in (("k_new", d), ("v_new", dv)):
            tensors[name] = _randn(gen, device, dt, b, case.seqlen_new, hkv, dim)
    if case.split_table is not None:
        tensors["split_table"] = torch.tensor(case.split_table.words(), dtype=torch.int32,
                                              device=device).view(-1, 2)
    return Inputs(tensors, {"softmax_scale": d ** -0.5, "num_splits": case.num_splits})
