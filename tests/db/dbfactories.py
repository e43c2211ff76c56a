"""Builders of realistic records for the database tests (real Problem/KernelConfig keys)."""

from __future__ import annotations

import hashlib
import random
from datetime import datetime, timedelta, timezone

from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.db import DeviceRecord, Keyed, TrialRecord, TrialStatus
from flashtune.families import render

GIB = 1 << 30
H100 = DeviceRecord("NVIDIA H100 80GB HBM3", 9, 0, 132, 80 * GIB, "580.65.06", "13.0",
                    "13.0.48", "13.6.0")
H200 = DeviceRecord("NVIDIA H200", 9, 0, 132, 141 * GIB, "580.65.06", "13.0", "13.0.48",
                    "13.6.0")
A100 = DeviceRecord("NVIDIA A100-SXM4-80GB", 8, 0, 108, 80 * GIB, "570.86.10", "12.8",
                    "12.8.61", "13.4.1")
L40 = DeviceRecord("NVIDIA L40S", 8, 9, 142, 48 * GIB, "570.86.10", "12.8", "12.8.61",
                   "13.4.1")
DEVICES = (H100, H200, A100, L40)

PROBLEMS = (Problem(128, DType.BF16, causal=True), Problem(64, DType.FP16, causal=False))
CONFIGS = tuple(KernelConfig.from_key(k) for k in (
    "m64_n32_w4_s1", "m64_n64_w4_s2", "m128_n64_w4_s2", "m128_n32_w8_s2", "m128_n128_w8_s3",
    "m64_n128_w2_s2"))
SEQLENS = (256, 1024, 4096, 16384)
FAILURES = (TrialStatus.INVALID, TrialStatus.COMPILE_FAILED, TrialStatus.RUNTIME_FAILED,
            TrialStatus.WRONG_RESULT)
BASE_TIME = datetime(2026, 1, 1, tzinfo=timezone.utc)


#: The template version whose digests are the installed kernel sources' (served results).
CURRENT = "v1"


def digest(problem: Problem, config: KernelConfig, template: str = CURRENT) -> str:
    """KernelSource.digest for ``CURRENT`` (what this flashtune renders), else a stand-in
    digest of another template version: one per (version, problem, config)."""
    if template == CURRENT:
        return render(problem, config).digest
    return hashlib.sha256(f"{template}:{problem.key()}:{config.key()}".encode()).hexdigest()


def trial(device: DeviceRecord, problem: Problem, seqlen: int, config: KernelConfig, *,
          status: TrialStatus = TrialStatus.OK, median_ms: float | None = None,
          rng: random.Random | None = None, template: str = CURRENT,
          minutes: int = 0, **extra: object) -> TrialRecord:
    """A trial; an ok trial without ``median_ms`` gets a random time from ``rng``."""
    rng = rng or random.Random()
    timing: dict[str, object] = {}
    if status is TrialStatus.OK:
        # 0.2 ms and up: above every factory device's compute floor for its buckets'
        # tuning workloads (physics.tuned_flops at the peak; L40S at n16384 needs 0.09 ms)
        median = median_ms if median_ms is not None else rng.uniform(0.2, 20.0)
        timing = {"median_ms": median, "min_ms": median * rng.uniform(0.9, 1.0),
                  "max_ms": median * rng.uniform(1.0, 1.2), "count": rng.randint(5, 100),
                  "tflops": rng.uniform(10, 300)}  # below every test device's peak
    elif status in (TrialStatus.COMPILE_FAILED, TrialStatus.RUNTIME_FAILED):
        timing = {"error": f"error: {status.value} at line {rng.randint(1, 999)}\n  detail"}
    values: dict[str, object] = {
        "device": device.name, "problem": Keyed.of(problem), "seqlen": seqlen,
        "config": Keyed.of(config), "status": status,
        "template_digest": digest(problem, config, template),
        "created_at": BASE_TIME + timedelta(minutes=minutes, microseconds=rng.randrange(10**6)),
        "study": f"{device.arch}/{problem.key()}", "host": "gpu-node-01",
        **timing, **extra,
    }
    return TrialRecord(**values)  # type: ignore[arg-type]


def random_trials(rng: random.Random, n: int, devices: tuple[DeviceRecord, ...] = DEVICES,
                  template: str = CURRENT) -> list[TrialRecord]:
    """``n`` trials over random buckets and configs, about a third of them failures."""
    result = []
    for i in range(n):
        status = TrialStatus.OK if rng.random() < 0.6 else rng.choice(
            (*FAILURES, TrialStatus.VERIFIED_UNTIMED))
        result.append(trial(rng.choice(devices), rng.choice(PROBLEMS), rng.choice(SEQLENS),
                            rng.choice(CONFIGS), status=status, rng=rng, template=template,
                            minutes=i))
    return result


def expected_best(trials: list[TrialRecord]) -> dict[tuple[str, str, int], str]:
    """Independent reference: per bucket, the uid of the fastest ok trial (first on ties)."""
    best: dict[tuple[str, str, int], TrialRecord] = {}
    for t in trials:
        if t.status is not TrialStatus.OK or t.median_ms is None:
            continue
        key = (t.device, t.problem.key, t.seqlen)
        old = best.get(key)
        if old is None or t.median_ms < (old.median_ms or 0.0):
            best[key] = t
    return {key: t.uid for key, t in best.items()}
