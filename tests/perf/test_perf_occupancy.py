"""Occupancy and waves against values reasoned out from the occupancy calculator's rules,
and against a brute-force packing of blocks onto an SM."""

from __future__ import annotations

import math
import random

import pytest

from flashtune.codegen.arch import ARCHS, get_arch
from flashtune.errors import InvalidConfig, OutOfResources
from flashtune.perf.model.occupancy import occupancy, registers_per_warp, smem_allocated, waves

KIB = 1024


@pytest.mark.parametrize(("arch", "threads", "regs", "smem", "blocks", "limiter"), [
    # 255 regs -> 8192 per warp -> 2 warps per sub-partition -> 8 warps -> 2 blocks of 4.
    ("sm_80", 128, 255, 0, 2, "registers"),
    ("sm_80", 256, 32, 0, 8, "warps"),       # 2048 threads / 256
    ("sm_80", 32, 16, 0, 32, "blocks"),      # 32 blocks per SM at most
    ("sm_86", 128, 32, 0, 12, "warps"),      # 1536 threads / 128
    ("sm_89", 64, 16, 0, 24, "blocks"),      # 24 blocks per SM on sm_89
    # (48 KiB + 1 KiB reserved) per block out of 164 KiB.
    ("sm_80", 128, 32, 48 * KIB, 3, "shared memory"),
    # (100 KiB + 1 KiB) out of 228 KiB.
    ("sm_90", 128, 64, 100 * KIB, 2, "shared memory"),
    # 200 regs -> 6400 per warp -> 2 warps per 16384-register sub-partition -> 8 warps
    # (a per-SM count would allow 10) -> 4 blocks of 2 warps.
    ("sm_80", 64, 200, 0, 4, "registers"),
    # FA2's D128 kernel: 255 registers, 64 KiB of tiles: 2 blocks on A100 and on H100.
    ("sm_80", 128, 255, 64 * KIB, 2, "registers"),
    ("sm_90", 128, 255, 64 * KIB, 2, "registers"),
])
def test_known_occupancy(arch: str, threads: int, regs: int, smem: int, blocks: int,
                         limiter: str) -> None:
    occ = occupancy(arch, threads=threads, registers=regs, smem_bytes=smem)
    assert occ.blocks_per_sm == blocks
    assert occ.limiter == limiter
    assert occ.warps_per_sm == blocks * math.ceil(threads / 32)
    assert occ.ratio == occ.warps_per_sm / get_arch(arch).max_warps_per_sm


def test_allocation_granularity() -> None:
    assert registers_per_warp(255) == 8192
    assert registers_per_warp(33) == 1280   # 1056 rounded up to 5 x 256
    assert registers_per_warp(32) == 1024
    sm80 = get_arch("sm_80")
    assert smem_allocated(0, sm80) == 1024
    assert smem_allocated(1, sm80) == 1152
    assert smem_allocated(48 * KIB, sm80) == 49 * KIB


def _brute_force_blocks(arch: str, threads: int, regs: int, smem: int) -> int:
    """Add blocks to an empty SM one at a time until one more would not fit."""
    spec = get_arch(arch)
    warps = math.ceil(threads / 32)
    reg_warp = math.ceil(regs * 32 / 256) * 256
    smem_block = math.ceil((smem + spec.smem_reserved_per_block) / 128) * 128
    partition = [0, 0, 0, 0]
    n = 0
    while True:
        trial = list(partition)
        for _ in range(warps):  # the next warp goes to the least loaded sub-partition
            trial[trial.index(min(trial))] += reg_warp
        fits = (max(trial) <= spec.regs_per_sm // 4
                and (n + 1) * smem_block <= spec.smem_per_sm
                and (n + 1) * warps * 32 <= spec.max_threads_per_sm
                and (n + 1) * warps <= spec.max_warps_per_sm
                and n + 1 <= spec.max_blocks_per_sm)
        if not fits:
            return n
        partition, n = trial, n + 1


def test_matches_brute_force_packing_on_random_kernels() -> None:
    rng = random.Random()
    checked = 0
    while checked < 300:
        arch = rng.choice(sorted(ARCHS))
        spec = get_arch(arch)
        threads = 32 * rng.randint(1, 32)
        regs = rng.randint(16, 255)
        smem = rng.choice([0, rng.randint(0, spec.max_smem_per_block)])
        expected = _brute_force_blocks(arch, threads, regs, smem)
        if expected == 0:
            with pytest.raises(OutOfResources):
                occupancy(arch, threads=threads, registers=regs, smem_bytes=smem)
        else:
            got = occupancy(arch, threads=threads, registers=regs, smem_bytes=smem)
            assert got.blocks_per_sm == expected, (arch, threads, regs, smem)
        checked += 1


def test_resource_errors_name_the_resource() -> None:
    with pytest.raises(OutOfResources, match="registers of one block"):
        occupancy("sm_80", threads=1024, registers=255, smem_bytes=0)
    with pytest.raises(OutOfResources, match="registers per thread"):
        occupancy("sm_90", threads=128, registers=256, smem_bytes=0)
    with pytest.raises(OutOfResources, match="shared memory per block"):
        occupancy("sm_86", threads=128, registers=32, smem_bytes=100 * KIB)
    with pytest.raises(InvalidConfig, match="threads"):
        occupancy("sm_80", threads=0, registers=32, smem_bytes=0)


def test_waves() -> None:
    full = waves(264, 2, 132)
    assert full.waves == 1.0 and full.full_waves == 1 and full.efficiency == 1.0
    tail = waves(265, 2, 132)
    assert tail.full_waves == 2
    assert tail.efficiency == pytest.approx(265 / 264 / 2)
    small = waves(10, 1, 108)
    assert small.full_waves == 1 and small.waves == pytest.approx(10 / 108)
    with pytest.raises(InvalidConfig):
        waves(0, 1, 108)
