"""How a sequence's keys are split across blocks, and how many splits to use.

The split boundaries are a contract between the decode kernel (templates/decode_traits.cuh
``kSplitAlign``, ``kMaxSplits``), its float64 reference and the API: split s of a sequence
of ``total`` keys covers ``[s * P, min((s + 1) * P, total))`` with
``P = ceil(ceil(total / num_splits) / SPLIT_ALIGN) * SPLIT_ALIGN``; a split past the end is
empty (its partial LSE is -inf, so its weight in the combine is 0).

``heuristic_splits`` is FlashAttention-2's rule: no split when the unsplit grid already
fills most of the GPU, else the smallest split count whose wave efficiency is within 85% of
the best, among counts that change the number of key blocks per split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashtune.errors import InvalidInput

#: Splits cover whole multiples of this many keys.
SPLIT_ALIGN = 16
#: The most splits the combine kernel merges.
MAX_SPLITS = 128
#: FA2: a grid of at least this share of the SMs is not split.
_FULL_GRID = 0.8
#: FA2: the smallest count within this share of the best wave efficiency wins.
_NEAR_BEST = 0.85


def check_num_splits(num_splits: object, choose: bool = False) -> int:
    """``num_splits`` as an int in [1, MAX_SPLITS], or, with ``choose`` (the API), also 0,
    which means "choose" (flash-attn's convention, as None does); InvalidInput saying why
    otherwise."""
    low = 0 if choose else 1
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise InvalidInput(f"num_splits={num_splits!r} must be an int in [1, {MAX_SPLITS}] "
                           "(or None or 0 for the heuristic)")
    if not low <= num_splits <= MAX_SPLITS:
        raise InvalidInput(f"num_splits={num_splits} is outside [{low}, {MAX_SPLITS}]; pass "
                           "None (or 0) to let flashtune choose")
    return num_splits


def split_size(total: int, num_splits: int) -> int:
    """Keys per split of a sequence of ``total`` keys (a multiple of SPLIT_ALIGN)."""
    per = -(-total // num_splits)
    return -(-per // SPLIT_ALIGN) * SPLIT_ALIGN


def split_range(total: int, num_splits: int, split: int) -> tuple[int, int]:
    """Keys [begin, end) of split ``split``; begin == end for an empty split."""
    per = split_size(total, num_splits)
    begin = min(split * per, total)
    return begin, min(begin + per, total)


def window_keys(total: int, seqlen_q: int, left: int, align: int = 1) -> int:
    """Keys of a sequence of ``total`` keys (after appending) that a decoding call with
    ``seqlen_q`` query rows and a window ``left`` keys wide reads: from the first key of the
    earliest row's window, rounded down to a multiple of ``align`` (the kernel starts at the
    key tile holding it, templates/decode_split.cuh), to the end; ``left`` < 0: all."""
    if left < 0:
        return total
    first = max(0, total - seqlen_q - left)
    return total - first // align * align


def heuristic_splits(blocks: int, sm_count: int, key_blocks: int,
                     max_splits: int = MAX_SPLITS) -> int:
    """FlashAttention-2's split count for a grid of ``blocks`` blocks (batch x kv heads x
    row blocks) over ``key_blocks`` blocks of keys on ``sm_count`` SMs."""
    if blocks < 1 or sm_count < 1 or key_blocks < 1:
        raise InvalidInput(f"heuristic_splits needs positive counts, got blocks={blocks}, "
                           f"sm_count={sm_count}, key_blocks={key_blocks}")
    if blocks >= _FULL_GRID * sm_count:
        return 1
    limit = min(max_splits, sm_count, key_blocks)

    def eligible(splits: int) -> bool:
        return splits == 1 or (-(-key_blocks // splits) != -(-key_blocks // (splits - 1)))

    efficiency: list[float] = []
    for splits in range(1, limit + 1):
        if eligible(splits):
            waves = blocks * splits / sm_count
            efficiency.append(waves / math.ceil(waves))
        else:
            efficiency.append(0.0)
    best = max(efficiency)
    for splits in range(1, limit + 1):
        if eligible(splits) and efficiency[splits - 1] >= _NEAR_BEST * best:
            return splits
    return 1


@dataclass(frozen=True)
class SplitTable:
    """Split sizes by context length, read by the kernel on the device (the split choice of
    a captured launch follows each sequence's own length, with no host decision).

    A sequence of ``total`` keys (cache length plus appended rows) takes the first bucket
    whose bound is >= total (the last bucket takes every longer one) and is split into
    pieces of P keys, P that bucket's ``sizes`` entry (raised by ``fitting_split_size``
    where total would need more than MAX_SPLITS pieces): split s covers
    ``[s * P, min((s + 1) * P, total))``. A sequence's splits depend on its own length
    only, never on the batch, so the mode is batch-invariant. ``bounds`` ascend; ``sizes``
    (one more than bounds) are positive multiples of SPLIT_ALIGN.
    """

    bounds: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.bounds) + 1 or len(self.sizes) > MAX_TABLE_BUCKETS:
            raise InvalidInput(
                f"SplitTable: sizes={self.sizes} must have one entry more than "
                f"bounds={self.bounds} (the last bucket takes every longer sequence), and at "
                f"most {MAX_TABLE_BUCKETS}")
        if any(not a < b for a, b in zip((0, *self.bounds), self.bounds, strict=False)):
            raise InvalidInput(f"SplitTable.bounds={self.bounds} must be positive and "
                               "strictly ascending context lengths")
        bad = [s for s in self.sizes if isinstance(s, bool) or not isinstance(s, int)
               or s < SPLIT_ALIGN or s % SPLIT_ALIGN]
        if bad:
            raise InvalidInput(f"SplitTable.sizes={self.sizes}: {bad} are not positive "
                               f"multiples of {SPLIT_ALIGN} keys; round them up to one")

    def size_for(self, total: int) -> int:
        """Keys per split of a sequence of ``total`` keys."""
        size = self.sizes[-1]
        for bound, own in zip(self.bounds, self.sizes, strict=False):
            if total <= bound:
                size = own
                break
        return fitting_split_size(size, total)

    def split_range(self, total: int, split: int) -> tuple[int, int]:
        """Keys [begin, end) of split ``split`` of a sequence of ``total`` keys."""
        per = self.size_for(total)
        begin = min(split * per, total)
        return begin, min(begin + per, total)

    def grid_splits(self, capacity: int) -> int:
        """The splits a launch over caches of ``capacity`` keys needs: the most any
        sequence up to that length takes (at most MAX_SPLITS)."""
        most, low = 1, 0
        for bound, size in zip((*self.bounds, capacity), self.sizes, strict=False):
            if low >= capacity:
                break
            # ceil(L / size) pieces, never above MAX_SPLITS, for every length L of the bucket
            most = max(most, min(MAX_SPLITS, -(-min(bound, capacity) // size)))
            low = bound
        return most

    def words(self) -> list[int]:
        """The kernel's int32 table: (bound, size) pairs, the last bound INT32_MAX."""
        out: list[int] = []
        for bound, size in zip((*self.bounds, _INT32_MAX), self.sizes, strict=False):
            out += [bound, size]
        return out


def fitting_split_size(size: int, capacity: int) -> int:
    """``size``, raised to the smallest multiple of SPLIT_ALIGN that splits ``capacity``
    keys into at most MAX_SPLITS pieces (a tuned size of a short bucket applied to a long
    one)."""
    least = -(-capacity // MAX_SPLITS)
    return max(size, -(-least // SPLIT_ALIGN) * SPLIT_ALIGN)


#: The most buckets a split table holds.
MAX_TABLE_BUCKETS = 16
_INT32_MAX = (1 << 31) - 1
#: The untuned split table: pieces that grow with the context, at most 16 splits up to
#: 128k keys (enough blocks to fill a GPU at batch 1 for 8 kv heads) and one split below
#: 256 keys (no combine).
DEFAULT_SPLIT_TABLE = SplitTable((256, 2048, 16384, 131072), (256, 512, 2048, 8192, 16384))
