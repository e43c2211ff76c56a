"""Compile every default kernel of every family with the toolchain flashtune finds by itself.

    python benchmarks/toolchain_compat.py [--arch sm_80 --arch sm_90] [--expect-nvrtc 13.0]
                                          [--expect-under DIR]

The proof behind ``benchmarks/nvrtc13_compat.sh``: that script puts a scratch environment
holding only one NVRTC release and its runtime headers in front of ``sys.path`` and runs
this, which checks that ``find_toolchain()`` picked exactly that NVRTC (``--expect-nvrtc``,
``--expect-under``), then compiles every family's default kernels for each arch into a
fresh kernel cache (nothing is served from an earlier compile; the cache is kept when a
kernel fails) and prints one line per (family, arch). Exit status 0 when everything
compiled, 1 when a kernel failed (its NVRTC log and the saved source are printed), 2 when
the toolchain is not the expected one.

The families are those of flashtune's registry (``flashtune.families``): one that lands is
covered with no change here.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from _common import add_benchmarks_to_path

add_benchmarks_to_path()

from flashtune import families  # noqa: E402
from flashtune.codegen.arch import get_arch  # noqa: E402
from flashtune.codegen.spec import COMPILED_HEAD_DIMS, DType, KernelSource, Problem  # noqa: E402
from flashtune.errors import InvalidConfig, InvalidProblem  # noqa: E402
from flashtune.families.base import KernelFamily  # noqa: E402
from flashtune.toolchain import nvrtc  # noqa: E402
from flashtune.toolchain.cache import ArtifactCache  # noqa: E402
from flashtune.toolchain.compiler import CompileResult, compile_pairs  # noqa: E402
from flashtune.toolchain.cuda import Toolchain, find_toolchain  # noqa: E402


def default_sources(family: KernelFamily, arch: str) -> list[KernelSource]:
    """The family's default config of every compiled head dim, element types and mask it
    serves; none for a family built for an arch-specific target that ``arch`` cannot run
    (sm_90a code on sm_80), nor for the problems a family refuses on ``arch`` (FP8 below
    sm_89, FP8 head dims off its k step)."""
    spec = get_arch(arch)
    if family.target_arch is not None and not get_arch(family.target_arch).runs_on(spec):
        return []
    sources = []
    for head_dim in COMPILED_HEAD_DIMS:
        for dtypes in sorted(family.dtypes, key=lambda d: (list(DType).index(d.o), str(d))):
            for causal in (False, True):
                try:
                    problem = Problem(head_dim=head_dim, dtype=dtypes.q, causal=causal,
                                      op=family.op, kv_dtype=dtypes.kv, o_dtype=dtypes.o)
                    family.check_problem(problem)
                    config = family.default_config(problem, spec)
                except (InvalidProblem, InvalidConfig):
                    continue
                sources.append(family.render(problem, config))
    return sources


def check_toolchain(tc: Toolchain, version: tuple[int, int], expect_nvrtc: str | None,
                    expect_under: Path | None) -> list[str]:
    """Why ``tc`` is not the toolchain under test (empty when it is)."""
    problems = []
    found = f"{version[0]}.{version[1]}"
    if expect_nvrtc is not None and found != expect_nvrtc:
        problems.append(f"NVRTC {found} was found, not {expect_nvrtc}")
    if expect_under is not None:
        root = expect_under.resolve()
        for what, path in (("NVRTC", tc.nvrtc_path), ("the CUDA headers", tc.include_dir)):
            if not path.resolve().is_relative_to(root):
                problems.append(f"{what} came from {path}, not from under {root}")
    return problems


def _summary(family: str, arch: str, results: Sequence[CompileResult], seconds: float) -> str:
    ok = [r.kernel for r in results if r.kernel is not None]
    spilling = sum(1 for k in ok if k.resources.spill_stores or k.resources.spill_loads)
    regs = max((k.resources.registers for k in ok), default=0)
    return (f"{family:<8} {arch:<6} {len(ok)}/{len(results)} compiled in {seconds:.1f} s; "
            f"max {regs} registers/thread; {spilling} kernel(s) spill")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", action="append", default=None,
                   help="target arch, repeatable (default: sm_80 and sm_90)")
    p.add_argument("--family", action="append", default=None, metavar="OP",
                   help="kernel family (its op), repeatable (default: every registered one)")
    p.add_argument("--expect-nvrtc", default=None, metavar="MAJOR.MINOR",
                   help="fail unless flashtune finds this NVRTC version")
    p.add_argument("--expect-under", type=Path, default=None, metavar="DIR",
                   help="fail unless NVRTC and the CUDA headers come from under DIR")
    p.add_argument("--workers", type=int, default=None, help="compile processes")
    args = p.parse_args(argv)
    archs = args.arch or ["sm_80", "sm_90"]
    try:
        chosen = ([families.get(op) for op in args.family] if args.family
                  else list(families.all_families()))
    except InvalidProblem as exc:
        p.error(str(exc))

    tc = find_toolchain()
    version = nvrtc.load(tc.nvrtc_path).version
    print(f"toolchain: NVRTC {version[0]}.{version[1]} at {tc.nvrtc_path}")
    print(f"           CUDA headers {tc.include_dir} ({tc.layout})")
    wrong = check_toolchain(tc, version, args.expect_nvrtc, args.expect_under)
    if wrong:
        print("error: not the toolchain under test: " + "; ".join(wrong), file=sys.stderr)
        return 2

    failures: list[CompileResult] = []
    cache_dir = Path(tempfile.mkdtemp(prefix="flashtune-compat-cache-"))
    cache = ArtifactCache(cache_dir)
    for family in chosen:
        for arch in archs:
            sources = default_sources(family, arch)
            t0 = time.perf_counter()
            results = compile_pairs([(s, arch) for s in sources], args.workers, cache=cache,
                                    progress=False)
            print(_summary(family.op, arch, results, time.perf_counter() - t0), flush=True)
            failures.extend(r for r in results if not r.ok)
    for result in failures[:3]:
        assert result.failure is not None
        print(f"\nFAILED {result.source.entry} for {result.arch}: {result.failure.message}\n"
              f"saved source: {result.failure.source_path}\n{result.failure.log}",
              file=sys.stderr)
    if failures:
        print(f"error: {len(failures)} kernel(s) failed to compile; the failing sources are "
              f"kept under {cache_dir}", file=sys.stderr)
        return 1
    shutil.rmtree(cache_dir, ignore_errors=True)
    print("every default kernel compiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
