"""Physical upper bounds of a GPU, for checking stored timings against physics.

A timing that implies more than a device could possibly do is a measurement error or a
lie, and the database refuses it before it is stored (tuning results and imports alike).
The bounds are generous on purpose: a real measurement must never be refused, so each
figure is above what any GPU of the arch can reach:

- dense fp16/bf16 tensor FLOPs per clock per SM with fp32 accumulation (what the kernels
  do): 2048 on A100 (sm_80: 312 TFLOP/s at 108 SMs x 1.41 GHz), 4096 on H100 (sm_90:
  989 TFLOP/s at 132 SMs x 1.83 GHz), about 7700 on B200 (sm_100: 2.25 PFLOP/s at 148 SMs),
  at most 1024 on the GeForce/workstation parts (sm_86, sm_89, sm_120: e.g. L40S 362
  TFLOP/s at 142 SMs x 2.52 GHz). Rounded up to powers of two, times a clock of 3 GHz that
  no data-center or consumer GPU reaches; unknown archs get the largest figure;
- memory bandwidth: 20 TB/s, well above any GPU's HBM (B200: 8 TB/s). The bound applies
  to the bytes a bucket must move at the least: Q and O, or K and V, of the shortest
  sequence the bucket covers, once.

A trial's ``median_ms`` and ``tflops`` come from the tuner: ``median_ms`` is the geometric
mean of its shapes' median times and ``tflops`` the geometric mean of their TFLOP/s, so
``tflops * median_ms`` is the geometric mean of the shapes' FLOPs, which can be no less
than the FLOPs of the smallest call the bucket covers.

This module holds its own table because db imports nothing above codegen
(``flashtune.perf.model.gpus`` has the datasheet figures the cost model uses).
"""

from __future__ import annotations

from flashtune.codegen.spec import MIN_SEQ_BUCKET, DType, Problem

#: Upper bounds of dense tensor FLOPs per clock per SM (see the module doc).
TENSOR_FLOPS_PER_CLK_SM: dict[str, int] = {
    "sm_80": 2048, "sm_87": 2048, "sm_86": 1024, "sm_89": 1024, "sm_120": 1024,
    "sm_90": 4096, "sm_100": 8192,
}
MAX_CLOCK_HZ = 3.0e9
MAX_BYTES_PER_S = 20e12


def peak_flops(arch: str, sm_count: int) -> float:
    """An upper bound of the device's dense fp16/bf16 tensor FLOP/s."""
    per_sm = TENSOR_FLOPS_PER_CLK_SM.get(arch, max(TENSOR_FLOPS_PER_CLK_SM.values()))
    return per_sm * sm_count * MAX_CLOCK_HZ


def shortest_length(seqlen_bucket: int) -> int:
    """The shortest sequence length a bucket covers: (N/2, N], or [1, N] for the first."""
    return 1 if seqlen_bucket <= MIN_SEQ_BUCKET else seqlen_bucket // 2 + 1


def min_flops(problem: Problem, seqlen_bucket: int) -> float:
    """FLOPs of the smallest call in the bucket: one query row against the shortest key
    length, one head, by the convention 4 B Nq Nk H D (halved when causal)."""
    total = 4.0 * shortest_length(seqlen_bucket) * problem.head_dim
    return total / 2 if problem.causal else total


def min_bytes(problem: Problem, seqlen_bucket: int) -> float:
    """Bytes the smallest call in the bucket moves at the least: two (length, head_dim)
    tensors of the longer side (K and V, or Q and O), once."""
    item = 2 if problem.dtype in (DType.FP16, DType.BF16) else 4
    return 2.0 * shortest_length(seqlen_bucket) * problem.head_dim * item


def implausible(problem: Problem, seqlen_bucket: int, median_ms: float,
                tflops: float | None, arch: str, sm_count: int) -> str | None:
    """Why a timing on this device cannot be real, or None when physics allows it."""
    peak = peak_flops(arch, sm_count)
    if tflops is not None and tflops * 1e12 > peak:
        return (f"{tflops:.4g} TFLOP/s exceeds the peak of a {arch} GPU with {sm_count} SMs "
                f"(at most {peak / 1e12:.4g} TFLOP/s)")
    floor_ms = min_bytes(problem, seqlen_bucket) / MAX_BYTES_PER_S * 1e3
    if median_ms < floor_ms:
        return (f"a median of {median_ms:.4g} ms is shorter than moving the bucket's smallest "
                f"input takes at {MAX_BYTES_PER_S / 1e12:g} TB/s ({floor_ms:.4g} ms)")
    if tflops is not None:
        work = tflops * 1e12 * median_ms * 1e-3
        least = min_flops(problem, seqlen_bucket)
        if work < least * (1 - 1e-9):
            return (f"{tflops:.4g} TFLOP/s over {median_ms:.4g} ms is {work:.4g} FLOPs, less "
                    f"than the bucket's smallest call ({least:.4g} FLOPs)")
    return None
