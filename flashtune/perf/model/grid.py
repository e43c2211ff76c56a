"""When the last block of a grid finishes: greedy dispatch of blocks to resident slots.

The block scheduler hands blocks out in launch order (blockIdx.x fastest, then y, then z)
to whichever slot (SM x resident block) frees up first. With equal block durations that
is plain wave quantisation; with causal masking the durations differ per query block and
the tail depends on the order.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

#: Grids up to this many blocks are simulated block by block; larger ones are simulated on
#: a prefix of whole repetitions and extrapolated (the pattern repeats per (head, batch)).
EXACT_LIMIT = 1 << 16


@dataclass(frozen=True)
class GridSchedule:
    """Makespan of a grid and how busy its slots were."""

    makespan: float     # seconds until the last block ends
    busy: float         # sum of block durations (slot-seconds)
    slots: int
    blocks: int

    @property
    def utilisation(self) -> float:
        """Share of slot time spent running blocks (1 = no idle tail)."""
        return self.busy / (self.slots * self.makespan) if self.makespan > 0 else 1.0

    @property
    def waves(self) -> float:
        return self.blocks / self.slots


def _simulate(durations: Sequence[float], repeats: int, slots: int) -> float:
    if len(set(durations)) == 1:
        waves = math.ceil(len(durations) * repeats / slots)
        return waves * durations[0]
    free = [0.0] * min(slots, len(durations) * repeats)
    heapq.heapify(free)
    end = 0.0
    for _ in range(repeats):
        for dur in durations:
            start = heapq.heappop(free)
            finish = start + dur
            end = max(end, finish)
            heapq.heappush(free, finish)
    return end


def makespan(durations: Sequence[float], repeats: int, slots: int) -> GridSchedule:
    """Schedule ``repeats`` copies of the per-query-block ``durations`` (one copy per
    (head, batch), launched one after another) on ``slots`` resident slots."""
    if not durations or repeats < 1 or slots < 1:
        raise ValueError(f"makespan: need durations, repeats >= 1 and slots >= 1; got "
                         f"{len(durations)} durations, repeats={repeats}, slots={slots}")
    if min(durations) < 0:
        raise ValueError("makespan: block durations must be >= 0")
    blocks = len(durations) * repeats
    busy = sum(durations) * repeats
    if blocks <= EXACT_LIMIT or len(set(durations)) == 1:
        return GridSchedule(_simulate(durations, repeats, slots), busy, slots, blocks)
    # Simulate enough repetitions to cover many waves, then scale the body and keep the
    # simulated tail (the part beyond perfect balance).
    sample = max(1, EXACT_LIMIT // len(durations))
    simulated = _simulate(durations, sample, slots)
    balanced = sum(durations) * sample / slots
    tail = max(0.0, simulated - balanced)
    return GridSchedule(max(busy / slots + tail, max(durations)), busy, slots, blocks)
