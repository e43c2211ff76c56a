"""Theoretical occupancy (resident blocks and warps per SM) and the wave count of a grid.

The rules are those of NVIDIA's occupancy calculator for compute capability 8.x and 9.0:

- registers are allocated per warp in units of 256 (``ceil(regs * 32 / 256) * 256``), from
  the register file of the warp's sub-partition (one quarter of the SM's): the SM holds
  ``floor(regs_per_sm / 4 / regs_per_warp) * 4`` warps;
- shared memory is allocated per block in units of 128 bytes, after adding the 1 KiB the
  runtime reserves per block (``ArchSpec.smem_reserved_per_block``); the SM is assumed to
  run with its largest carve-out (``ArchSpec.smem_per_sm``), as the driver picks for
  kernels that ask for more than the default;
- threads, warps and blocks per SM are capped by the arch's limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashtune.codegen.arch import ArchSpec, get_arch
from flashtune.errors import InvalidConfig, OutOfResources

REG_ALLOC_UNIT = 256
SMEM_ALLOC_UNIT = 128
SUBPARTITIONS = 4
WARP_SIZE = 32


@dataclass(frozen=True)
class Occupancy:
    """Resident blocks of one kernel on one SM and which resource limits them."""

    arch: str
    threads_per_block: int
    registers_per_thread: int
    smem_per_block: int
    blocks_per_sm: int
    limits: tuple[tuple[str, int], ...]  # (resource, blocks it alone would allow)
    max_warps_per_sm: int

    @property
    def warps_per_block(self) -> int:
        return -(-self.threads_per_block // WARP_SIZE)

    @property
    def warps_per_sm(self) -> int:
        return self.blocks_per_sm * self.warps_per_block

    @property
    def ratio(self) -> float:
        """Resident warps over the arch's maximum (the 'occupancy' percentage / 100)."""
        return self.warps_per_sm / self.max_warps_per_sm

    @property
    def limiter(self) -> str:
        """The resource that sets blocks_per_sm (the first one, in a stable order)."""
        return min(self.limits, key=lambda kv: kv[1])[0]

    def to_dict(self) -> dict[str, object]:
        return {
            "arch": self.arch, "threads_per_block": self.threads_per_block,
            "registers_per_thread": self.registers_per_thread,
            "smem_per_block": self.smem_per_block, "blocks_per_sm": self.blocks_per_sm,
            "warps_per_sm": self.warps_per_sm, "occupancy": round(self.ratio, 4),
            "limiter": self.limiter, "limits": dict(self.limits),
        }


def _arch(arch: ArchSpec | str) -> ArchSpec:
    return arch if isinstance(arch, ArchSpec) else get_arch(arch)


def registers_per_warp(registers_per_thread: int) -> int:
    """Registers one warp is allocated (rounded up to the 256-register unit)."""
    return -(-registers_per_thread * WARP_SIZE // REG_ALLOC_UNIT) * REG_ALLOC_UNIT


def smem_allocated(smem_per_block: int, spec: ArchSpec) -> int:
    """Shared memory one block takes from the SM: request + reserve, in 128-byte units."""
    total = smem_per_block + spec.smem_reserved_per_block
    return -(-total // SMEM_ALLOC_UNIT) * SMEM_ALLOC_UNIT


def occupancy(arch: ArchSpec | str, *, threads: int, registers: int,
              smem_bytes: int) -> Occupancy:
    """Blocks per SM of a kernel with ``threads`` per block, ``registers`` per thread and
    ``smem_bytes`` of shared memory per block (static + dynamic) on ``arch``.

    Raises InvalidConfig for impossible inputs and OutOfResources when not even one block
    fits (the launch would fail), naming the resource.
    """
    spec = _arch(arch)
    for name, value in (("threads", threads), ("registers", registers),
                        ("smem_bytes", smem_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidConfig(f"occupancy: {name}={value!r} must be a non-negative int")
    if not 1 <= threads <= 1024:
        raise InvalidConfig(f"occupancy: threads={threads} must be in [1, 1024]")
    if registers > spec.max_regs_per_thread:
        raise OutOfResources("registers per thread", registers, spec.max_regs_per_thread,
                             "reduce register use (smaller tiles or fewer warps' rows)")
    if smem_bytes > spec.max_smem_per_block:
        raise OutOfResources("shared memory per block (bytes)", smem_bytes,
                             spec.max_smem_per_block, f"use smaller tiles on {spec.name}")
    warps = -(-threads // WARP_SIZE)
    limits: list[tuple[str, int]] = [
        ("blocks", spec.max_blocks_per_sm),
        ("warps", spec.max_warps_per_sm // warps),
        ("threads", spec.max_threads_per_sm // (warps * WARP_SIZE)),
    ]
    per_warp = registers_per_warp(max(registers, 1))
    # The launch check assumes a block's warps are spread over all four sub-partitions.
    per_block = per_warp * -(-warps // SUBPARTITIONS) * SUBPARTITIONS
    if per_block > spec.regs_per_sm:
        raise OutOfResources(
            f"registers of one block ({threads} threads x {registers}) on {spec.name}",
            per_block, spec.regs_per_sm, "use fewer threads per block or fewer registers")
    warps_per_partition = (spec.regs_per_sm // SUBPARTITIONS) // per_warp
    limits.append(("registers", warps_per_partition * SUBPARTITIONS // warps))
    limits.append(("shared memory", spec.smem_per_sm // smem_allocated(smem_bytes, spec)))
    blocks = min(v for _, v in limits)
    occ = Occupancy(spec.name, threads, registers, smem_bytes, blocks, tuple(limits),
                    spec.max_warps_per_sm)
    if blocks == 0:  # unreachable with the shipped arch table; kept for custom ArchSpecs
        raise OutOfResources(f"{occ.limiter} of one block on {spec.name}", 1, 0,
                             "no block fits on an SM; use a smaller block")
    return occ


@dataclass(frozen=True)
class Waves:
    """How a grid of ``blocks`` fills ``sm_count`` SMs holding ``blocks_per_sm`` each."""

    blocks: int
    slots: int

    @property
    def waves(self) -> float:
        """Fractional number of waves (blocks / resident slots)."""
        return self.blocks / self.slots

    @property
    def full_waves(self) -> int:
        """Waves the grid needs when every block takes the same time."""
        return math.ceil(self.waves)

    @property
    def efficiency(self) -> float:
        """Share of the slots' time doing work under wave quantisation (1 = no tail)."""
        return self.waves / self.full_waves


def waves(blocks: int, blocks_per_sm: int, sm_count: int) -> Waves:
    """The wave count of a grid of ``blocks`` on ``sm_count`` SMs with ``blocks_per_sm``."""
    if blocks < 1 or blocks_per_sm < 1 or sm_count < 1:
        raise InvalidConfig(f"waves: blocks={blocks}, blocks_per_sm={blocks_per_sm}, "
                            f"sm_count={sm_count} must all be >= 1")
    return Waves(blocks, blocks_per_sm * sm_count)
