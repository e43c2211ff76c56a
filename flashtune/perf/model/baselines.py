"""Published FlashAttention-2 forward figures and the cost model's agreement with them.

FA2 is an mma.sync kernel with the same structure as flashtune's forward kernel, so its
published throughput on its own tile choices is the model's reference point
(reference/attention-baselines.md):

- H100 SXM5, forward, fp16 (FlashAttention-3 paper): TFLOP/s at seqlen 512 .. 16k on the
  standard sweep (hidden 2048, 16k tokens per batch);
- A100: "FA2 forward reaches 50-73% of the A100 peak (312 TFLOP/s)": a band, not a table.

FA2's tiles: D64 128x128 4 warps; D128 128x64 4 warps; D256 128x64 8 warps, with one
shared buffer each for Q, K and V (flashtune's ``num_stages=1`` footprint) and 255
registers per thread. Built with CUDA 13 its D128 tile SPILLS (reference/fa2-sass-facts.md):
176 / 180 bytes per thread on sm_90 and 156 / 156 on sm_80 (non-causal; causal 196 / 216
and 224 / 244), about 12 local-memory accesses per K/V tile (8 LDL, 4 STL), outside its
tensor-core chains; the model charges those 12 (measured on sm_90, assumed on sm_80). Its
D64 and D256 tiles were not measured; they are modelled without spills.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape

#: (batch, seqlen) of the standard sweep: 16k tokens per batch.
SWEEP: tuple[tuple[int, int], ...] = ((32, 512), (16, 1024), (8, 2048), (4, 4096),
                                      (2, 8192), (1, 16384))
HIDDEN = 2048

#: H100 SXM5 FA2 forward fp16 TFLOP/s by (head_dim, causal), at the SWEEP seqlens.
H100_FA2_FWD: dict[tuple[int, bool], tuple[float, ...]] = {
    (64, False): (282, 306, 318, 321, 322, 324),
    (128, False): (309, 350, 362, 368, 370, 370),
    (128, True): (191, 260, 298, 319, 333, 335),
    (256, False): (275, 313, 321, 323, 324, 326),
}
#: FA2 forward on A100: 50% to 73% of 312 TFLOP/s.
A100_FA2_FWD_BAND: tuple[float, float] = (0.50 * 312, 0.73 * 312)
#: H100 SXM5 FA3 forward fp16 TFLOP/s by (head_dim, causal), at the SWEEP seqlens (FA3
#: paper figure, reference/attention-baselines.md; "~630" read as 630). A sanity check of
#: the wgmma path's predictions only: never fitted, never a model input.
H100_FA3_FWD: dict[tuple[int, bool], tuple[float, ...]] = {
    (64, False): (333, 392, 460, 476, 496, 497),
    (128, False): (467, 565, 625, 638, 646, 648),
    (128, True): (292, 423, 521, 579, 602, 616),
    (256, False): (482, 630, 707, 736, 746, 756),
}


@dataclass(frozen=True)
class PublishedFigure:
    """A published forward TFLOP/s for the same GPU, head dim, mask and shape."""

    kernel: str      # "FlashAttention-3" or "FlashAttention-2"
    gpu: str
    tflops: float
    source: str

    def ratio(self, predicted_tflops: float) -> float:
        """predicted / published."""
        return predicted_tflops / self.tflops

    def to_dict(self, predicted_tflops: float | None = None) -> dict[str, object]:
        out: dict[str, object] = {"kernel": self.kernel, "gpu": self.gpu,
                                  "tflops": self.tflops, "source": self.source}
        if predicted_tflops is not None:
            out["predicted_over_published"] = round(self.ratio(predicted_tflops), 3)
        return out


def published_figures(problem: Problem, shape: Shape, gpu: str) -> list[PublishedFigure]:
    """FA3's and FA2's published H100 forward figures for exactly this point of the
    standard sweep (fp16, hidden 2048 = heads x head dim, 16k tokens, self-attention, no
    GQA); empty anywhere else (e.g. ``--batch 4 --heads 16 --seqlen 4096`` at head dim 128
    is a sweep point)."""
    if (gpu != "H100" or problem.dtype is not DType.FP16
            or shape.heads_q * problem.head_dim != HIDDEN or shape.heads_kv != shape.heads_q
            or shape.seqlen_q != shape.seqlen_k
            or (shape.batch, shape.seqlen_q) not in SWEEP):
        return []
    at = SWEEP.index((shape.batch, shape.seqlen_q))
    key = (problem.head_dim, problem.causal)
    source = "FlashAttention-3 paper figure (flashtune/perf/model/baselines.py)"
    out = []
    for kernel, table in (("FlashAttention-3", H100_FA3_FWD),
                          ("FlashAttention-2", H100_FA2_FWD)):
        if key in table:
            out.append(PublishedFigure(kernel, gpu, table[key][at], source))
    return out


@dataclass(frozen=True)
class Fa2Resources:
    """FA2's footprint: 255 registers, Q, K and V tiles in shared memory, and the spills
    measured with CUDA 13 (reference/fa2-sass-facts.md; 0 where not measured)."""

    registers: int
    dynamic_smem: int
    static_smem: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


#: FA2's D128 128x64 spills (stores, loads) in bytes per thread by (arch, causal), CUDA 13.
FA2_D128_SPILLS: dict[tuple[str, bool], tuple[int, int]] = {
    ("sm_90", False): (176, 180), ("sm_90", True): (196, 216),
    ("sm_80", False): (156, 156), ("sm_80", True): (224, 244),
}
#: Local-memory accesses per K/V tile of FA2's D128 128x64 main loop (sm_90, about 8 LDL
#: and 4 STL).
FA2_D128_LOCAL_PER_TILE = 12.0


def fa2_config(head_dim: int) -> KernelConfig:
    """FA2's forward tile choice for a head dim on sm80/sm90 (64, 128 or 256)."""
    tiles = {64: (128, 128, 4), 128: (128, 64, 4), 256: (128, 64, 8)}
    block_m, block_n, warps = tiles[head_dim]
    return KernelConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=1)


def fa2_resources(head_dim: int, arch: str = "sm_90", causal: bool = False) -> Fa2Resources:
    config = fa2_config(head_dim)
    smem = (config.block_m + 2 * config.block_n) * head_dim * 2
    stores, loads = FA2_D128_SPILLS.get((arch, causal), (0, 0)) if head_dim == 128 else (0, 0)
    return Fa2Resources(registers=255, dynamic_smem=smem, spill_stores=stores,
                        spill_loads=loads)


def fa2_local_per_tile(head_dim: int) -> float:
    """Local-memory accesses per K/V tile of FA2's main loop (0 where not measured)."""
    return FA2_D128_LOCAL_PER_TILE if head_dim == 128 else 0.0
