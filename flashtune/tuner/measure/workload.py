"""What a tuning bucket is measured on: representative shapes, their FLOPs and the objective.

A bucket (Problem, seqlen bucket N) covers calls with max(seqlen_q, seqlen_k) in (N/2, N].
It is measured on a few representative shapes (by default N and 3N/4, at the batch and
head counts of the field's standard sweep: hidden size 2048 and about 16k tokens per
batch) and scored by the geometric mean of their TFLOP/s, so no single shape dominates.

FLOPs follow the field's convention: ``4 * B * Nq * Nk * H * D``, halved when causal
(each family's ``flops``); shapes are ``flashtune.codegen.spec.Shape``. (A ``Workload`` is
the tuner's; the cost model's counts of one call are ``flashtune.perf.model.algorithm``.)
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from flashtune import families
from flashtune.codegen.spec import Problem, ProblemBucket, Shape
from flashtune.errors import TuningError

#: The standard sweep's hidden size (heads * head_dim) and tokens per batch.
SWEEP_HIDDEN = 2048
SWEEP_TOKENS = 16 * 1024
#: Fractions of the bucket's upper seqlen measured by default.
DEFAULT_SEQ_FRACTIONS = (1.0, 0.75)
#: Verification shapes stay small; they are not multiples of any tile size on purpose, so
#: the masked edges of the last query and key tiles are checked too.
VERIFY_SEQ_CAP = 1024
_VERIFY_ODD = 7


@dataclass(frozen=True)
class BatchHeads:
    """A (batch, heads) pair, written ``BxH`` on the command line (e.g. ``4x16``)."""

    batch: int
    heads: int

    def __post_init__(self) -> None:
        if self.batch < 1 or self.heads < 1:
            raise TuningError(f"batch x heads {self.batch}x{self.heads} is invalid; both must "
                              "be >= 1")

    @classmethod
    def parse(cls, text: str) -> BatchHeads:
        match = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", text)
        if not match:
            raise TuningError(f"batch-heads {text!r} is malformed; expected BATCHxHEADS, e.g. "
                              "'4x16'")
        return cls(int(match.group(1)), int(match.group(2)))


def parse_batch_heads(text: str | None) -> tuple[BatchHeads, ...]:
    """``'4x16,1x32'`` -> pairs; None or empty -> () (use the standard sweep's values)."""
    if not text:
        return ()
    return tuple(BatchHeads.parse(part) for part in text.split(",") if part.strip())


def parse_seqlens(text: str) -> tuple[int, ...]:
    """``'1024,4k,16384'`` -> (1024, 4096, 16384); ``k`` means 1024."""
    out: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", part)
        if not match:
            raise TuningError(f"sequence length {part!r} is malformed; expected e.g. "
                              "'1024,4096,16k'")
        value = int(match.group(1)) * (1024 if match.group(2) else 1)
        if value < 1:
            raise TuningError(f"sequence length {value} must be >= 1")
        out.append(value)
    if not out:
        raise TuningError("no sequence lengths given; expected e.g. --seqlens 1024,4096")
    return tuple(out)


def sweep_batch_heads(problem: Problem, seqlen: int) -> BatchHeads:
    """The standard sweep's batch and heads at ``seqlen``: hidden 2048, ~16k tokens."""
    heads = max(1, SWEEP_HIDDEN // problem.head_dim)
    batch = max(1, SWEEP_TOKENS // seqlen)
    return BatchHeads(batch, heads)


@dataclass(frozen=True)
class Workload:
    """The shapes one bucket is timed on, and the shape it is verified on."""

    bucket: ProblemBucket
    shapes: tuple[Shape, ...]
    verify_shape: Shape

    def __post_init__(self) -> None:
        if not self.shapes:
            raise TuningError(f"bucket {self.bucket.key()} has no shapes to measure")

    @property
    def problem(self) -> Problem:
        return self.bucket.problem

    def tflops(self, shape: Shape, ms: float) -> float:
        return families.of(self.problem).flops(self.problem, shape) / (ms * 1e-3) / 1e12

    def objective(self, medians_ms: Sequence[float]) -> float:
        """Geometric mean TFLOP/s over the shapes, from their median times (ms)."""
        if len(medians_ms) != len(self.shapes) or any(t <= 0 for t in medians_ms):
            raise TuningError(f"need one positive time per shape ({len(self.shapes)}), got "
                              f"{list(medians_ms)}")
        return geomean([self.tflops(s, t) for s, t in zip(self.shapes, medians_ms, strict=True)])


    def bandwidth(self, medians_ms: Sequence[float]) -> float:
        """Geometric mean GB/s over the shapes: the bytes each must move at the least (the
        family's ``min_bytes``) over its median time (ms); a memory-bound op's measure."""
        if len(medians_ms) != len(self.shapes) or any(t <= 0 for t in medians_ms):
            raise TuningError(f"need one positive time per shape ({len(self.shapes)}), got "
                              f"{list(medians_ms)}")
        family = families.of(self.problem)
        return geomean([family.min_bytes(self.problem, s) / (t * 1e-3) / 1e9
                        for s, t in zip(self.shapes, medians_ms, strict=True)])


def geomean(values: Sequence[float]) -> float:
    if not values or any(v <= 0 for v in values):
        raise TuningError(f"geometric mean needs positive values, got {list(values)}")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def make_workload(bucket: ProblemBucket, batch_heads: Sequence[BatchHeads] = (),
                  fractions: Sequence[float] = DEFAULT_SEQ_FRACTIONS,
                  verify_cap: int = VERIFY_SEQ_CAP) -> Workload:
    """Representative shapes of ``bucket``: each fraction of N, at each batch-heads pair."""
    problem, top = bucket.problem, bucket.seqlen
    own = families.of(problem).tuning_shapes(
        problem, top, [(bh.batch, bh.heads) for bh in batch_heads], bucket.shape_class)
    if own is not None:
        return Workload(bucket, tuple(own[0]), own[1])
    shapes: list[Shape] = []
    for fraction in fractions:
        seqlen = max(1, int(round(top * fraction)))
        pairs = list(batch_heads) or [sweep_batch_heads(problem, seqlen)]
        for bh in pairs:
            shape = Shape.square(bh.batch, bh.heads, seqlen)
            if shape not in shapes:
                shapes.append(shape)
    verify_len = max(1, min(top, verify_cap) - _VERIFY_ODD)
    verify = Shape.square(1, 2, verify_len)
    return Workload(bucket, tuple(shapes), verify)
