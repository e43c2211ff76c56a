"""What the families' launch plans share: launch grids.

``grid`` is the one-block-per-query-tile grid of the row-walking kernels (the forward, the
row-wise LSE, the backward's row kernels) and ``persistent_grid`` the smaller grid of a
persistent kernel that walks its query tiles. A tensor's pointer, strides and sizes reach
the kernel through its family's ABI (``codegen.abi``: ``ptr``, ``stride``, ``size``), whose
generated packers read them from the tensors themselves.
"""

from __future__ import annotations

from flashtune.families.base import DEFAULT_SM_COUNT


def grid(seqlen_q: int, heads_q: int, batch: int, block_m: int) -> tuple[int, int, int]:
    """Launch grid: (query blocks, heads, batch)."""
    return ((seqlen_q + block_m - 1) // block_m, heads_q, batch)


def persistent_grid(grid: tuple[int, int, int], sm_count: int | None,
                    blocks_per_sm: int) -> tuple[int, int, int]:
    """The grid of a persistent kernel: about ``sm_count`` x ``blocks_per_sm`` blocks over
    all (head, batch) pairs, each pair's query blocks shared round-robin by its blocks in
    x (the kernel's tile scheduler walks x, x + gridDim.x, ...). Never more blocks in x than
    query blocks, never fewer than one; an unknown SM count is DEFAULT_SM_COUNT (the
    emulator's virtual device, where most shapes then loop)."""
    m_blocks, heads, batch = grid
    slots = (sm_count or DEFAULT_SM_COUNT) * blocks_per_sm
    return (max(1, min(m_blocks, -(-slots // (heads * batch)))), heads, batch)
