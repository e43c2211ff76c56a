"""The semantic validator that bundle import and merge receive from their caller.

The database package does not know what a legal head dim or block size is; that knowledge
lives in ``flashtune.codegen.spec``, which db must not import. The command line layer passes
an object implementing ``RecordValidator`` built on ``Problem``, ``KernelConfig`` and
``ProblemBucket``, so shared records are held to exactly the rules the code generator
enforces.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class RecordValidator(Protocol):
    """Checks problems, configs and buckets; each method raises ValueError when illegal."""

    def problem(self, fields: Mapping[str, object]) -> str:
        """The canonical problem key of ``fields`` (e.g. ``fwd_d128_bf16_causal``)."""
        ...

    def config(self, fields: Mapping[str, object]) -> str:
        """The canonical config key of ``fields`` (e.g. ``m128_n64_w4_s2``)."""
        ...

    def bucket(self, problem_key: str, seqlen: int) -> str:
        """The canonical bucket key (e.g. ``fwd_d128_bf16_causal_n4096``)."""
        ...
