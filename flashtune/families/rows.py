"""The row-kernel base: a kernel that walks rows with no key tile and no mask.

The backward's preprocess and convert (families/bwd/rows.py) and the split combine
(families/combine.py) are memory-bound kernels with one block per block_m rows and warps
that take rows in turn: no key tile (their space holds block_n = 16 only), no pipeline
(num_stages = 1), no shared memory, no causal mask. ``RowFamily`` declares that once; a
subclass names its space, its default and why, and the rest of a family (inputs, outputs,
launch plan, reference) as any family does.
"""

from __future__ import annotations

from typing import ClassVar

from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.dtypes import SAME_16BIT
from flashtune.codegen.params import ParamSpace
from flashtune.codegen.render import TemplateValue
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.errors import InvalidProblem
from flashtune.families.base import KernelFamily, element_params

#: The default of a row kernel: 64 rows per block over 4 warps (no key tile, one stage).
ROW_DEFAULT = KernelConfig(block_m=64, block_n=16, num_warps=4, num_stages=1)


def row_kernel_params(problem: Problem, config: KernelConfig) -> dict[str, TemplateValue]:
    """Template parameters of a kernel that walks rows with no key tile (the backward's row
    kernels, the split combine): head dim, element type, rows per block and warps."""
    return {"head_dim": problem.head_dim, **element_params(problem),
            "block_m": config.block_m, "num_warps": config.num_warps}


class RowFamily(KernelFamily):
    """What the row kernels share: no mask, the rules of a kernel with no key tile, the
    default, the template parameters and no shared memory. Subclasses set ``row_space``,
    and ``row_default`` and ``row_default_reason`` where theirs differ."""

    dtypes = SAME_16BIT

    #: The family's search space (block_n (16,) and num_stages (1,) only).
    row_space: ClassVar[ParamSpace]
    #: What runs when nothing is tuned, and why (``default_reason``).
    row_default: ClassVar[KernelConfig] = ROW_DEFAULT
    row_default_reason: ClassVar[str] = ("memory-bound rows: 64 rows per block over 4 warps on "
                                         "every arch")

    def check_problem(self, problem: Problem) -> None:
        super().check_problem(problem)
        if problem.causal:
            raise InvalidProblem(f"{problem.key()}: the {self.op} kernel has no mask; use "
                                 "causal=False")

    def space(self, problem: Problem) -> ParamSpace:
        return self.row_space

    def rules(self, problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
        if config.num_stages != 1:
            return f"num_stages={config.num_stages}: the {self.op} kernel does not pipeline"
        if config.block_n != 16:
            return f"block_n={config.block_n}: the {self.op} kernel has no key tile (use 16)"
        return None

    def default_config(self, problem: Problem, arch: ArchSpec) -> KernelConfig:
        return self.fitting(problem, self.row_default, arch)

    def default_reason(self, problem: Problem, arch: ArchSpec) -> str:
        return self.row_default_reason

    def template_params(self, problem: Problem, config: KernelConfig
                        ) -> dict[str, TemplateValue]:
        return row_kernel_params(problem, config)

    def smem_bytes(self, problem: Problem, config: KernelConfig) -> int:
        return 0
