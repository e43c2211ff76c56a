"""Main-loop figures of reference kernels, measured from their compiled SASS with the same
loop finder as flashtune's kernels (reference/fa3-bwd-fp8-sass-facts.md), for ``profile`` to
print beside a kernel's own loop.

FA3's backward, d128 bf16 on sm_90a (two consumer warpgroups over a 128-row K/V tile, one Q
tile per iteration): static instructions per warp per main-loop iteration and the tensor
FLOPs one warp issues in it. Its one loop masks every iteration (the loop finder calls it
masked). A ratio is taken per tensor FLOP, so kernels of other tiles compare.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashtune.codegen.spec import DType, Problem


@dataclass(frozen=True)
class ReferenceLoop:
    """One reference kernel's main loop: what it is, its instructions and tensor FLOPs per
    warp per iteration."""

    kernel: str
    instructions: int
    tensor_flops: int

    def __post_init__(self) -> None:
        if self.instructions <= 0 or self.tensor_flops <= 0:
            raise ValueError(f"{self.kernel}: instructions and tensor FLOPs must be positive")

    def ratio(self, instructions: int, tensor_flops: int) -> float:
        """Instructions per tensor FLOP of a loop over this reference's (1.0: as lean)."""
        return (instructions / tensor_flops) / (self.instructions / self.tensor_flops)


#: FA3's backward main loop at d128 bf16, by causal: 64 x 128 tiles (causal), 80 x 128 (not).
FA3_BACKWARD_D128_BF16 = {
    True: ReferenceLoop("FA3 backward, d128 bf16 causal, 64 x 128", 486, 1310720),
    False: ReferenceLoop("FA3 backward, d128 bf16 non-causal, 80 x 128", 510, 1638400),
}

#: The ops whose loops compare with FA3's backward (the sm_90a backward families).
_BACKWARD_OPS = frozenset({"bwd90a", "bwd90adet"})


def reference_loop(problem: Problem) -> ReferenceLoop | None:
    """The reference loop to print beside ``problem``'s, or None when none was measured for
    its op, head dim and dtype."""
    if problem.op in _BACKWARD_OPS and problem.head_dim == 128 and problem.dtype is DType.BF16:
        return FA3_BACKWARD_D128_BF16[problem.causal]
    return None
