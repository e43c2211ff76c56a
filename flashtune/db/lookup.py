"""Choosing the best known config for a (device, problem, seqlen bucket, shape class), in
memory.

The runtime dispatcher reads, once per device and process, what may serve the device
(``TuningStore.serving_best``) and resolves each bucket here, with no further database
access. The store's single-bucket
queries use the same functions, so both paths agree.

Order of preference (a bucket's shape class, ``ProblemBucket.shape_class``, is matched
first; where no entry of the device has it, the device's entries without a class, tuned
for every call shape of the bucket, stand in, and the same for other devices):

1. exact: this device, this problem, this seqlen bucket and shape class;
2. nearest: this device and problem, the bucket nearest in log2(seqlen) (ties: the larger
   bucket, whose tiles were tuned for the longer sequences), of the shape class, else of
   no class;
3. same_arch: another device of the same arch (e.g. another sm_90 GPU), nearest bucket, ties
   broken by the larger bucket, then the device name (so the choice is deterministic), of
   the shape class, else of no class -- only from trusted sources (``trust.trusted``).

Given the installed kernel sources (``installed``), stale results and results that failed
re-verification are skipped (``BestEntry.state``); the runtime's dispatcher drops them before
it builds its index.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from flashtune.db.records import BestEntry, DigestOf
from flashtune.db.trust import trusted

How = Literal["exact", "nearest", "same_arch"]


@dataclass(frozen=True)
class Match:
    """A best entry and how it was found."""

    entry: BestEntry
    how: How


def log2_distance(a: int, b: int) -> float:
    return abs(math.log2(a) - math.log2(b))


def nearest(entries: Iterable[BestEntry], seqlen: int) -> BestEntry | None:
    """The entry whose bucket is nearest to ``seqlen`` in log2 (ties: larger, then name)."""
    return min(entries, key=lambda e: (log2_distance(e.seqlen, seqlen), -e.seqlen, e.device),
               default=None)


def resolve(entries: Iterable[BestEntry], *, device: str, arch: str, problem: str,
            seqlen: int, shape_class: str = "", trusted_sources: frozenset[str] | None = None,
            installed: DigestOf | None = None) -> Match | None:
    """The best entry for the bucket by the module's order of preference, or None.

    ``trusted_sources``: whose results of other devices may serve (default: the setting
    FLASHTUNE_TRUSTED_SOURCES); ``installed``: with it, entries not servable on the
    installed kernel sources are skipped.
    """
    classes = (shape_class, "") if shape_class else ("",)
    own: dict[str, list[BestEntry]] = {c: [] for c in classes}
    same_arch: dict[str, list[BestEntry]] = {c: [] for c in classes}
    for entry in entries:
        if entry.problem != problem or entry.shape_class not in own:
            continue
        if installed is not None and not entry.servable(installed(entry.problem,
                                                                  entry.config.key)):
            continue
        if entry.device == device:
            if entry.seqlen == seqlen and entry.shape_class == shape_class:
                return Match(entry, "exact")
            own[entry.shape_class].append(entry)
        elif entry.arch == arch and trusted(entry, trusted_sources):
            same_arch[entry.shape_class].append(entry)
    for how, found_in in (("nearest", own), ("same_arch", same_arch)):
        for wanted in classes:
            found = nearest(found_in[wanted], seqlen)
            if found is not None:
                return Match(found, how)  # type: ignore[arg-type]
    return None


class BestIndex:
    """All best entries grouped by problem, for repeated lookups without the database."""

    def __init__(self, entries: Iterable[BestEntry]) -> None:
        self._by_problem: dict[str, list[BestEntry]] = defaultdict(list)
        for entry in entries:
            self._by_problem[entry.problem].append(entry)

    def __len__(self) -> int:
        return sum(len(group) for group in self._by_problem.values())

    def lookup(self, *, device: str, arch: str, problem: str, seqlen: int,
               shape_class: str = "") -> Match | None:
        return resolve(self._by_problem.get(problem, ()), device=device, arch=arch,
                       problem=problem, seqlen=seqlen, shape_class=shape_class)
