"""Host compile benchmark: cold NVRTC compile vs cached load of one forward kernel.

    python benchmarks/compile_time.py [--arch sm_90] [--head-dim 128] [--dtype fp16]
                                      [--causal] [--config m128_n64_w4_s2] [--repeats 5]

For each arch it reports, as medians over ``--repeats`` runs:

- cold: compile_source into a fresh, empty cache directory (NVRTC + ptxas + publishing
  the artifact); target under 2 s;
- cached: compile_source with the in-process memo cleared, i.e. compile key, disk read,
  digest check and unpacking; target under 50 ms;
- memo: a repeated call in the same process.

The first lines report the one-off cost of locating the toolchain and loading libnvrtc.
No GPU is needed. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

_T_IMPORT = time.perf_counter()
from flashtune.codegen.arch import get_arch  # noqa: E402  (import time is reported)
from flashtune.codegen.spec import KernelConfig, KernelSource, Problem  # noqa: E402
from flashtune.families import render  # noqa: E402
from flashtune.families.fwd.defaults import default_config  # noqa: E402
from flashtune.toolchain import compiler, nvrtc  # noqa: E402
from flashtune.toolchain.cache import ArtifactCache  # noqa: E402
from flashtune.toolchain.compiled import CompiledKernel  # noqa: E402
from flashtune.toolchain.cuda import find_toolchain  # noqa: E402

_T_IMPORT = time.perf_counter() - _T_IMPORT

COLD_TARGET_S = 2.0
CACHED_TARGET_S = 0.050


def _median_time(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall-clock and median CPU seconds (this process) of ``repeats`` calls.

    NVRTC runs in this process, so the CPU figure stays meaningful on a busy machine.
    """
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def measure(source: KernelSource, arch: str, repeats: int
            ) -> tuple[CompiledKernel, tuple[float, float], float, float]:
    """The kernel, median (wall, CPU) seconds of a cold compile, and median wall seconds
    of a cached load and of a memo hit."""
    root = Path(tempfile.mkdtemp(prefix="flashtune-compile-bench-"))
    try:
        def cold() -> object:
            compiler.clear_memo()
            fresh = ArtifactCache(root / f"cold-{time.perf_counter_ns()}")
            return compiler.compile_source(source, arch, cache=fresh)

        # Cleared first: a kernel already in this process's memo would leave the warm cache
        # empty, and the first "cached" load would be a cold compile.
        compiler.clear_memo()
        warm = ArtifactCache(root / "warm")
        kernel = compiler.compile_source(source, arch, cache=warm)

        def cached() -> object:
            compiler.clear_memo()
            return compiler.compile_source(source, arch, cache=warm)

        t_cold = _median_time(cold, repeats)
        t_cached = _median_time(cached, repeats)[0]
        t_memo = _median_time(lambda: compiler.compile_source(source, arch, cache=warm),
                              max(repeats, 100))[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return kernel, t_cold, t_cached, t_memo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", help="target arch (repeatable; "
                        "default sm_80 and sm_90)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--config", help="config key (default: the arch's default config)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    t0 = time.perf_counter()
    toolchain = find_toolchain()
    lib = nvrtc.load(toolchain.nvrtc_path)
    major, minor = lib.version
    t_toolchain = time.perf_counter() - t0

    console = Console(width=max(Console().width, 100))  # keep the table readable in logs
    console.print(f"NVRTC {major}.{minor} from {toolchain.nvrtc_path} ({toolchain.layout})")
    console.print(f"import flashtune: {_T_IMPORT * 1e3:.0f} ms; locate toolchain + load "
                  f"libnvrtc: {t_toolchain * 1e3:.0f} ms")

    problem = Problem(args.head_dim, args.dtype, causal=args.causal)
    table = Table(title=f"{problem.key()}: compile_source, median of {args.repeats}")
    for column in ("arch", "config", "regs", "cold s", "cold cpu s", "cached ms", "memo us",
                   "targets"):  # cpu: this process's CPU time (robust on a busy machine)
        table.add_column(column, no_wrap=True,
                         justify="left" if column in ("arch", "config") else "right")
    missed = False
    for arch in args.arch or ["sm_80", "sm_90"]:
        spec = get_arch(arch)
        config = (KernelConfig.from_key(args.config) if args.config
                  else default_config(problem, spec))
        source = render(problem, config)
        kernel, (t_cold, cpu_cold), t_cached, t_memo = measure(source, spec.name, args.repeats)
        ok = t_cold < COLD_TARGET_S and t_cached < CACHED_TARGET_S
        missed |= not ok
        table.add_row(spec.name, config.key(), str(kernel.resources.registers),
                      f"{t_cold:.2f}", f"{cpu_cold:.2f}", f"{t_cached * 1e3:.1f}",
                      f"{t_memo * 1e6:.0f}",
                      "[green]met[/]" if ok else "[red]missed[/]")
    console.print(table)
    console.print(f"targets: cold < {COLD_TARGET_S:.0f} s, cached < "
                  f"{CACHED_TARGET_S * 1e3:.0f} ms")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
