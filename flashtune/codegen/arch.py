"""Per-architecture hardware limits, from NVIDIA's CUDA C Programming Guide tables.

Used by static pruning (shared memory per block), occupancy and the cost model. Values are
per SM unless named per block.

An arch-specific target (``sm_90a``) is a name of its own: its binaries use instructions
(wgmma, setmaxnreg) that exist on exactly one compute capability, so they run only on
devices of that compute capability, never on later ones as ``sm_90`` code would. Its limits
are those of the generic arch of the same compute capability.
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
    #: True for an arch-specific target (sm_90a): its code runs on this compute capability only.
    arch_specific: bool = False

    @property
    def compute_capability(self) -> tuple[int, int]:
        return (self.major, self.minor)

    def runs_on(self, device: ArchSpec) -> bool:
        """Whether a binary built for this target runs on a device of arch ``device``: an
        arch-specific target only on its own compute capability, any other on devices of
        its own arch (flashtune compiles for the device's exact arch)."""
        if self.arch_specific:
            return device.compute_capability == self.compute_capability
        return device.name == self.name


_KIB = 1024
ARCHS: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        ArchSpec("sm_80", 8, 0, 163 * _KIB, 164 * _KIB, _KIB, 65536, 255, 2048, 32, 64),
        ArchSpec("sm_86", 8, 6, 99 * _KIB, 100 * _KIB, _KIB, 65536, 255, 1536, 16, 48),
        ArchSpec("sm_87", 8, 7, 163 * _KIB, 164 * _KIB, _KIB, 65536, 255, 2048, 32, 64),
        ArchSpec("sm_89", 8, 9, 99 * _KIB, 100 * _KIB, _KIB, 65536, 255, 1536, 24, 48),
        ArchSpec("sm_90", 9, 0, 227 * _KIB, 228 * _KIB, _KIB, 65536, 255, 2048, 32, 64),
        ArchSpec("sm_90a", 9, 0, 227 * _KIB, 228 * _KIB, _KIB, 65536, 255, 2048, 32, 64,
                 arch_specific=True),
        ArchSpec("sm_100", 10, 0, 227 * _KIB, 228 * _KIB, _KIB, 65536, 255, 2048, 32, 64),
        ArchSpec("sm_120", 12, 0, 99 * _KIB, 100 * _KIB, _KIB, 65536, 255, 1536, 32, 48),
    )
}


def device_arch(spec: ArchSpec) -> ArchSpec:
    """The arch a device of ``spec``'s compute capability reports (sm_90 for sm_90a): the
    target a portable (not arch-specific) source is built for when it runs there, while an
    arch-specific source picks its own (``compile_target``)."""
    if not spec.arch_specific:
        return spec
    return ARCHS[f"sm_{spec.major}{spec.minor}"]


def get_arch(name: str) -> ArchSpec:
    """Look up an arch by name ('sm_90', 'sm90', '90', 'compute_90' or '9.0'); an ``a``
    suffix names the arch-specific target ('sm_90a', '90a', '9.0a'), a different arch."""
    text = name.strip().lower()
    match = re.fullmatch(r"(?:sm_?|compute_)?(\d+)(?:\.(\d))?(a?)", text)
    key = None
    if match:
        digits = match.group(1) + (match.group(2) or "")
        key = f"sm_{digits}{match.group(3)}"
    if key not in ARCHS:
        raise InvalidConfig(
            f"arch {name!r} is not supported; expected one of {sorted(ARCHS)} "
            "(flashtune kernels need mma.sync m16n8k16, i.e. sm_80 or newer; the only "
            "arch-specific target is sm_90a)"
        )
    assert key is not None
    return ARCHS[key]


def compile_target(required: str | None, arch: str) -> ArchSpec:
    """The arch a source is built for when it is asked for on ``arch``: ``arch`` itself, or
    the arch-specific target ``required`` by the source (``KernelSource.target``) when a
    device of ``arch`` runs it (sm_90a code asked for on sm_90 or sm_90a). InvalidConfig
    when it cannot run there (sm_90a code on sm_80 or sm_100)."""
    spec = get_arch(arch)
    if required is None:
        return spec
    target = get_arch(required)
    if not target.runs_on(spec):
        major, minor = target.compute_capability
        raise InvalidConfig(
            f"this kernel is built for {target.name}, which runs only on compute capability "
            f"{major}.{minor} devices; {spec.name} (compute capability {spec.major}."
            f"{spec.minor}) cannot run it. Compile it for {target.name} or a "
            f"compute-capability {major}.{minor} arch, or use a kernel family that is not "
            "arch-specific on this device")
    return target


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
    "sm_90a": ArchClass.SM90,
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
