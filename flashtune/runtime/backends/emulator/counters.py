"""Counters of one emulated launch (``LaunchOptions(counters=True)``).

What is counted, at the emulator's primitives (abi.h ``ftemu_counters``):

* cp.async: per-thread copies, global bytes read (``src_bytes``; zero-fill reads nothing),
  and per *warp request* (the k-th cp.async of every lane of a warp, what the hardware
  coalesces) the distinct 32-byte sectors touched against the minimum ``ceil(bytes / 32)``;
  the shared-memory writes are split into phases of 128 bytes by lane index (8 lanes of 16
  bytes, 16 of 8, 32 of 4);
* ldmatrix: warp instructions and their phases (one per 8x8 matrix: 8 rows of 16 bytes);
* a shared-memory phase takes as many wavefronts as the largest number of distinct 4-byte
  words in one of the 32 banks (the n of an n-way conflict; 1 = conflict-free);
* mma (m16n8k16 warp instructions), warp shuffles, completed ``__syncthreads``, and mma per
  block (the block's share of the work: causal imbalance shows here);
* read-only global loads through ``__ldg``: their bytes (the split combine reads the
  partials that way, so its reads are counted);
* per call site (file:line) of cp.async and ldmatrix, the same figures.

Other loads and stores through pointers are host memory accesses and are not counted (the
forward kernel writes O and LSE that way).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import PurePath

from flashtune.errors import InvalidInput
from flashtune.runtime.backends.emulator import native


@dataclass(frozen=True)
class SiteCounters:
    """cp.async or ldmatrix figures of one call site."""

    kind: str  # "cp_async" or "ldmatrix"
    file: str
    line: int
    requests: int
    phases: int
    wavefronts: int
    global_bytes: int = 0
    sectors: int = 0
    min_sectors: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("cp_async", "ldmatrix"):
            raise InvalidInput(f"SiteCounters.kind={self.kind!r}; expected cp_async or ldmatrix")
        if self.wavefronts < self.phases:
            raise InvalidInput(f"SiteCounters: {self.wavefronts} wavefronts < {self.phases} "
                               "phases; a phase takes at least one wavefront")

    @property
    def bank_conflicts(self) -> int:
        """Extra wavefronts: sum over phases of (wavefronts - 1)."""
        return self.wavefronts - self.phases

    @property
    def where(self) -> str:
        return f"{PurePath(self.file).name}:{self.line}"


@dataclass(frozen=True)
class EmulatorCounters:
    """Everything counted in one launch (see the module docstring for the definitions)."""

    cp_async_copies: int
    cp_async_requests: int
    cp_async_bytes: int
    cp_async_fill_bytes: int
    cp_async_sectors: int
    cp_async_min_sectors: int
    cp_async_smem_phases: int
    cp_async_smem_wavefronts: int
    ldmatrix_count: int
    ldmatrix_phases: int
    ldmatrix_wavefronts: int
    mma_count: int
    shfl_count: int
    barrier_count: int
    ldg_bytes: int
    block_mma: tuple[int, ...]  # per block, grid x fastest
    sites: tuple[SiteCounters, ...]
    sites_dropped: int = 0

    def __post_init__(self) -> None:
        if self.cp_async_sectors < self.cp_async_min_sectors:
            raise InvalidInput("EmulatorCounters: fewer sectors than the minimum "
                               f"({self.cp_async_sectors} < {self.cp_async_min_sectors})")
        if sum(self.block_mma) != self.mma_count:
            raise InvalidInput(f"EmulatorCounters: block_mma sums to {sum(self.block_mma)}, "
                               f"expected mma_count={self.mma_count}")

    @property
    def ldmatrix_conflicts(self) -> int:
        """Extra ldmatrix wavefronts (0 when every phase is conflict-free)."""
        return self.ldmatrix_wavefronts - self.ldmatrix_phases

    @property
    def cp_async_smem_conflicts(self) -> int:
        """Extra wavefronts of the cp.async shared-memory writes."""
        return self.cp_async_smem_wavefronts - self.cp_async_smem_phases

    @property
    def sectors_per_request(self) -> float:
        return self.cp_async_sectors / self.cp_async_requests if self.cp_async_requests else 0.0

    @property
    def coalescing_efficiency(self) -> float:
        """Minimum sectors / sectors fetched (1 = perfectly coalesced)."""
        return (self.cp_async_min_sectors / self.cp_async_sectors
                if self.cp_async_sectors else 1.0)

    @property
    def smem_bank_conflict_factor(self) -> float:
        """Shared-memory wavefronts per ideal wavefront over ldmatrix and cp.async writes
        (the cost model's ``TrafficCounters.smem_bank_conflict_factor``; 1 = none)."""
        phases = self.ldmatrix_phases + self.cp_async_smem_phases
        waves = self.ldmatrix_wavefronts + self.cp_async_smem_wavefronts
        return waves / phases if phases else 1.0

    def conflicting_sites(self) -> tuple[SiteCounters, ...]:
        """Call sites with bank conflicts."""
        return tuple(s for s in self.sites if s.bank_conflicts)

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {name: getattr(self, name) for name in native.COUNTER_FIELDS}
        out.update(
            ldmatrix_conflicts=self.ldmatrix_conflicts,
            cp_async_smem_conflicts=self.cp_async_smem_conflicts,
            coalescing_efficiency=self.coalescing_efficiency,
            smem_bank_conflict_factor=self.smem_bank_conflict_factor,
            block_mma=list(self.block_mma),
            sites=[{"where": s.where, "kind": s.kind, "requests": s.requests,
                    "bank_conflicts": s.bank_conflicts, "global_bytes": s.global_bytes,
                    "sectors": s.sectors, "min_sectors": s.min_sectors} for s in self.sites],
        )
        return out


def allocate(blocks: int) -> tuple[native.Counters, ctypes.Array[ctypes.c_ulonglong]]:
    """A zeroed native counter block with room for ``blocks`` per-block figures."""
    per_block = (ctypes.c_ulonglong * max(1, blocks))()
    raw = native.Counters()
    raw.block_mma = ctypes.cast(per_block, ctypes.POINTER(ctypes.c_ulonglong))
    raw.block_mma_len = blocks
    return raw, per_block


def from_native(raw: native.Counters, per_block: ctypes.Array[ctypes.c_ulonglong],
                blocks: int) -> EmulatorCounters:
    """Copy a filled native counter block (its strings too) into an EmulatorCounters."""
    kinds = {native.SITE_CP_ASYNC: "cp_async", native.SITE_LDMATRIX: "ldmatrix"}
    sites = tuple(
        SiteCounters(kinds[s.kind], (s.file or b"?").decode(errors="replace"), int(s.line),
                     int(s.requests), int(s.phases), int(s.wavefronts), int(s.global_bytes),
                     int(s.sectors), int(s.min_sectors))
        for s in raw.sites[: raw.nsites]
    )
    scalars = {name: int(getattr(raw, name)) for name in native.COUNTER_FIELDS}
    return EmulatorCounters(**scalars, block_mma=tuple(int(v) for v in per_block[:blocks]),
                            sites=sites, sites_dropped=int(raw.sites_dropped))
