"""The rule that chooses the forward kernel's default configs, as code that can be re-run
(``python docs/default_configs.py --check`` re-derives the table and compares).

For one (arch class, compiled head dim, causal) entry of ``families.fwd.defaults``:

1. Candidates: every tile of the forward space (block_m, block_n, num_warps, num_stages;
   the structure knobs at their defaults) that passes ``static_check`` on every arch of the
   class and whose shared memory and threads leave room for the occupancy floor on each:
   two resident blocks and eight warps per SM (``FLOORS``); only where no tile of the space
   can reach that, eight warps in one block.
2. Shortlist: the cost model ranks the candidates without compiling (its analytic
   instruction counts, estimated registers) and the ``SHORTLIST`` best, with the current
   default, are compiled for the class's reference arch in bf16 and ranked again with
   their SASS and compiled resources (``predict(..., resources=, sass=)``).
3. Filters, on the reference arch, then on every arch of the class in both dtypes: the
   kernel compiles; keeps the spill rule (``perf.sass.loops``: no local access in a tensor-core
   chain, at most ``MAX_LOCAL_ACCESSES`` per iteration of each main loop); keeps the
   occupancy floor with its compiled registers; its unmasked loop is at most
   FlashAttention-2's same-tile count where reference/fa2-sass-facts.md gives one
   (``perf.sass.budget``). When no shortlisted tile passes, the next ``SHORTLIST`` are taken.
4. The default is the passing tile with the best PREDICTED time, unless the current
   default also passes and is predicted within ``KEEP_MARGIN`` of it: a default does not
   change for a predicted difference the model cannot resolve.

The model is asked about one shape per head dim (``rule_shape``): FlashAttention's
standard benchmark point at 4k tokens, batch 4, seqlen 4096, hidden size 2048 (2048 //
head dim heads), on the reference GPU of the class's reference arch (A100, RTX 3090,
H100). Every figure here is a PREDICTION of that model, never a measurement.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

from flashtune.codegen.arch import ArchClass, get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.errors import InvalidConfig, OutOfResources
from flashtune.families import render
from flashtune.families.defaults import archs_of
from flashtune.families.fwd import defaults, space
from flashtune.perf.model.costmodel import predict
from flashtune.perf.model.gpus import GpuSpec, default_gpu_for_arch
from flashtune.perf.model.occupancy import Occupancy, occupancy
from flashtune.perf.sass.budget import fa2_figure
from flashtune.perf.sass.disasm import sass_listing
from flashtune.perf.sass.loops import MAX_LOCAL_ACCESSES, MainLoops, main_loops
from flashtune.perf.sass.parse import SassFunction
from flashtune.toolchain.compiler import CompileResult, compile_pairs

#: Tiles compiled per round of the shortlist (step 2).
SHORTLIST = 12
#: The current default stays when predicted at most this much slower than the best.
KEEP_MARGIN = 0.01
#: The workload the model is asked about (FlashAttention's benchmark point at 4k tokens).
BATCH, SEQLEN, HIDDEN = 4, 4096, 2048
#: The dtype of the ranking compile (the filters check both).
RANK_DTYPE = DType.BF16


@dataclass(frozen=True)
class Floor:
    """Resident blocks and warps per SM a default must keep on every arch of its class."""

    blocks: int
    warps: int

    def shortfall(self, occ: Occupancy) -> str | None:
        """Why ``occ`` is below the floor, or None."""
        if occ.blocks_per_sm < self.blocks or occ.warps_per_sm < self.warps:
            return (f"{blocks_text(occ.blocks_per_sm)} on {occ.arch}, {occ.limiter} the limit "
                    f"(the floor: {self.blocks} blocks, {self.warps} warps)")
        return None


def blocks_text(blocks: int) -> str:
    return f"{blocks} block/SM" if blocks == 1 else f"{blocks} blocks/SM"


#: The occupancy floor in order of preference (step 1).
FLOORS = (Floor(2, 8), Floor(1, 8))


def rule_shape(head_dim: int) -> Shape:
    """The shape the model is asked about for ``head_dim``."""
    return Shape.square(BATCH, max(1, HIDDEN // head_dim), SEQLEN)


def class_gpu(cls: ArchClass) -> GpuSpec:
    """The GPU the model predicts for ``cls``: its reference arch's reference GPU."""
    return default_gpu_for_arch(defaults.REFERENCE_ARCH[cls])


@functools.cache
def _tiles() -> tuple[KernelConfig, ...]:
    return tuple(c for c in space.legal_configs() if not c.extras)


def _static_occupancy(problem: Problem, config: KernelConfig, arch: str) -> Occupancy | None:
    """Occupancy from shared memory and threads alone (registers not yet known)."""
    try:
        return occupancy(arch, threads=config.threads, registers=1,
                         smem_bytes=space.smem_bytes(problem, config))
    except OutOfResources:
        return None


def candidates(cls: ArchClass, head_dim: int, causal: bool
               ) -> tuple[tuple[KernelConfig, ...], Floor]:
    """The candidate tiles of one entry (step 1) and the occupancy floor they keep."""
    problem = Problem(head_dim, RANK_DTYPE, causal=causal)
    archs = [get_arch(a) for a in archs_of(cls)]
    legal = [c for c in _tiles() if all(space.static_check(problem, c, a) is None
                                        for a in archs)]
    for floor in FLOORS:
        fit = []
        for c in legal:
            occs = [_static_occupancy(problem, c, a.name) for a in archs]
            if all(o is not None and floor.shortfall(o) is None for o in occs):
                fit.append(c)
        if fit:
            return tuple(fit), floor
    raise InvalidConfig(f"no tile of the forward space fits {cls.value} d{head_dim} "
                        f"causal={causal} with eight resident warps; the default table "
                        "needs a smaller tile in the space")


def _analytic_ms(problem: Problem, config: KernelConfig, gpu: GpuSpec) -> float:
    """The model's time without compiling; configs it cannot place rank last."""
    try:
        return predict(problem, config, rule_shape(problem.head_dim), gpu).time_ms
    except OutOfResources:
        return float("inf")


@dataclass(frozen=True)
class Build:
    """One compiled (config, arch, dtype) and why it fails the filters (empty: passes)."""

    arch: str
    dtype: DType
    registers: int
    blocks_per_sm: int
    local_accesses: int
    problems: tuple[str, ...]


def spill_rule_problems(loops: MainLoops, arch: str) -> list[str]:
    """How the main loops of a kernel compiled for ``arch`` break the spill rule (step 3: no
    local access in a tensor-core chain, at most ``MAX_LOCAL_ACCESSES`` per iteration of
    each main loop); empty when they keep it."""
    problems = []
    chained = sum(lp.local.in_mma_chain for lp in loops)
    if chained:
        problems.append(f"{chained} local accesses in a tensor-core chain on {arch}")
    local = max((lp.local.accesses for lp in loops), default=0)
    if local > MAX_LOCAL_ACCESSES:
        problems.append(f"{local} local accesses a tile on {arch} (over {MAX_LOCAL_ACCESSES})")
    return problems


def _build(problem: Problem, config: KernelConfig, result: CompileResult, floor: Floor
           ) -> tuple[Build, SassFunction | None]:
    arch = result.arch
    if result.kernel is None:
        why = result.failure.message.splitlines()[0] if result.failure else "failed"
        return Build(arch, problem.dtypes.o, 0, 0, 0, (f"no compile for {arch}: {why}",)), None
    kernel = result.kernel
    res = kernel.resources
    function = sass_listing(kernel.cubin, arch).function(result.source.entry)
    loops = main_loops(function)
    problems = spill_rule_problems(loops, arch)
    local = max((lp.local.accesses for lp in loops), default=0)
    try:
        occ = occupancy(arch, threads=config.threads, registers=res.registers,
                        smem_bytes=res.smem_bytes)
        blocks = occ.blocks_per_sm
        short = floor.shortfall(occ)
        if short is not None:
            problems.append(short)
    except OutOfResources as exc:
        blocks = 0
        problems.append(f"does not fit an SM of {arch}: {exc}")
    fa2 = fa2_figure(problem, config, arch)
    if fa2 is not None and loops.unmasked is not None and (
            loops.unmasked.static > fa2.instructions):
        problems.append(f"unmasked loop {loops.unmasked.static} instructions on {arch}, "
                        f"over FA2's {fa2.instructions}")
    return (Build(arch, problem.dtypes.o, res.registers, blocks, local, tuple(problems)),
            function)


@dataclass(frozen=True)
class Evaluated:
    """A shortlisted config: its PREDICTED time and its builds so far."""

    config: KernelConfig
    predicted_ms: float
    builds: tuple[Build, ...]

    @property
    def problems(self) -> tuple[str, ...]:
        return tuple(p for b in self.builds for p in b.problems)

    @property
    def registers(self) -> int:
        return max(b.registers for b in self.builds)

    @property
    def blocks_per_sm(self) -> int:
        return min(b.blocks_per_sm for b in self.builds)

    @property
    def local_accesses(self) -> int:
        return max(b.local_accesses for b in self.builds)


def _less(better: Evaluated, worse: Evaluated) -> str:
    """'N% less predicted time' of ``better`` against ``worse``."""
    gain = (worse.predicted_ms - better.predicted_ms) / worse.predicted_ms
    return f"{gain:.1%} less predicted time"


@dataclass(frozen=True)
class Choice:
    """The rule's default for one entry and the facts its reason states."""

    arch_class: ArchClass
    head_dim: int
    causal: bool
    chosen: Evaluated
    best: Evaluated
    incumbent: Evaluated | None
    #: shortlisted candidates predicted faster than the chosen that the filters rule out
    passed_over: tuple[Evaluated, ...]
    candidates: int
    floor: Floor

    @property
    def config(self) -> KernelConfig:
        return self.chosen.config

    def reason(self) -> str:
        """The facts behind the choice, as the reason of a table entry starts."""
        c = self.chosen
        gpu = class_gpu(self.arch_class).name
        if c is self.best:
            lead = (f"best predicted of {self.candidates} tiles ({gpu}, 4k)"
                    if self.candidates > 1 else f"the one candidate tile ({gpu}, 4k)")
        else:
            lead = (f"kept: {self.best.config.key()}, the best predicted ({gpu}, 4k), "
                    f"gives only {_less(self.best, c)}")
        local = (f"{c.local_accesses} local accesses a tile" if c.local_accesses
                 else "no local memory in the loop")
        text = f"{lead}; {c.registers} regs, {blocks_text(c.blocks_per_sm)}, {local}"
        if self.passed_over:
            first = self.passed_over[0]
            text += (f"; {first.config.key()} ({_less(first, c)}) is out: "
                     f"{first.problems[0]}")
        return text

    def change(self) -> str:
        """How the choice compares with the current default it replaces ('' when kept)."""
        old = self.incumbent
        if old is None or old.config == self.config:
            return ""
        diff = (self.chosen.predicted_ms - old.predicted_ms) / old.predicted_ms
        text = (f"previous default {old.config.key()}: this tile's predicted time is "
                f"{abs(diff):.1%} {'higher' if diff > 0 else 'lower'}")
        named = self.passed_over and self.passed_over[0].config == old.config
        if old.problems and not named:
            text += f"; {old.config.key()} is out: {old.problems[0]}"
        return text


@dataclass
class _Search:
    """The rule run for one entry, step by step: ``wanted`` names the builds it needs next,
    ``take`` records them."""

    arch_class: ArchClass
    head_dim: int
    causal: bool
    incumbent: KernelConfig | None
    ranked: list[KernelConfig] = field(default_factory=list)
    floor: Floor = FLOORS[0]
    candidate_set: frozenset[KernelConfig] = frozenset()
    taken: int = 0
    ref: dict[KernelConfig, Evaluated] = field(default_factory=dict)
    full: dict[KernelConfig, Evaluated] = field(default_factory=dict)
    queued: list[KernelConfig] = field(default_factory=list)
    result: Choice | None = None

    def __post_init__(self) -> None:
        cands, self.floor = candidates(self.arch_class, self.head_dim, self.causal)
        self.candidate_set = frozenset(cands)
        gpu = class_gpu(self.arch_class)
        problem = self.problem(RANK_DTYPE)
        self.ranked = sorted(cands, key=lambda c: _analytic_ms(problem, c, gpu))
        self.queued = self._next_shortlist()
        if self.incumbent is not None and self.incumbent not in self.queued:
            self.queued.append(self.incumbent)

    def problem(self, dtype: DType) -> Problem:
        return Problem(self.head_dim, dtype, causal=self.causal)

    @property
    def ref_arch(self) -> str:
        return defaults.REFERENCE_ARCH[self.arch_class]

    def _next_shortlist(self) -> list[KernelConfig]:
        batch = self.ranked[self.taken:self.taken + SHORTLIST]
        self.taken += len(batch)
        return batch

    def _all_builds(self) -> list[tuple[str, DType]]:
        return [(a, d) for a in archs_of(self.arch_class) for d in DType]

    def _verify_jobs(self, config: KernelConfig) -> list[tuple[KernelConfig, str, DType]]:
        return [(config, a, d) for a, d in self._all_builds() if (a, d) != (self.ref_arch,
                                                                             RANK_DTYPE)]

    def wanted(self) -> list[tuple[KernelConfig, str, DType]]:
        """The builds to compile next (empty once the choice is made)."""
        while self.result is None:
            if self.queued:
                return [(c, self.ref_arch, RANK_DTYPE) for c in self.queued]
            order = sorted((e for e in self.ref.values() if not e.problems),
                           key=lambda e: e.predicted_ms)
            best = None
            for e in order:  # the best: the first in predicted order that passes everywhere
                if e.config not in self.full:
                    return self._verify_jobs(e.config)
                if not self.full[e.config].problems:
                    best = self.full[e.config]
                    break
            if best is None:
                if self.taken >= len(self.ranked):
                    raise InvalidConfig(f"no candidate of {self.arch_class.value} "
                                        f"d{self.head_dim} causal={self.causal} passes the "
                                        "default filters")
                self.queued = self._next_shortlist()
                continue
            inc = self.ref.get(self.incumbent) if self.incumbent is not None else None
            if (inc is not None and not inc.problems and self._may_keep(inc, best)
                    and inc.config not in self.full):
                return self._verify_jobs(inc.config)
            self.result = self._choice(best)
        return []

    def _may_keep(self, e: Evaluated, best: Evaluated) -> bool:
        """Whether ``e``, the current default, stays instead of ``best``."""
        return (e.config == self.incumbent and e.config in self.candidate_set
                and e.predicted_ms <= best.predicted_ms * (1.0 + KEEP_MARGIN))

    def _choice(self, best: Evaluated) -> Choice:
        inc = self.full.get(self.incumbent) if self.incumbent is not None else None
        chosen = best
        if inc is not None and not inc.problems and self._may_keep(inc, best):
            chosen = inc
        incumbent = inc or (self.ref.get(self.incumbent) if self.incumbent is not None
                            else None)
        # only the shortlist: what else was compiled depends on the current default
        shortlist = set(self.ranked[:self.taken])
        passed = tuple(self.full.get(e.config, e) for e in self.ref.values()
                       if e.config in shortlist and e.predicted_ms < chosen.predicted_ms
                       and (e.problems or self.full.get(e.config, e).problems))
        passed = tuple(sorted(passed, key=lambda e: e.predicted_ms))
        return Choice(self.arch_class, self.head_dim, self.causal, chosen, best, incumbent,
                      passed, len(self.candidate_set), self.floor)

    def take(self, config: KernelConfig, dtype: DType, result: CompileResult) -> None:
        """Record one build that ``wanted`` asked for."""
        problem = self.problem(dtype)
        build, function = _build(problem, config, result, self.floor)
        if (result.arch, problem.dtype) == (self.ref_arch, RANK_DTYPE):
            if config in self.queued:
                self.queued.remove(config)
            ms = float("inf")
            if function is not None and result.kernel is not None and build.blocks_per_sm:
                ms = predict(problem, config, rule_shape(self.head_dim),
                             class_gpu(self.arch_class), resources=result.kernel.resources,
                             sass=function).time_ms
            self.ref[config] = Evaluated(config, ms, (build,))
            return
        known = self.full.get(config, self.ref[config])
        self.full[config] = Evaluated(config, known.predicted_ms, (*known.builds, build))


def derive(entries: Iterable[tuple[ArchClass, int, bool, KernelConfig | None]],
           workers: int | None = None) -> list[Choice]:
    """The rule's choice for each (class, compiled head dim, causal, current default or
    None); the builds of all entries compile together, round by round."""
    searches = [_Search(cls, hd, causal, current) for cls, hd, causal, current in entries]
    while True:
        jobs = [(s, job) for s in searches for job in s.wanted()]
        if not jobs:
            break
        results = compile_pairs([(render(s.problem(d), c), a) for s, (c, a, d) in jobs],
                                workers)
        for (s, (config, _, dtype)), result in zip(jobs, results, strict=True):
            s.take(config, dtype, result)
    return [s.result for s in searches if s.result is not None]
