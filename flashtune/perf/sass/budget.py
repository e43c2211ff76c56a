"""The instruction budget of the forward kernel's main loops: instructions per iteration per
warp by class, for the masked and the unmasked loop, against FlashAttention-2's figure for
the same tile where one is published.

The classes are those of reference/fa2-sass-facts.md, so that a row reads against FA2's:
HMMA, LDSM, MUFU.EX2, FMNMX, SHFL, BAR, FMUL, FSEL, integer / address / predicate, and the
rest (FFMA, FADD, conversions, cp.async, control); sm_90a kernels add HGMMA (wgmma). Counts
are static (the listing) with, for the unmasked loop, the count executed when the warp vote
skips the rescale of O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.perf.sass.loops import MainLoop, MainLoops
from flashtune.perf.sass.parse import InstructionMix, categorize

#: Budget classes in print order.
BUDGET_CLASSES: tuple[str, ...] = (
    "HMMA", "HGMMA", "LDSM", "LDGSTS", "MUFU", "FMNMX", "FMUL", "FFMA", "FADD", "FSEL", "F2FP",
    "SHFL", "BAR", "int/addr/pred", "other",
)
_BY_BASE = {"HMMA": "HMMA", "HGMMA": "HGMMA", "LDSM": "LDSM", "LDGSTS": "LDGSTS", "MUFU": "MUFU",
            "FMNMX": "FMNMX", "FMNMX3": "FMNMX", "FMUL": "FMUL", "FFMA": "FFMA",
            "FADD": "FADD", "FSEL": "FSEL", "F2FP": "F2FP", "SHFL": "SHFL", "BAR": "BAR"}


def budget_classes(mix: InstructionMix) -> dict[str, int]:
    """Static counts of ``mix`` by budget class (every instruction in exactly one)."""
    out = dict.fromkeys(BUDGET_CLASSES, 0)
    for opcode, n in mix.by_opcode.items():
        base = opcode.split(".", 1)[0]
        if base in _BY_BASE:
            out[_BY_BASE[base]] += n
        elif opcode.startswith("LDGSTS"):
            out["LDGSTS"] += n
        elif categorize(opcode) == "int":
            out["int/addr/pred"] += n
        else:
            out["other"] += n
    return out


@dataclass(frozen=True)
class Fa2LoopFigure:
    """FA2's instructions per main-loop iteration per warp for one tile (facts file)."""

    arch: str
    head_dim: int
    block_m: int
    block_n: int
    num_warps: int
    instructions: int
    note: str


#: reference/fa2-sass-facts.md: FA2 (Dao-AILab/flash-attention 0251105, nvcc 13.0), bf16,
#: head dim 128, non-causal build, sm_90. Its causal build runs the same unmasked loop.
FA2_LOOP_FIGURES: tuple[Fa2LoopFigure, ...] = (
    Fa2LoopFigure("sm_90", 128, 128, 32, 4, 536, "FA2 128x32, 4 warps, sm_90, bf16"),
    Fa2LoopFigure("sm_90", 128, 128, 64, 4, 933,
                  "FA2 128x64, 4 warps, sm_90, bf16 (83 of them spill MOV/LDL/STL)"),
)


def fa2_figure(problem: Problem, config: KernelConfig, arch: str) -> Fa2LoopFigure | None:
    """FA2's published figure for the same tile, head dim and arch, if there is one."""
    for f in FA2_LOOP_FIGURES:
        if (f.arch, f.head_dim, f.block_m, f.block_n, f.num_warps) == (
                arch, problem.padded_head_dim, config.block_m, config.block_n,
                config.num_warps):
            return f
    return None


@dataclass(frozen=True)
class BudgetRow:
    """One kernel's loop budget: the unmasked and masked loops and FA2's same-tile figure."""

    problem: Problem
    config: KernelConfig
    arch: str
    unmasked: MainLoop | None
    masked: MainLoop | None
    fa2: Fa2LoopFigure | None
    #: "default" (the problem's default config) or "reference" (a tile FA2's figure is for)
    role: str = "default"

    @property
    def ratio(self) -> float | None:
        """Unmasked static instructions per iteration / FA2's, when both exist."""
        if self.fa2 is None or self.unmasked is None:
            return None
        return self.unmasked.static / self.fa2.instructions

    def to_dict(self) -> dict[str, object]:
        def loop(lp: MainLoop | None) -> dict[str, object] | None:
            if lp is None:
                return None
            return {"static": lp.static, "executed_min": lp.executed_min,
                    "classes": budget_classes(lp.mix), "local_memory": lp.local.to_dict()}

        return {"problem": self.problem.key(), "config": self.config.key(), "arch": self.arch,
                "role": self.role, "unmasked": loop(self.unmasked), "masked": loop(self.masked),
                "fa2": None if self.fa2 is None else self.fa2.instructions,
                "ratio": self.ratio}


def budget_row(problem: Problem, config: KernelConfig, arch: str,
               loops: MainLoops, role: str = "default") -> BudgetRow:
    return BudgetRow(problem, config, arch, loops.unmasked, loops.masked,
                     fa2_figure(problem, config, arch), role)


def default_problems(head_dims: Iterable[int] = (64, 128),
                     dtypes: Iterable[DType] = (DType.BF16,),
                     archs: Iterable[str] = ("sm_80", "sm_90")
                     ) -> list[tuple[Problem, KernelConfig, str]]:
    """(problem, its default config, arch) for every head dim, dtype, mask and arch."""
    out = []
    for arch in archs:
        for head_dim in head_dims:
            for dtype in dtypes:
                for causal in (False, True):
                    problem = Problem(head_dim, dtype, causal=causal)
                    # The one place the default table is read: the problem's family.
                    config = families.of(problem).default_config(problem, get_arch(arch))
                    out.append((problem, config, arch))
    return out


def reference_problems(head_dims: Iterable[int] = (64, 128),
                       dtypes: Iterable[DType] = (DType.BF16,),
                       archs: Iterable[str] = ("sm_80", "sm_90")
                       ) -> list[tuple[Problem, KernelConfig, str]]:
    """(problem, tile, arch) for every tile FA2's figures are for (FA2_LOOP_FIGURES), in
    the head dims, dtypes and archs asked, both masks, unless it is the problem's default
    (``default_problems`` has those): the tiles a default is measured against, such as
    128 x 32 at head dim 128 on sm_90."""
    head_dims, dtypes, archs = tuple(head_dims), tuple(dtypes), tuple(archs)
    defaults = default_problems(head_dims, dtypes, archs)
    out = []
    for arch in archs:
        for f in FA2_LOOP_FIGURES:
            if f.arch != get_arch(arch).name or f.head_dim not in head_dims:
                continue
            for dtype in dtypes:
                for causal in (False, True):
                    row = (Problem(f.head_dim, dtype, causal=causal),
                           KernelConfig(f.block_m, f.block_n, f.num_warps, 2), arch)
                    if not any(d[0] == row[0] and d[2] == arch and _same_tile(d[1], row[1])
                               for d in defaults):
                        out.append(row)
    return out


def _same_tile(a: KernelConfig, b: KernelConfig) -> bool:
    return (a.block_m, a.block_n, a.num_warps) == (b.block_m, b.block_n, b.num_warps)


def class_table(rows: Mapping[str, InstructionMix]) -> list[tuple[str, ...]]:
    """Rows of (class, count per column) for mixes by column name."""
    counts = {name: budget_classes(mix) for name, mix in rows.items()}
    table = [(cls, *(str(counts[name][cls]) for name in rows)) for cls in BUDGET_CLASSES]
    table.append(("all", *(str(mix.total) for mix in rows.values())))
    return table
