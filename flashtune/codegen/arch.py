"""Per-architecture hardware limits, from NVIDIA's CUDA C Programming Guide tables.

Used by static pruning (shared memory per block), occupancy and the cost model. Values are
per SM unless named per block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
    def family(self) -> str:
        return self.name

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
