"""Block masks: a ``mask_mod`` evaluated once per (query block, key block) into empty,
partial and full blocks, reusable across calls and layers (FlexAttention's
``create_block_mask``).

``create_block_mask`` evaluates the mask on the dense (Q_LEN, KV_LEN) grid of each
(batch, head) it varies over, a block of query rows at a time, and keeps per block of
``BLOCK_SIZE`` (16 by default) rows and keys only the number of visible positions. A call
then derives, for the kernel's own tile sizes (multiples of the block size), the range of
key tiles [lo, hi) each query tile sees and the full ones among them (``tiles``; memoised
per tile size): the kernel walks only [lo, hi) (a key tile outside is never loaded or
computed), and evaluates the traced ``mask_mod`` only on the walked tiles that are not
full. A query tile that sees no key is written as
empty rows without a loop. The backward walks the same blocks by key tile (``tiles(...,
columns=True)``: per key tile the query tiles that hold a row seeing one of its keys).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from flashtune.errors import InvalidInput

if TYPE_CHECKING:
    from flashtune.codegen.trace import TracedMod

MaskModFn = Callable[..., Any]
#: The default block: the mma.sync kernels' tile sizes are multiples of 16.
BLOCK = 16
#: Query rows evaluated at once while building (bounds the dense chunk's memory).
_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True, eq=False)
class BlockMask:
    """A mask_mod's blocks: ``counts`` (Bm, Hm, ceil(Q_LEN / block), ceil(KV_LEN / block))
    int32, the number of visible positions per block (Bm, Hm: 1 when the mask does not vary
    with the batch or the head); ``full`` the positions of a whole block (edge blocks have
    fewer). Made by ``create_block_mask``."""

    mask_mod: MaskModFn
    shape: tuple[int, int, int, int]
    block: int
    counts: torch.Tensor
    _tiles: dict[tuple[int, int, str, bool], torch.Tensor] = field(default_factory=dict,
                                                              repr=False)

    def kinds(self) -> torch.Tensor:
        """Per block 0 (empty), 1 (partial) or 2 (full: every position visible)."""
        q_len, kv_len = self.shape[2], self.shape[3]
        rows = torch.full((self.counts.shape[2],), self.block, dtype=torch.int32)
        cols = torch.full((self.counts.shape[3],), self.block, dtype=torch.int32)
        rows[-1] = q_len - self.block * (rows.numel() - 1)
        cols[-1] = kv_len - self.block * (cols.numel() - 1)
        area = rows[:, None] * cols[None, :]
        return torch.where(self.counts == 0, 0, torch.where(self.counts == area, 2, 1))

    def sparsity(self) -> float:
        """The fraction of blocks that are empty."""
        return float((self.counts == 0).float().mean())

    def check_call(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        """InvalidInput unless a call of these sizes can use this mask."""
        b, h, lq, lk = self.shape
        if (lq, lk) != (q_len, kv_len) or b not in (1, batch) or h not in (1, heads):
            raise InvalidInput(f"block_mask was made for (B, H, Q_LEN, KV_LEN) = {self.shape} "
                               f"but the call has ({batch}, {heads}, {q_len}, {kv_len}); "
                               "expected equal lengths and B, H equal or 1. Make one with "
                               "flashtune.create_block_mask for these sizes")

    def tiles(self, block_m: int, block_n: int, device: torch.device,
              columns: bool = False) -> torch.Tensor:
        """int32 (Bm, Hm, ceil(Q_LEN / block_m), 4): per query tile of ``block_m`` rows the
        key tiles [lo, hi) of ``block_n`` keys that hold a visible position (lo = hi: none),
        and [full_lo, full_hi), the key tiles every row sees whole when they are one run
        (else none: the mask is then evaluated on every walked tile). Both sizes must be
        multiples of the block. ``columns``: the backward's form, (Bm, Hm,
        ceil(KV_LEN / block_n), 4), per key tile the query tiles [lo, hi) that hold a row
        seeing one of its keys and the full ones among them."""
        key = (block_m, block_n, str(device), columns)
        found = self._tiles.get(key)
        if found is not None:
            return found
        if block_m % self.block or block_n % self.block:
            raise InvalidInput(f"kernel tiles {block_m} x {block_n} are not multiples of the "
                               f"block mask's BLOCK_SIZE={self.block}; use BLOCK_SIZE=16")
        fm, fn = block_m // self.block, block_n // self.block
        c, kinds = self.counts, self.kinds()
        if columns:  # the same walk over the transposed blocks
            fm, fn = fn, fm
            c, kinds = c.transpose(2, 3), kinds.transpose(2, 3)
        pad_m, pad_n = -c.shape[2] % fm, -c.shape[3] % fn
        c = torch.nn.functional.pad(c, (0, pad_n, 0, pad_m))
        bm, hm, nm, nn = c.shape
        any_visible = (c.reshape(bm, hm, nm // fm, fm, nn // fn, fn).sum(dim=(3, 5)) > 0)
        cols = torch.arange(nn // fn, dtype=torch.int32)
        big = torch.iinfo(torch.int32).max
        lo = torch.where(any_visible, cols, big).amin(dim=-1)
        hi = torch.where(any_visible, cols + 1, 0).amax(dim=-1)
        lo = torch.where(hi == 0, 0, lo)
        # Full kernel tiles: every block full; blocks past the ends count as full (the
        # kernel hides those positions itself).
        kinds = torch.nn.functional.pad(kinds, (0, pad_n, 0, pad_m), value=2)
        full = (kinds.reshape(bm, hm, nm // fm, fm, nn // fn, fn) == 2).all(dim=5).all(dim=3)
        full_lo = torch.where(full, cols, big).amin(dim=-1)
        full_hi = torch.where(full, cols + 1, 0).amax(dim=-1)
        one_run = full.sum(dim=-1) == full_hi - full_lo
        full_lo = torch.where(one_run & (full_hi > 0), full_lo, 0)
        full_hi = torch.where(one_run & (full_hi > 0), full_hi, 0)
        out = torch.stack((lo, hi, full_lo, full_hi), dim=-1).to(
            device=device, dtype=torch.int32).contiguous()
        self._tiles[key] = out
        return out


def with_tile_ranges(traced: TracedMod, values: dict[str, Any], ranges: torch.Tensor
                     ) -> dict[str, Any]:
    """``values`` (a traced modification's kernel arguments) with a block mask's tile
    ranges ``ranges`` (``BlockMask.tiles`` or the decode kernel's, (B, H, tiles, 4) int32)
    as ``traced.ranges_param`` and their first three sizes as ``<param>_n0`` .. ``_n2``,
    the arguments ``TracedMod.params`` declares for them; ``values`` is not changed."""
    param = traced.ranges_param
    return {**values, param: ranges,
            **{f"{param}_n{j}": int(n) for j, n in enumerate(ranges.shape[:3])}}


def create_block_mask(mask_mod: MaskModFn, B: int | None, H: int | None, Q_LEN: int,
                      KV_LEN: int, device: str | torch.device = "cpu",
                      BLOCK_SIZE: int = BLOCK) -> BlockMask:
    """FlexAttention's ``create_block_mask``: ``mask_mod(b, h, q_idx, kv_idx)`` (True: key
    kv_idx is visible to query q_idx) evaluated once into a ``BlockMask``. ``B`` or ``H``
    None (or 1) means the mask does not vary with it. ``device`` is where the mask is
    evaluated. The block size must divide the kernel's tiles (16 does for every mma.sync
    config)."""
    if not callable(mask_mod):
        raise InvalidInput(f"mask_mod={mask_mod!r} is not callable; expected a function "
                           "(b, h, q_idx, kv_idx) -> bool tensor")
    sizes = {"B": 1 if B is None else B, "H": 1 if H is None else H, "Q_LEN": Q_LEN,
             "KV_LEN": KV_LEN, "BLOCK_SIZE": BLOCK_SIZE}
    for name, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidInput(f"{name}={n!r} must be an int >= 1")
    if BLOCK_SIZE % 16:
        raise InvalidInput(f"BLOCK_SIZE={BLOCK_SIZE} must be a multiple of 16 (the kernels' "
                           "tiles are)")
    b_n, h_n = sizes["B"], sizes["H"]
    blk = BLOCK_SIZE
    nq, nk = math.ceil(Q_LEN / blk), math.ceil(KV_LEN / blk)
    counts = torch.zeros(b_n, h_n, nq, nk, dtype=torch.int32)
    kv = torch.arange(KV_LEN, device=device)
    pad_k = nk * blk - KV_LEN
    rows = max(blk, (_CHUNK_ELEMENTS // max(KV_LEN, 1)) // blk * blk)
    for b in range(b_n):
        for h in range(h_n):
            bt = torch.tensor(b, device=device)
            ht = torch.tensor(h, device=device)
            for r0 in range(0, Q_LEN, rows):
                q = torch.arange(r0, min(Q_LEN, r0 + rows), device=device)
                visible = torch.as_tensor(mask_mod(bt, ht, q[:, None], kv[None, :]),
                                          device=device).expand(q.numel(), KV_LEN)
                pad_q = -q.numel() % blk
                if pad_k or pad_q:  # edge blocks: the missing positions count as hidden
                    visible = torch.nn.functional.pad(visible, (0, pad_k, 0, pad_q))
                per_block = visible.reshape(-1, blk, nk, blk).sum(dim=(1, 3), dtype=torch.int32)
                counts[b, h, r0 // blk: r0 // blk + per_block.shape[0]] = per_block.cpu()
    return BlockMask(mask_mod, (b_n, h_n, Q_LEN, KV_LEN), blk, counts)
