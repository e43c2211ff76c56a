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
