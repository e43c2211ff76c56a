"""Datasheet facts of the GPUs the cost model knows, and per-arch instruction throughputs.

Every figure is a public number (vendor datasheet, architecture whitepaper or the CUDA C
Programming Guide) except where a field says it is an estimate. The cost model never
reads a GPU's name: only the fields here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flashtune.codegen.arch import (
    ARCHS,
    SUBPARTITIONS_PER_SM,
    ArchSpec,
    ArchThroughput,
    get_arch,
)
from flashtune.errors import InvalidConfig

#: FLOPs of one mma.sync m16n8k16 warp instruction (16 * 8 * 16 multiply-adds).
MMA_M16N8K16_FLOPS = 2 * 16 * 8 * 16
@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: what the cost model needs to turn instruction counts into time.

    ``tensor_tflops`` is the datasheet's dense FP16/BF16 tensor rate with FP32 accumulate
    (the kernels accumulate in FP32), at ``clock_mhz``. ``mma_sync_fraction`` is the share of
    that rate the warp-level ``mma.sync`` instruction (what flashtune emits) can reach.
    """

    name: str
    full_name: str
    arch: str
    sm_count: int
    clock_mhz: float
    tensor_tflops: float
    mma_sync_fraction: float
    hbm_gbps: float
    l2_bytes: int
    l2_gbps: float
    l2_gbps_is_estimate: bool
    source: str
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if get_arch(self.arch).throughput is None:
            modelled = sorted(name for name, spec in ARCHS.items() if spec.throughput)
            raise InvalidConfig(f"GPU {self.name}: no instruction throughput table for "
                                f"{self.arch}; expected one of {modelled}")
        for name in ("sm_count", "clock_mhz", "tensor_tflops", "hbm_gbps", "l2_bytes",
                     "l2_gbps"):
            if getattr(self, name) <= 0:
                raise InvalidConfig(f"GPU {self.name}: {name} must be positive")
        if not 0 < self.mma_sync_fraction <= 1:
            raise InvalidConfig(f"GPU {self.name}: mma_sync_fraction must be in (0, 1]")

    @property
    def arch_spec(self) -> ArchSpec:
        return get_arch(self.arch)

    @property
    def throughput(self) -> ArchThroughput:
        throughput = self.arch_spec.throughput
        assert throughput is not None  # checked on construction
        return throughput

    @property
    def clock_hz(self) -> float:
        return self.clock_mhz * 1e6

    @property
    def tensor_flops_per_clk_sm(self) -> float:
        """Datasheet dense tensor FLOPs per clock per SM (e.g. 2048 on A100, 4096 on H100)."""
        return self.tensor_tflops * 1e12 / (self.sm_count * self.clock_hz)

    @property
    def mma_sync_cycles(self) -> float:
        """Cycles one m16n8k16 mma.sync keeps a sub-partition's tensor core busy."""
        per_subpartition = (self.tensor_flops_per_clk_sm * self.mma_sync_fraction
                            / SUBPARTITIONS_PER_SM)
        return MMA_M16N8K16_FLOPS / per_subpartition

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name, "full_name": self.full_name, "arch": self.arch,
            "sm_count": self.sm_count, "clock_mhz": self.clock_mhz,
            "tensor_tflops": self.tensor_tflops, "mma_sync_fraction": self.mma_sync_fraction,
            "hbm_gbps": self.hbm_gbps, "l2_bytes": self.l2_bytes, "l2_gbps": self.l2_gbps,
            "l2_gbps_is_estimate": self.l2_gbps_is_estimate, "source": self.source,
        }


_MB = 1024 * 1024

# Hopper's mma.sync ceiling: the H100 tensor core reaches its datasheet rate only through
# the asynchronous warpgroup instruction wgmma; HazyResearch ("GPUs Go Brrr", 2024-05-12)
# report that without wgmma an H100 tops out at about 63% of its tensor-core peak, and the
# FlashAttention-3 paper (Shah et al., 2024) puts FlashAttention-2 (an mma.sync kernel) at
# about 35% of the H100 peak. On Ampere and Ada mma.sync is the native tensor instruction
# and its datasheet rate is the mma.sync rate.
HOPPER_MMA_SYNC_FRACTION = 0.63

GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        # A100 datasheet: 108 SMs, 1410 MHz boost, 312 TFLOP/s dense FP16 (= 2048 FLOP/clk/SM),
        # 2039 GB/s HBM2e (80 GB SXM4), 40 MB L2. A100 whitepaper: L2 read bandwidth
        # 5120 bytes/clk (x 1.41 GHz = 7.2 TB/s).
        GpuSpec("A100", "NVIDIA A100 SXM4 80GB", "sm_80", 108, 1410.0, 312.0, 1.0,
                2039.0, 40 * _MB, 7220.0, False,
                "NVIDIA A100 datasheet and A100 (Ampere GA100) whitepaper",
                ("a100-sxm4-80gb", "a100-80gb", "a100-sxm")),
        # H100 SXM5 datasheet: 132 SMs, 989.4 TFLOP/s dense FP16 (1979 with sparsity),
        # 3.35 TB/s HBM3, 50 MB L2; 989.4 TFLOP/s = 132 SMs x 4096 FLOP/clk x 1830 MHz.
        # L2 bandwidth about 12 TB/s (HazyResearch, "GPUs Go Brrr").
        GpuSpec("H100", "NVIDIA H100 SXM5 80GB", "sm_90", 132, 1830.0, 989.4,
                HOPPER_MMA_SYNC_FRACTION, 3350.0, 50 * _MB, 12000.0, False,
                "NVIDIA H100 datasheet, Hopper whitepaper; HazyResearch 'GPUs Go Brrr'",
                ("h100-sxm5-80gb", "h100-sxm", "h100-80gb")),
        # H200 SXM datasheet: H100's arithmetic (989 TFLOP/s dense FP16) with 4.8 TB/s HBM3e.
        GpuSpec("H200", "NVIDIA H200 SXM 141GB", "sm_90", 132, 1830.0, 989.4,
                HOPPER_MMA_SYNC_FRACTION, 4800.0, 50 * _MB, 12000.0, False,
                "NVIDIA H200 datasheet", ("h200-sxm", "h200-141gb")),
        # L40S datasheet: 142 SMs, 2520 MHz boost, 362.05 TFLOP/s dense FP16 tensor (733
        # with sparsity; the datasheet does not name the accumulator, taken here as FP32),
        # 864 GB/s GDDR6, 96 MB L2. No public L2 bandwidth: estimated at 5 TB/s.
        GpuSpec("L40S", "NVIDIA L40S 48GB", "sm_89", 142, 2520.0, 362.05, 1.0,
                864.0, 96 * _MB, 5000.0, True, "NVIDIA L40S datasheet", ("l40s-48gb",)),
        # Ada whitepaper (RTX 4090): 128 SMs, 2520 MHz boost, 165.2 TFLOP/s FP16 tensor with
        # FP32 accumulate (330.4 with FP16 accumulate), 1008 GB/s GDDR6X, 72 MB L2. No
        # public L2 bandwidth: estimated at 5 TB/s.
        GpuSpec("RTX4090", "NVIDIA GeForce RTX 4090", "sm_89", 128, 2520.0, 165.2, 1.0,
                1008.0, 72 * _MB, 5000.0, True, "NVIDIA Ada Lovelace whitepaper",
                ("rtx-4090", "4090", "geforce-rtx-4090")),
        # GA102 whitepaper (RTX 3090): 82 SMs, 1695 MHz boost, 71 TFLOP/s FP16 tensor with
        # FP32 accumulate (142 with FP16 accumulate), 936 GB/s GDDR6X, 6 MB L2. No public L2
        # bandwidth: estimated at 2.5 TB/s.
        GpuSpec("RTX3090", "NVIDIA GeForce RTX 3090", "sm_86", 82, 1695.0, 71.0, 1.0,
                936.0, 6 * _MB, 2500.0, True, "NVIDIA Ampere GA102 whitepaper",
                ("rtx-3090", "3090", "geforce-rtx-3090")),
    )
}


def _norm(text: str) -> str:
    return re.sub(r"[\s_]+", "-", text.strip().lower())


def get_gpu(name: str) -> GpuSpec:
    """Look up a GPU by name or alias, case-insensitively ('H100', 'rtx-4090', 'A100')."""
    wanted = _norm(name)
    for gpu in GPUS.values():
        if wanted == _norm(gpu.name) or wanted in {_norm(a) for a in gpu.aliases}:
            return gpu
    raise InvalidConfig(f"GPU {name!r} is not in the cost model's table; expected one of "
                        f"{sorted(GPUS)} (add a GpuSpec from the GPU's datasheet)")


def default_gpu_for_arch(arch: str) -> GpuSpec:
    """The table's reference GPU of an arch (sm_80: A100, sm_86: RTX3090, sm_89: L40S,
    sm_90 and its arch-specific sm_90a: H100)."""
    name = get_arch(arch).name
    preferred = {"sm_80": "A100", "sm_86": "RTX3090", "sm_89": "L40S", "sm_90": "H100",
                 "sm_90a": "H100"}
    if name not in preferred:
        raise InvalidConfig(f"no reference GPU for {name}; pass a GPU explicitly, one of "
                            f"{sorted(GPUS)}")
    return GPUS[preferred[name]]
