"""Every default config compiles through NVRTC within the arch's shared memory, and spills
registers only as the project's spill rule allows: no local-memory access in a tensor-core
chain (an MMA reading a register just loaded from local memory, or one storing what an MMA
wrote) and at most perf.sass.loops.MAX_LOCAL_ACCESSES (8) local accesses per iteration of each
main loop. The default tier compiles a seeded two entries of each arch class and causal mode
once each (fp16, on one arch per class; FLASHTUNE_TEST_SEED picks them); ``-m sweep``
compiles every entry on every arch of its class in both dtypes."""

from __future__ import annotations

import os
import random

import pytest

from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelSource, Problem
from flashtune.families import render
from flashtune.families.defaults import archs_of
from flashtune.families.fwd import defaults
from flashtune.perf.model.default_rule import spill_rule_problems
from flashtune.perf.sass.disasm import sass_listing
from flashtune.perf.sass.loops import main_loops
from flashtune.toolchain.compiler import CompileResult, compile_pairs

#: Entries of each (arch class, causal) the default tier compiles.
PER_KIND = 2


def _jobs(every_arch: bool) -> list[tuple[KernelSource, str]]:
    jobs = []
    table = list(defaults.DEFAULT_TABLE)
    if not every_arch:  # a seeded PER_KIND of each (arch class, causal)
        rng = random.Random(int(os.environ["FLASHTUNE_TEST_SEED"]))
        kinds = sorted({(e.arch_class.value, e.causal) for e in table})
        table = [e for kind in kinds for e in rng.sample(
            [e for e in table if (e.arch_class.value, e.causal) == kind], PER_KIND)]
    for entry in table:
        archs = (archs_of(entry.arch_class) if every_arch
                 else [defaults.REFERENCE_ARCH[entry.arch_class]])
        dtypes = list(DType) if every_arch else [DType.FP16]
        for dtype in dtypes:
            source = render(Problem(entry.head_dim, dtype, causal=entry.causal), entry.config)
            jobs += [(source, arch) for arch in archs]
    return jobs


def _spill_problems(r: CompileResult) -> list[str]:
    """Why the spills of one compiled kernel break the rule (empty when they do not)."""
    kernel = r.unwrap()
    function = sass_listing(kernel.cubin, r.arch).function(r.source.entry)
    return spill_rule_problems(main_loops(function), r.arch)


def _check(results: list[CompileResult]) -> None:
    problems = []
    for r in results:
        where = f"{r.source.entry} on {r.arch}"
        if r.failure is not None:
            problems.append(f"{where}: {r.failure.message}")
            continue
        res = r.unwrap().resources
        if res.spill_bytes:
            problems += [f"{where} ({res.spill_stores} B spill stores, {res.spill_loads} B "
                         f"spill loads, {res.registers} registers): {why}"
                         for why in _spill_problems(r)]
        if res.smem_bytes > get_arch(r.arch).max_smem_per_block:
            problems.append(f"{where}: {res.smem_bytes} B shared memory")
    assert not problems, "default configs break the spill rule:\n" + "\n".join(problems)


def test_default_table_spills_only_outside_tensor_core_chains() -> None:
    _check(compile_pairs(_jobs(every_arch=False)))


@pytest.mark.sweep
def test_default_table_spills_only_outside_tensor_core_chains_on_every_arch() -> None:
    _check(compile_pairs(_jobs(every_arch=True)))
