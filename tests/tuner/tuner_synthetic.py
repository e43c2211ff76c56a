"""Test fixture: a measurer with deterministic synthetic costs.

It exists only to drive the tuner's search, pruning, failure handling and persistence in
CPU tests. Its "timings" come from a made-up cost model and are never a performance result;
its device is named ``synthetic-test-fixture`` so nothing it writes can be mistaken for a
real GPU's.

Every call is appended to ``log_path`` (one line per call: ``<pid> <phase> <config key>``),
so tests can check across processes which configs were compiled, verified and timed.
"""

from __future__ import annotations

import fcntl
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tuner_testlib import use_tile_space

from flashtune import families
from flashtune.codegen.arch import ArchSpec, get_arch
from flashtune.codegen.spec import KernelConfig, Problem, Shape
from flashtune.db.records import DeviceRecord, TrialStatus
from flashtune.errors import DeviceError
from flashtune.tuner.measure.base import CompileOutcome, ShapeTiming, TimingPlan, VerifyOutcome

DEVICE = DeviceRecord("synthetic-test-fixture", 9, 0, 132, 80 << 30, "0", "0", "0", "0")


def _log(path: str | None, phase: str, config: KernelConfig) -> None:
    if not path:
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(f"{os.getpid()} {phase} {config.key()} {time.time():.6f}\n")


def read_log(path: str) -> list[tuple[int, str, str]]:
    """The calls logged so far: (pid, phase, config key)."""
    return [(pid, phase, key) for pid, phase, key, _ in read_log_times(path)]


def read_log_times(path: str) -> list[tuple[int, str, str, float]]:
    """The calls logged so far: (pid, phase, config key, wall-clock time)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [ln.split() for ln in f if ln.strip()]
    return [(int(p), phase, key, float(t)) for p, phase, key, t in rows]


@dataclass(frozen=True)
class SyntheticCompiler:
    """Picklable compiler: fails or spills for the configured keys."""

    compile_fail: frozenset[str] = frozenset()
    spill: frozenset[str] = frozenset()
    log_path: str | None = None
    delay_s: float = 0.0

    def __call__(self, problem: Problem, config: KernelConfig) -> CompileOutcome:
        _log(self.log_path, "compile", config)
        if self.delay_s:
            time.sleep(self.delay_s)
        key = config.key()
        if key in self.compile_fail:
            return CompileOutcome(TrialStatus.COMPILE_FAILED,
                                  error=f"synthetic compile failure of {key}")
        return CompileOutcome(TrialStatus.OK, registers=128,
                              spill_bytes=96 if key in self.spill else 0, smem_bytes=0)


def efficiency(config: KernelConfig, best: KernelConfig) -> float:
    """A smooth made-up efficiency in (0, 1], peaking at ``best``."""
    d = (math.log2(config.block_m / best.block_m) ** 2
         + math.log2(config.block_n / best.block_n) ** 2
         + math.log2(config.num_warps / best.num_warps) ** 2
         + 0.5 * (config.num_stages - best.num_stages) ** 2)
    return math.exp(-0.3 * d)


@dataclass
class SyntheticMeasurer:
    """Measurer with made-up costs: ``ms = flops / (peak * efficiency)``."""

    best: KernelConfig = KernelConfig(128, 64, 4, 2)
    compile_fail: frozenset[str] = frozenset()
    spill: frozenset[str] = frozenset()
    wrong: frozenset[str] = frozenset()
    launch_fail: frozenset[str] = frozenset()
    #: Relative speed overrides (multiplies efficiency), e.g. to create near-ties.
    speed: dict[str, float] = field(default_factory=dict)
    noise: float = 0.0
    seed: int = 0
    time_delay_s: float = 0.0
    verify_delay_s: float = 0.0
    compile_delay_s: float = 0.0
    #: Hold the first timing until this many processes have started timing (so that several
    #: workers really share the study, however slowly they start).
    min_workers: int = 0
    log_path: str | None = None
    arch_name: str = "sm_90"
    is_timed: bool = True
    peak_tflops: float = 400.0
    _rng: random.Random = field(init=False, repr=False)
    _met: bool = field(init=False, repr=False, default=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @property
    def device(self) -> DeviceRecord:
        return DEVICE

    @property
    def arch(self) -> ArchSpec:
        return get_arch(self.arch_name)

    @property
    def timed(self) -> bool:
        return self.is_timed

    @property
    def compiler(self) -> SyntheticCompiler:
        return SyntheticCompiler(self.compile_fail, self.spill, self.log_path,
                                 self.compile_delay_s)

    def verify(self, problem: Problem, config: KernelConfig, shape: Shape) -> VerifyOutcome:
        _log(self.log_path, "verify", config)
        if self.verify_delay_s:
            time.sleep(self.verify_delay_s)
        key = config.key()
        if key in self.launch_fail:
            raise DeviceError(f"synthetic launch failure of {key}")
        if key in self.wrong:
            return VerifyOutcome(TrialStatus.WRONG_RESULT, max_abs_error=1.0,
                                 error=f"synthetic wrong result of {key}")
        return VerifyOutcome(TrialStatus.OK, max_abs_error=1e-3)

    def _wait_for_workers(self, timeout_s: float = 120.0) -> None:
        if self.min_workers <= 1 or not self.log_path or self._met:
            return
        deadline = time.monotonic() + timeout_s
        while len({pid for pid, phase, _ in read_log(self.log_path)
                   if phase == "time"}) < self.min_workers:
            if time.monotonic() > deadline:
                raise AssertionError(f"fewer than {self.min_workers} workers started in "
                                     f"{timeout_s} s")
            time.sleep(0.05)
        self._met = True

    def ms(self, problem: Problem, config: KernelConfig, shape: Shape) -> float:
        eff = efficiency(config, self.best) * self.speed.get(config.key(), 1.0)
        return families.of(problem).flops(problem, shape) / (self.peak_tflops * 1e12 * eff) * 1e3

    def time(self, problem: Problem, config: KernelConfig, shapes: Sequence[Shape],
             plan: TimingPlan) -> list[ShapeTiming]:
        _log(self.log_path, "time", config)
        self._wait_for_workers()
        if self.time_delay_s:
            time.sleep(self.time_delay_s)
        _log(self.log_path, "time_end", config)
        out = []
        for shape in shapes:
            base = self.ms(problem, config, shape)
            samples = sorted(base * (1 + self._rng.uniform(-self.noise, self.noise))
                             for _ in range(plan.repeats))
            out.append(ShapeTiming(shape, samples[len(samples) // 2], samples[0], samples[-1],
                                   plan.repeats))
        return out


def synthetic_measurer(**kwargs: Any) -> SyntheticMeasurer:
    """Factory for worker subprocesses (JSON-able keyword arguments). The process searches
    the forward family's tile space, as the tests that start it do."""
    use_tile_space()
    for name in ("compile_fail", "spill", "wrong", "launch_fail"):
        if name in kwargs:
            kwargs[name] = frozenset(kwargs[name])
    if "best" in kwargs:
        kwargs["best"] = KernelConfig.from_key(str(kwargs["best"]))
    return SyntheticMeasurer(**kwargs)


def dying_compiler(problem: Problem, config: KernelConfig) -> CompileOutcome:
    """A compile worker killed mid-compile (as the kernel's OOM killer would)."""
    os._exit(9)
