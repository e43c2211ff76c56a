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

A bucket is not timed on its smallest call but on its tuning workload
(``tuner.measure.workload``, and a family's own ``tuning_shapes``): shapes of
round(3N/4) and N rows, at one batch and one head at the least (``--batch-heads 1x1``).
``tuned_flops`` is the least FLOPs of such a shape by the op's own convention (``_OPS``:
the families' ``flops``), so no timing can be shorter than doing that work at the peak
(``implausible``'s compute floor), whatever TFLOP/s the trial claims, or none. An op not
in the table gets no compute floor (only the bounds of the smallest call).

The bound per SM and clock is the arch table's (``ArchSpec.tensor_flops_per_clk_sm``); the
table of ops is this module's own because db imports nothing above codegen.
"""

from __future__ import annotations

from flashtune.codegen.arch import ARCHS
from flashtune.codegen.spec import MIN_SEQ_BUCKET, Problem

MAX_CLOCK_HZ = 3.0e9
MAX_BYTES_PER_S = 20e12

#: How each op's bucket is tuned and counted (its family's ``flops``): ``("attention", m)``
#: square shapes, m products of (Nq x D) by (D x Nk), halved when causal; ``("query_row",
#: 4)`` one query row per sequence over the cache, 4 Nk D; ``("rows", 2)`` row-wise, 2 N D.
_OPS: dict[str, tuple[str, int]] = {
    "fwd": ("attention", 2), "fwd90a": ("attention", 2), "fwd90aws": ("attention", 2),
    "fwd8": ("attention", 2), "fwd890a": ("attention", 2),
    "lse": ("attention", 1), "bwd": ("attention", 5),
    "bwddet": ("attention", 5), "bwd90a": ("attention", 5), "bwd90adet": ("attention", 5),
    "bwd8": ("attention", 5), "bwd8det": ("attention", 5),
    "decode": ("query_row", 4), "decode8": ("query_row", 4), "combine": ("rows", 2),
    "bwdpre": ("rows", 2), "bwdsum": ("rows", 2),
    # MLA's head dim is its RoPE width: 4 Nk D is far below its 2 Nk (1088) of one query row.
    "mla": ("query_row", 4),
}


def peak_flops(arch: str, sm_count: int) -> float:
    """An upper bound of the device's dense fp16/bf16 tensor FLOP/s."""
    spec = ARCHS.get(arch)
    per_sm = (spec.tensor_flops_per_clk_sm if spec is not None
              else max(s.tensor_flops_per_clk_sm for s in ARCHS.values()))
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
    dtypes = problem.dtypes  # the narrowest operand type bounds either pair from below
    item = min(dtypes.q.itemsize, dtypes.kv.itemsize, dtypes.o.itemsize)
    return 2.0 * shortest_length(seqlen_bucket) * problem.head_dim * item


def tuned_length(seqlen_bucket: int) -> int:
    """The shortest sequence a bucket is timed on: its tuning workload's 3/4 of N."""
    return max(1, (3 * seqlen_bucket) // 4)


def tuned_flops(problem: Problem, seqlen_bucket: int) -> float | None:
    """The least FLOPs of a shape the bucket is timed on (one batch, one head, the tuned
    length), by the op's convention; None for an op this module does not know."""
    kind, factor = _OPS.get(problem.op, ("", 0))
    length, d = tuned_length(seqlen_bucket), problem.head_dim
    if kind == "attention":
        total = 2.0 * factor * length * length * d
    elif kind == "query_row":
        total = float(factor * length * d)
    elif kind == "rows":
        return float(factor * length * d)
    else:
        return None
    return total / 2 if problem.causal else total


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
    tuned = tuned_flops(problem, seqlen_bucket)
    if tuned is not None and median_ms < tuned / peak * 1e3 * (1 - 1e-9):
        return (f"a median of {median_ms:.4g} ms is shorter than the bucket's tuning workload "
                f"takes at the peak of a {arch} GPU with {sm_count} SMs (at least {tuned:.4g} "
                f"FLOPs: {tuned / peak * 1e3:.4g} ms)")
    if tflops is not None:
        work = tflops * 1e12 * median_ms * 1e-3
        least = min_flops(problem, seqlen_bucket)
        if work < least * (1 - 1e-9):
            return (f"{tflops:.4g} TFLOP/s over {median_ms:.4g} ms is {work:.4g} FLOPs, less "
                    f"than the bucket's smallest call ({least:.4g} FLOPs)")
    return None
