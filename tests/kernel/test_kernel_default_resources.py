"""Every default config compiles through NVRTC without register spills and within the
arch's shared memory. The default tier compiles each table entry once (fp16, on one arch per
class); ``-m sweep`` covers every arch of each class and both dtypes."""

from __future__ import annotations

import pytest

from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelSource, Problem
from flashtune.families import render
from flashtune.families.fwd import defaults
from flashtune.runtime.compiler import CompileResult, compile_pairs

REPRESENTATIVE = {defaults.ArchClass.SM80: "sm_80", defaults.ArchClass.SM86: "sm_86",
                  defaults.ArchClass.SM90: "sm_90"}


def _jobs(every_arch: bool) -> list[tuple[KernelSource, str]]:
    jobs = []
    for entry in defaults.DEFAULT_TABLE:
        archs = ([a for a, c in defaults.ARCH_CLASS.items() if c is entry.arch_class]
                 if every_arch else [REPRESENTATIVE[entry.arch_class]])
        dtypes = list(DType) if every_arch else [DType.FP16]
        for dtype in dtypes:
            source = render(Problem(entry.head_dim, dtype, causal=entry.causal), entry.config)
            jobs += [(source, arch) for arch in archs]
    return jobs


def _check(results: list[CompileResult]) -> None:
    problems = []
    for r in results:
        where = f"{r.source.entry} on {r.arch}"
        if r.failure is not None:
            problems.append(f"{where}: {r.failure.message}")
            continue
        res = r.unwrap().resources
        if res.spill_bytes:
            problems.append(f"{where}: {res.spill_stores} B spill stores, "
                            f"{res.spill_loads} B spill loads ({res.registers} registers)")
        if res.smem_bytes > get_arch(r.arch).max_smem_per_block:
            problems.append(f"{where}: {res.smem_bytes} B shared memory")
    assert not problems, "default configs must compile without spills:\n" + "\n".join(problems)


def test_default_table_compiles_without_spills() -> None:
    _check(compile_pairs(_jobs(every_arch=False)))


@pytest.mark.sweep
def test_default_table_compiles_without_spills_on_every_arch() -> None:
    _check(compile_pairs(_jobs(every_arch=True)))
