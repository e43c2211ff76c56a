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
from dataclasses import dataclass
from enum import Enum

from flashtune.errors import InvalidConfig


class ArchClass(str, Enum):
    """A group of archs that share one column of a family's default table, by shared memory
    per SM (the resource that decides a tile most): ``sm80`` (164 KB: A100/A30, Orin),
    ``sm86`` (100 KB: consumer Ampere, Ada, Blackwell) and ``sm90`` (228 KB: H100/H200,
    B200)."""

    SM80 = "sm80"
    SM86 = "sm86"
    SM90 = "sm90"



#: Sub-partitions (warp schedulers) per SM on every arch from sm_80 on.
SUBPARTITIONS_PER_SM = 4


@dataclass(frozen=True)
class ArchThroughput:
    """Warp-instruction throughputs of one compute capability, in results per clock per SM.

    From the CUDA C Programming Guide, "Arithmetic Instructions" throughput table:
    32-bit float add/multiply/fma: 64 on 8.0, 128 on 8.6, 8.9 and 9.0; exp2/log2/rcp/rsqrt/
    sin/cos (the MUFU unit): 16 on all of them; warp shuffle: 32. Shared memory delivers
    32 banks x 4 bytes = 128 bytes per clock per SM on all of them.
    """

    fp32_per_clk: int
    mufu_per_clk: int
    shfl_per_clk: int
    smem_bytes_per_clk: int = 128

    def __post_init__(self) -> None:
        for name in ("fp32_per_clk", "mufu_per_clk", "shfl_per_clk", "smem_bytes_per_clk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidConfig(f"ArchThroughput.{name} must be a positive int, got "
                                    f"{value!r}")

    def warp_cycles(self, per_clk_per_sm: int) -> float:
        """Cycles one warp instruction keeps its pipe busy on one sub-partition."""
        return 32.0 / (per_clk_per_sm / SUBPARTITIONS_PER_SM)


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
    #: The column of the families' default tables this arch reads.
    default_class: ArchClass
    #: An upper bound of dense fp16/bf16 tensor-core FLOPs per clock per SM (with float32
    #: accumulation): 1024 on consumer Ampere, Ada and Blackwell, 2048 on A100, 4096 on
    #: H100, 8192 on B200 (the datasheets' dense rates over SMs x boost clock, rounded up to
    #: a power of two). The database's physics check bounds imported timings with it.
    tensor_flops_per_clk_sm: int
    #: Instruction throughputs the cost model times with; None where it has no table.
    throughput: ArchThroughput | None = None
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
_SM80, _SM86, _SM90 = ArchClass.SM80, ArchClass.SM86, ArchClass.SM90
_AMPERE_DC = ArchThroughput(fp32_per_clk=64, mufu_per_clk=16, shfl_per_clk=32)
_LATER = ArchThroughput(fp32_per_clk=128, mufu_per_clk=16, shfl_per_clk=32)

#: The one table of arch facts: limits, default-table class, tensor rate, throughputs.
ARCHS: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        ArchSpec("sm_80", 8, 0, 163 * _KIB, 164 * _KIB, _KIB, 65536, 255, 2048, 32, 64,
                 _SM80, 2048, _AMPERE_DC),
        ArchSpec("sm_86", 8, 6, 99 * _KIB, 100 * _KIB, _KIB, 65536, 255, 1536, 16, 48,
                 _SM86, 1024, _LATER),
        ArchSpec("sm_87", 8, 7, 163 * _KIB, 164 * _KIB, _KIB, 65536, 255, 2048, 32, 64,
                 _SM80, 2048),
        ArchSpec("sm_89", 8, 9, 99 * _KIB, 100 * _KIB, _KIB, 65536, 255, 1536, 24, 48,
                 _SM86, 1024, _LATER),
        ArchSpec("sm_90", 9, 0, 227 * _KIB, 228 * _KIB, _KIB, 65536, 255, 2048, 32, 64,
                 _SM90, 4096, _LATER),
        ArchSpec("sm_90a", 9, 0, 227 * _KIB, 228 * _KIB, _KIB, 65536, 255, 2048, 32, 64,
                 _SM90, 4096, _LATER, arch_specific=True),
        ArchSpec("sm_100", 10, 0, 227 * _KIB, 228 * _KIB, _KIB, 65536, 255, 2048, 32, 64,
                 _SM90, 8192),
        ArchSpec("sm_120", 12, 0, 99 * _KIB, 100 * _KIB, _KIB, 65536, 255, 1536, 32, 48,
                 _SM86, 1024),
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
            f"arch {name!r} is not supported; expected one of {list(ARCHS)} "
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


def arch_class(arch: ArchSpec) -> ArchClass:
    """The default-table class of ``arch`` (``ArchSpec.default_class``)."""
    return arch.default_class
