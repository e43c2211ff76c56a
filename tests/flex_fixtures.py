"""Fixtures and helpers of the tests that trace modifications: the features their calls
register (one per traced modification, by digest) are removed afterwards, so that other
tests see the built-in registry; random masks, documents, tile-range inputs and the dense
reference that applies a modification's Python functions to the whole score matrix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flashtune.api import flex_mods
from flashtune.api.block_mask import with_tile_ranges
from flashtune.codegen.spec import KernelConfig, Problem, Shape
from flashtune.codegen.trace import TracedMod
from flashtune.families.base import Inputs, KernelFamily, Verdict
from flashtune.families.bwd import with_stats


def with_ranges(problem: Problem, traced: TracedMod, ranges: torch.Tensor,
                drawn: Inputs) -> Inputs:
    """``drawn`` (a family's random inputs for ``problem``) with ``traced``'s captured
    tensors and the block mask tile ranges ``ranges`` as its values. A backward's inputs
    get the forward's LSE and D again, of these values: the drawn ones belong to random
    captured tensors (a random FlashMask hides whole rows: zero gradients, which no
    masking changes)."""
    values = with_tile_ranges(traced, traced.values(torch.device("cpu")), ranges)
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    scalars = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
    inputs = Inputs(dict(drawn.tensors) | tensors, dict(drawn.scalars) | scalars)
    return with_stats(problem, inputs) if "lse" in drawn.tensors else inputs


def four_documents(n: int, seed: int, flash: bool = False
                   ) -> tuple[list[int], torch.Tensor, Callable[..., Any]]:
    """The cuts, document ids (n,) and causal document mask of 4 packed documents, the
    first long enough (at least n / 2 positions) to hold full tiles, the other cuts drawn
    with ``seed``; ``flash``: the same mask in FlashMask's column form."""
    gen = torch.Generator().manual_seed(seed)
    first = n // 2 + int(torch.randint(0, n // 8 + 1, (), generator=gen))
    cuts = [first, *sorted((first + 1 + torch.randperm(n - first - 2, generator=gen)[:2])
                           .tolist())]
    docs = torch.zeros(n, dtype=torch.int64)
    for cut in cuts:
        docs[cut:] += 1
    if not flash:
        return cuts, docs, flex_mods.document(docs)
    ends = torch.tensor([*cuts, n])[torch.searchsorted(torch.tensor(cuts), torch.arange(n),
                                                       right=True)]
    return cuts, docs, flex_mods.flashmask(ends)


Fn = Callable[..., Any] | None


def docs_of(n: int, gen: torch.Generator) -> torch.Tensor:
    """Sorted document ids (n,) of up to 5 documents."""
    return torch.sort(torch.randint(0, 5, (n,), generator=gen)).values


def random_flashmask(heads: int, n: int, gen: torch.Generator, causal: bool) -> Fn:
    """Random FlashMask columns: per head, hidden lower ranges from below the diagonal
    (and, bidirectional, hidden upper ranges from row 0 or above the diagonal)."""
    cols = torch.arange(n)
    lts = cols + torch.randint(0, 40, (heads, n), generator=gen)
    lte = lts + torch.randint(0, 60, (heads, n), generator=gen)
    if causal:
        return flex_mods.flashmask(lts, lte)
    ute = torch.minimum(cols, torch.randint(0, n, (n,), generator=gen))
    uts = ute - torch.randint(0, 30, (n,), generator=gen)
    return flex_mods.flashmask(lts, lte, uts, ute, causal=False)


def grid(batch: int, heads: int, nq: int, nk: int) -> tuple[torch.Tensor, ...]:
    """The index arguments (b, h, q_idx, kv_idx) of a dense (B, H, Nq, Nk) score matrix."""
    return (torch.arange(batch).view(-1, 1, 1, 1), torch.arange(heads).view(1, -1, 1, 1),
            torch.arange(nq).view(1, 1, -1, 1), torch.arange(nk).view(1, 1, 1, -1))


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, score_mod: Fn,
          mask_mod: Fn, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """O and LSE with the functions applied to the dense score matrix, computed in
    ``dtype`` ((B, H, L, D) inputs; a row that sees no key: O = 0, LSE = -inf)."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    b, h, i, j = grid(*s.shape)
    if score_mod is not None:
        s = score_mod(s, b, h, i, j).to(dtype)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, i, j).expand(s.shape), float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), 0.0, m)
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    # A row that sees no key: O = 0, and a finite gradient (no 0 / 0 in the other branch).
    o = torch.where(total > 0, (p @ v) / torch.where(total > 0, total, 1.0), 0.0)
    return o, (m + torch.log(total)).squeeze(-1)


def launch_with_ranges(family: KernelFamily, problem: Problem, config: KernelConfig,
                       shape: Shape, kernel: Any, traced: TracedMod, ranges: torch.Tensor,
                       drawn: Inputs) -> tuple[dict[str, torch.Tensor], list[int], Verdict]:
    """One launch of ``kernel`` (loaded with counters) of ``family`` on ``drawn`` with the
    tile ranges ``ranges``: its NaN-poisoned outputs, the tensor-core count of each block
    and the verdict against the family's float64 reference."""
    inputs = with_ranges(problem, traced, ranges, drawn)
    outputs = family.empty_outputs(problem, shape, inputs, poison=True)
    plan = family.launch_plan(problem, config, shape, inputs, outputs)
    kernel.launch(plan.grid, plan.args)
    verdict = family.compare(problem, shape, outputs, family.reference(problem, inputs))
    counters = getattr(kernel, "last_counters", None)
    assert counters is not None
    return outputs, list(counters.block_mma), verdict
