"""Host overhead of a warm flashtune.attention call, with the kernel launch stubbed out.

A backend whose kernels do nothing is registered, one cold call makes the plan, and then
each measurement times many warm calls: the public call (validation, dispatch lookup,
output allocation, argument packing, the stub launch), the same through the
``flashtune::attention_fwd`` operator (the path torch.compile and dispatch modes take), and
the parts on their own. Printed in microseconds per call, median over repeats.

    python benchmarks/host_overhead.py
    python benchmarks/host_overhead.py --device cuda     # on a GPU machine (allocations,
                                                          # current-stream lookup included)

Wall-clock and thread CPU time are both shown: on a busy machine the CPU time is the better
estimate of the overhead itself. ``measure(repeats, calls, device)`` returns the samples
(for benchmarks/host.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_benchmarks_to_path  # noqa: E402

add_benchmarks_to_path()

import torch  # noqa: E402

import flashtune  # noqa: E402
from flashtune.api import forward as fwd  # noqa: E402
from flashtune.api import ops  # noqa: E402
from flashtune.api.validate import check_attention_inputs  # noqa: E402
from flashtune.codegen.abi import ArgType  # noqa: E402
from flashtune.codegen.spec import KernelSource  # noqa: E402
from flashtune.families.fwd import args as fwd_args  # noqa: E402
from flashtune.runtime import plans  # noqa: E402
from flashtune.runtime.backends import register_backend, unregister_backend  # noqa: E402
from flashtune.runtime.backends.base import Backend  # noqa: E402

SHAPE = (2, 1024, 16, 128)  # batch, seqlen, heads, head_dim (the values are never read)


@dataclass
class _NoLaunch:
    source: KernelSource
    calls: int = 0

    def launch(self, grid: tuple[int, int, int], args: Sequence[tuple[ArgType, int | float]],
               *, stream: int = 0) -> None:
        self.calls += 1


@dataclass
class _StubBackend:
    name: str = "stub"
    kernels: list[_NoLaunch] = field(default_factory=list)

    def load(self, source: KernelSource) -> _NoLaunch:
        kernel = _NoLaunch(source)
        self.kernels.append(kernel)
        return kernel


@dataclass(frozen=True)
class Samples:
    """Seconds per call, one sample per repeat: wall clock, and this thread's CPU time (which
    other processes on a busy machine do not inflate)."""

    wall: list[float]
    cpu: list[float]


def _per_call(fn: Callable[[], object], calls: int, repeats: int) -> Samples:
    for _ in range(min(calls, 200)):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn()
        cpu.append((time.thread_time() - c0) / calls)
        wall.append((time.perf_counter() - t0) / calls)
    return Samples(wall, cpu)


def measure(repeats: int = 15, calls: int = 2000, device: str = "cpu"
            ) -> list[tuple[str, Samples]]:
    """(measurement, per-call samples) for each part of a warm call."""
    stub = _StubBackend()
    # a stand-in that launches only (its kernels have no ``bind``)
    register_backend("stub", "cuda" if device.startswith("cuda") else "cpu",
                     lambda: cast(Backend, stub))
    try:
        q, k, v = (torch.zeros(SHAPE, dtype=torch.bfloat16, device=device) for _ in range(3))
        scale = SHAPE[3] ** -0.5
        flashtune.attention(q, k, v, backend="stub")  # cold: makes the plan
        out, lse = fwd.forward(q, k, v, False, scale, "stub")
        plan = fwd.plan_for(q, k, False, "stub")
        parts: list[tuple[str, Callable[[], Any]]] = [
            ("flashtune.attention (warm, launch stubbed)",
             lambda: flashtune.attention(q, k, v, backend="stub")),
            ("  same through the flashtune::attention_fwd op",
             lambda: ops.attention_fwd(q, k, v, False, scale, "stub")),
            ("  validation", lambda: check_attention_inputs(q, k, v)),
            ("  plan lookup (dispatch)", lambda: fwd.plan_for(q, k, False, "stub")),
            ("  output allocation", lambda: fwd.empty_outputs(q)),
            ("  argument packing", lambda: fwd_args.pack_args(q, k, v, out, lse, scale)),
            ("  current stream", plan.stream),
        ]
        return [(name, _per_call(fn, calls, repeats)) for name, fn in parts]
    finally:
        unregister_backend("stub")
        plans.clear_caches()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="tensor device: cpu (default) or cuda")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--calls", type=int, default=2000, help="calls per repeat")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.calls < 1:
        p.error("--repeats and --calls must be >= 1")
    print(f"host overhead per warm call, {SHAPE} bf16 on {args.device}, median of "
          f"{args.repeats} x {args.calls} calls (torch {torch.__version__}); "
          "microseconds per call")
    print(f"{'':<48} {'wall':>8} {'cpu':>8} {'wall min':>9}")
    for name, samples in measure(args.repeats, args.calls, args.device):
        wall = statistics.median(samples.wall) * 1e6
        cpu = statistics.median(samples.cpu) * 1e6
        print(f"{name:<48} {wall:8.2f} {cpu:8.2f} {min(samples.wall) * 1e6:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
