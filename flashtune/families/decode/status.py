"""The decode kernel's bad-input report: four int32 words (code, batch, index, value).

The kernel never follows a bad cache length or page index; it records the first one here
(templates/decode_traits.cuh ``kErr*``) and fills its partial results with NaN. ``describe``
turns the words into the message of the InvalidInput the runtime raises.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Words of the status buffer.
STATUS_WORDS = 4
NEGATIVE_LENGTH = 1
BEYOND_CAPACITY = 2
PAGE_INDEX = 3


def describe(words: Sequence[int], *, seqlen_new: int, capacity: int, num_pages: int | None
             ) -> str:
    """What the kernel refused, what was expected and how to fix it ("" when nothing)."""
    code, batch, index, value = (int(w) for w in words[:STATUS_WORDS])
    room = capacity - seqlen_new
    if code == 0:
        return ""
    if code == NEGATIVE_LENGTH:
        return (f"cache_seqlens[{batch}] = {value} is negative; expected a cache length in "
                f"[0, {room}]")
    if code == BEYOND_CAPACITY:
        appended = f" plus the {seqlen_new} appended rows" if seqlen_new else ""
        return (f"cache_seqlens[{batch}] = {value}{appended} exceeds the cache capacity of "
                f"{capacity} rows; expected cache_seqlens[b] <= {room}. Allocate a larger "
                "cache (more pages per sequence in block_table) or pass the right lengths")
    if code == PAGE_INDEX:
        return (f"block_table[{batch}, {index}] = {value} is not a page of the cache, but "
                f"sequence {batch} uses that slot; expected a page index in "
                f"[0, {num_pages}). Fix the block table (unused slots past a sequence's "
                "length may hold anything)")
    return f"the decode kernel reported an unknown error code {code} (words {list(words)})"
