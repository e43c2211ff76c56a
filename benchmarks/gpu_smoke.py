"""The first thing a lent GPU runs: one kernel per family, compiled, launched, checked against
torch and timed against torch's SDPA flash backend, in well under 30 seconds.

    python benchmarks/gpu_smoke.py [--json PATH] [--budget SECONDS]    # on a GPU
    python benchmarks/gpu_smoke.py --dry [--arch sm_90]                 # anywhere

On a GPU, each entry of SMOKE_CASES runs through the public API and prints one line as soon
as it is done (so a later failure or a kill loses nothing): whether the output matched,
flashtune's time and TFLOP/s, the baseline's, their ratio and how long the first call took
(NVRTC compile and module load). The first line names the GPU and the NVRTC and CUDA headers
flashtune found. ``--dry`` needs no GPU: it prints the plan and compiles each case's kernel
for ``--arch`` with ``flashtune compile`` (NVRTC only).

Exit status: 0 when every case passed, 1 when one failed, errored or was not reached within
the budget, 2 when there is no GPU (without --dry).

A kernel family adds its smoke line as one SmokeCase: what it checks, the ``flashtune
compile`` options of its kernel (for --dry) and the function that runs it on the GPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _attention_impls import BASELINE, IMPLS, REL_ERR_TOLERANCE, Timer, reference  # noqa: E402
from _common import Deadline, add_benchmarks_to_path, environment_info, write_json  # noqa: E402
from attention import Result, Shape, measure  # noqa: E402

SEED = 20


@dataclass(frozen=True)
class SmokeOutcome:
    """What one case found: passed or not, its one-line summary, details for the JSON."""

    passed: bool
    summary: str
    details: dict[str, Any] = field(default_factory=dict)


SmokeRun = Callable[[Timer], SmokeOutcome]


@dataclass(frozen=True)
class SmokeCase:
    """One family's smoke line."""

    family: str
    description: str
    compile_args: tuple[str, ...]  # `flashtune compile` options of the kernel it runs
    run: SmokeRun


# --- forward -------------------------------------------------------------------------------

#: FlashAttention's benchmark point (hidden 2048: 16 heads of 128), long enough to time.
FORWARD_SHAPE = Shape("bf16", 128, False, batch=4, seqlen=4096)


def _timing(r: Result) -> str:
    if r.status != "ok" or r.stats is None or r.tflops is None:
        return f"{r.impl} {r.status}" + (f" ({r.note})" if r.note else "")
    return f"{r.impl} {r.stats.median:.3f} ms {r.tflops:.0f} TFLOP/s"


def forward_smoke(timer: Timer, shape: Shape = FORWARD_SHAPE) -> SmokeOutcome:
    """flashtune.attention on ``shape``: its first call timed (compile and load), its output
    checked against torch (a float32 reference of three heads, and SDPA's flash backend over
    the whole output), then timed against SDPA's flash backend."""
    import torch

    import flashtune

    device = torch.device(timer.device)
    dtype = torch.bfloat16 if shape.dtype == "bf16" else torch.float16
    gen = torch.Generator(device=device).manual_seed(SEED)
    size = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
    q, k, v = (torch.randn(size, dtype=dtype, device=device, generator=gen) for _ in range(3))
    t0 = time.perf_counter()
    flashtune.attention(q, k, v, causal=shape.causal)
    timer.sync()
    first_s = time.perf_counter() - t0

    ref = reference(q, k, v, shape.causal)
    flush = timer.flusher()
    ours = measure(IMPLS["flashtune"], shape, q, k, v, ref, timer=timer, flush=flush)
    base = measure(IMPLS[BASELINE], shape, q, k, v, ref, timer=timer, flush=flush)
    vs_sdpa = float("nan")
    if base.status == "ok":
        sdpa = IMPLS[BASELINE].prepare(q, k, v, shape.causal)
        with sdpa.context():
            theirs = sdpa.fn().float()
        mine = flashtune.attention(q, k, v, causal=shape.causal).float()
        vs_sdpa = float((mine - theirs).norm() / theirs.norm())
    passed = ours.status == "ok" and (base.status != "ok" or vs_sdpa <= REL_ERR_TOLERANCE)
    ratio = ""
    if ours.stats is not None and base.stats is not None and ours.status == base.status == "ok":
        ratio = f", {base.stats.median / ours.stats.median:.2f}x {BASELINE}'s speed"
    err = f"{ours.rel_err:.1e}" if ours.rel_err is not None else "n/a"
    summary = (f"{'PASS' if passed else 'FAIL'} error {err} vs float32, {vs_sdpa:.1e} vs "
               f"{BASELINE} (limit {REL_ERR_TOLERANCE:g}); {_timing(ours)} [{ours.config}], "
               f"{_timing(base)}{ratio}; first call {first_s:.2f} s")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return SmokeOutcome(passed, summary, {
        "first_call_s": first_s, "rel_err_vs_sdpa": vs_sdpa,
        "results": [ours.row(gpu), base.row(gpu)]})


def _forward_args(shape: Shape) -> tuple[str, ...]:
    return ("--head-dim", str(shape.head_dim), "--dtype", shape.dtype,
            "--causal" if shape.causal else "--no-causal")


#: Every family's smoke line, the forward first.
SMOKE_CASES: tuple[SmokeCase, ...] = (
    SmokeCase("forward", f"{FORWARD_SHAPE.label()} h{FORWARD_SHAPE.heads}",
              _forward_args(FORWARD_SHAPE), forward_smoke),
)


# --- running --------------------------------------------------------------------------------


def _short(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def run_cases(cases: Sequence[SmokeCase], timer: Timer, deadline: Deadline
              ) -> list[tuple[SmokeCase, SmokeOutcome]]:
    """Run each case (one printed line each) until the deadline; a case that raises fails
    alone."""
    out = []
    for case in cases:
        if deadline.expired():
            outcome = SmokeOutcome(False, "NOT RUN: the smoke budget was spent")
        else:
            t0 = time.perf_counter()
            try:
                outcome = case.run(timer)
            except Exception as exc:  # one family's failure must not hide the others
                outcome = SmokeOutcome(False, f"ERROR {_short(exc)}")
            outcome.details["seconds"] = round(time.perf_counter() - t0, 3)
        print(f"smoke {case.family} {case.description}: {outcome.summary}", flush=True)
        out.append((case, outcome))
    return out


def dry_run(cases: Sequence[SmokeCase], arch: str, python: str = sys.executable) -> int:
    """Print the plan and compile each case's kernel for ``arch`` with `flashtune compile`."""
    status = 0
    for case in cases:
        cmd = [python, "-m", "flashtune.cli", "compile", "--arch", arch, *case.compile_args]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                                  cwd=Path(__file__).resolve().parent.parent,
                                  env={**os.environ, "COLUMNS": "160", "NO_COLOR": "1"})
            ok, tail = proc.returncode == 0, (proc.stdout + proc.stderr).strip()
        except subprocess.TimeoutExpired:
            ok, tail = False, "flashtune compile took over 120 s"
        took = time.perf_counter() - t0
        print(f"smoke {case.family} {case.description}: planned; its kernel "
              f"{'compiled' if ok else 'FAILED to compile'} for {arch} in {took:.1f} s "
              f"(flashtune compile {' '.join(case.compile_args)})", flush=True)
        if not ok or tail:
            print("  " + "\n  ".join(tail.splitlines()[-8:]), flush=True)
        status |= 0 if ok else 1
    return status


def _toolchain_line() -> str:
    try:
        from flashtune.runtime import nvrtc
        from flashtune.runtime.toolchain import find_toolchain

        tc = find_toolchain()
        major, minor = nvrtc.load(tc.nvrtc_path).version
        return f"NVRTC {major}.{minor} {tc.nvrtc_path}, headers {tc.include_dir}"
    except Exception as exc:
        return f"no NVRTC ({_short(exc)})"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="no GPU: plan and compile only")
    p.add_argument("--arch", default="sm_90", help="arch to compile for with --dry")
    p.add_argument("--budget", type=float, default=25.0, metavar="SECONDS",
                   help="stop starting cases after this long (default 25)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = p.parse_args(argv)
    add_benchmarks_to_path()
    deadline = Deadline(args.budget)
    print(f"smoke toolchain: {_toolchain_line()}", flush=True)
    if args.dry:
        return dry_run(SMOKE_CASES, args.arch)

    import torch

    if not torch.cuda.is_available():
        print(f"error: the smoke run needs a CUDA GPU and torch {torch.__version__} sees none; "
              "use --dry to compile only", file=sys.stderr)
        return 2
    major, minor = torch.cuda.get_device_capability()
    print(f"smoke gpu: {torch.cuda.get_device_name()} (sm_{major}{minor}), torch "
          f"{torch.__version__}", flush=True)
    timer = Timer("cuda", warmup=3, repeats=args.repeats)
    outcomes = run_cases(SMOKE_CASES, timer, deadline)
    if args.json is not None:
        write_json(args.json, {
            "env": environment_info(),
            "cases": [{"family": c.family, "description": c.description,
                       "passed": o.passed, "summary": o.summary, **o.details}
                      for c, o in outcomes]})
    return 0 if all(o.passed for _, o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
