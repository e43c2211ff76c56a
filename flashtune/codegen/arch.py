"""Per-architecture hardware limits, from NVIDIA's CUDA C Programming Guide tables.

Used by static pruning (shared memory per block), occupancy and the cost model. Values are
per SM unless named per block.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from flashtune.errors import InvalidConfig


@dataclass(frozen=True)
class ArchSpec:
    name: str                      # e.g. "sm_90"
    major: int
    minor: int
    max_smem_per_block: int        # opt-in maximum of dynamic shared memory per block, bytes
    smem_per_sm: int               # shared memory capacity per SM, bytes
    smem_reserved_per_block: int   # bytes the runtime reserves per resident block
    regs_per_sm: int
    max_regs_per_thread: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    max_warps_per_sm: int

    @property
    def compute_capability(self) -> tuple[int, int]:
        return (self.major, self.minor)


_KIB = 1024
ARCHS: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        ArchSpec("sm_80", 8, 0, 163 * _KIB, 164 * _KIB, _KIB, 65536, 255, 2048, 32, 64),
        ArchSpec("sm_86", 8, 6, 99 * _KIB, 100 * _KIB, _KIB, 65536, 255, 1536, 16, 48),
        ArchSpec("sm_87", 8, 7, 163 * _KIB, 164 * _KIB, _KIB, 65536, 255, 2048, 32, 64),
        ArchSpec("sm_89", 8, 9, 99 * _KIB, 100 * _KIB, _KIB, 65536, 255, 1536, 24, 48),
        ArchSpec("sm_90", 9, 0, 227 * _KIB, 228 * _KIB, _KIB, 65536, 255, 2048, 32, 64),
        ArchSpec("sm_100", 10, 0, 227 * _KIB, 228 * _KIB, _KIB, 65536, 255, 2048, 32, 64),
        ArchSpec("sm_120", 12, 0, 99 * _KIB, 100 * _KIB, _KIB, 65536, 255, 1536, 32, 48),
    )
}


def get_arch(name: str) -> ArchSpec:
    """Look up an arch by name ('sm_90', 'sm90', '90', 'compute_90' or '9.0')."""
    text = name.strip().lower()
    match = re.fullmatch(r"(?:sm_?|compute_)?(\d+)(?:\.(\d))?a?", text)
    key = None
    if match:
        digits = match.group(1) + (match.group(2) or "")
        key = f"sm_{digits}"
    if key not in ARCHS:
        raise InvalidConfig(
            f"arch {name!r} is not supported; expected one of {sorted(ARCHS)} "
            "(flashtune kernels need mma.sync m16n8k16, i.e. sm_80 or newer)"
        )
    assert key is not None
    return ARCHS[key]


class ArchClass(str, Enum):
    """A group of archs that share one column of a family's default table, by shared memory
    per SM (the resource that decides a tile most): ``sm80`` (164 KB: A100/A30, Orin),
    ``sm86`` (100 KB: consumer Ampere, Ada, Blackwell) and ``sm90`` (228 KB: H100/H200,
    B200)."""

    SM80 = "sm80"
    SM86 = "sm86"
    SM90 = "sm90"


#: The class of every arch flashtune knows (codegen.arch.ARCHS).
ARCH_CLASS: Mapping[str, ArchClass] = {
    "sm_80": ArchClass.SM80,
    "sm_87": ArchClass.SM80,
    "sm_86": ArchClass.SM86,
    "sm_89": ArchClass.SM86,
    "sm_120": ArchClass.SM86,
    "sm_90": ArchClass.SM90,
    "sm_100": ArchClass.SM90,
}


def arch_class(arch: ArchSpec) -> ArchClass:
    """The default-table class of ``arch``; an arch not in ARCH_CLASS is classed by its
    per-block shared memory limit (the property the classes stand for)."""
    known = ARCH_CLASS.get(arch.name)
    if known is not None:
        return known
    if arch.max_smem_per_block >= 227 * _KIB:
        return ArchClass.SM90
    if arch.max_smem_per_block >= 163 * _KIB:
        return ArchClass.SM80
    return ArchClass.SM86
