"""Decoding's shape classes: what a call's shape adds to its cache-length bucket and is
tuned apart (``ProblemBucket.shape_class``).

A class is the GQA group, the query rows per sequence and the page size of a call, each
rounded up to a power of two and capped (``g8q4p16``: a group of 5-8 query heads per kv
head, 3-4 query rows, pages of 9-16 rows; ``p0``: an unpaged cache). The group times the
rows is what a block's tile must cover (``space.covering_config``) and the page size is how
the kernel walks the cache, so each class has its own best tile and split size; the
cache length is the bucket's own ``seqlen``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flashtune.errors import InvalidProblem

#: The largest group, query-row count and page size a class names; larger ones share it.
MAX_GROUP = 16
MAX_ROWS = 16
MAX_PAGE = 256
#: The classes ``flashtune tune --op decode`` tunes when none is named: single-token
#: decoding at the groups of common models over 16-row pages, and a speculative step.
DEFAULT_CLASSES = ("g1q1p16", "g4q1p16", "g8q1p16", "g8q4p16")

_WORD = re.compile(r"^g([0-9]+)q([0-9]+)p([0-9]+)$")


def _ceil_pow2(n: int, cap: int) -> int:
    return min(cap, 1 << max(0, n - 1).bit_length())


@dataclass(frozen=True)
class ShapeClass:
    """A decoding shape class: ``group`` and ``rows`` powers of two in [1, 16], ``page``
    0 (unpaged) or a power of two in [1, 256]."""

    group: int
    rows: int
    page: int

    def __post_init__(self) -> None:
        for name, value, low, cap in (("group", self.group, 1, MAX_GROUP),
                                      ("rows", self.rows, 1, MAX_ROWS),
                                      ("page", self.page, 0, MAX_PAGE)):
            if not isinstance(value, int) or not (low <= value <= cap) or (
                    value and value & (value - 1)):
                raise InvalidProblem(
                    f"decode shape class: {name}={value!r} is not a power of two in "
                    f"[1, {cap}]" + (" or 0 (an unpaged cache)" if name == "page" else ""))

    @property
    def word(self) -> str:
        return f"g{self.group}q{self.rows}p{self.page}"

    @property
    def page_size(self) -> int | None:
        """The page size a tuning run times the class on (None: unpaged)."""
        return self.page or None

    @classmethod
    def parse(cls, word: str) -> ShapeClass:
        """The class of ``word`` (InvalidProblem naming the format otherwise)."""
        found = _WORD.match(word) if isinstance(word, str) else None
        if found is None:
            raise InvalidProblem(
                f"decode shape class {word!r} is malformed; expected g<group>q<rows>p<page>, "
                "powers of two (page 0: an unpaged cache), e.g. 'g8q4p16'")
        return cls(*(int(v) for v in found.groups()))

    @classmethod
    def of_call(cls, group: int, rows: int, page_size: int | None) -> ShapeClass:
        """The class a call of ``group`` query heads per kv head, ``rows`` query rows per
        sequence and pages of ``page_size`` rows (None: unpaged) falls in."""
        page = 0 if page_size is None else _ceil_pow2(page_size, MAX_PAGE)
        return cls(_ceil_pow2(group, MAX_GROUP), _ceil_pow2(rows, MAX_ROWS), page)
