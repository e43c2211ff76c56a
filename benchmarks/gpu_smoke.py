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

Kernel families: the forward's line goes through ``flashtune.attention`` and is timed
against SDPA; every other family registered in ``flashtune.families`` gets a line of its own
(its default kernel verified against its float64 reference through the launch seam, and
timed), so a family that lands is covered without a change here. A family that needs more
(a baseline, another problem) replaces its entry in SMOKE_CASES.
"""

from __future__ import annotations

import argparse
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
    checked (the benchmarks' float64 reference of three heads, and SDPA's flash backend over
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
    summary = (f"{'PASS' if passed else 'FAIL'} error {err} vs float64, {vs_sdpa:.1e} vs "
               f"{BASELINE} (limit {REL_ERR_TOLERANCE:g}); {_timing(ours)} [{ours.config}], "
               f"{_timing(base)}{ratio}; first call {first_s:.2f} s")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return SmokeOutcome(passed, summary, {
        "first_call_s": first_s, "rel_err_vs_sdpa": vs_sdpa,
        "results": [ours.row(gpu), base.row(gpu)]})


def _forward_args(shape: Shape) -> tuple[str, ...]:
    return ("--op", "fwd", "--head-dim", str(shape.head_dim), "--dtype", shape.dtype,
            "--causal" if shape.causal else "--no-causal")


# --- any other family, through the launch seam -------------------------------------------

#: The problem size of the other families' smoke lines (small: their float64 reference runs
#: on the GPU too): batch 1, 8 heads, 1024 queries and keys, head dim 128, bf16, no mask.
FAMILY_SHAPE = (1, 8, 1024, 128)


def family_head_dim(op: str) -> int:
    """FAMILY_SHAPE's head dim, or the first compiled head dim family ``op`` takes when it
    refuses that one (MLA's is its 64 RoPE dims)."""
    import typer

    from flashtune import families
    from flashtune.codegen.spec import COMPILED_HEAD_DIMS, DType
    from flashtune.commands.codegen import parse_problem
    from flashtune.errors import InvalidProblem

    for head_dim in (FAMILY_SHAPE[3], *COMPILED_HEAD_DIMS):
        try:
            families.get(op).check_problem(parse_problem(op, head_dim, DType.BF16, False))
        except (InvalidProblem, typer.BadParameter):
            continue
        return head_dim
    raise ValueError(f"the {op!r} family takes none of the compiled head dims")


def family_smoke(op: str, size: tuple[int, int, int, int] = FAMILY_SHAPE,
                 backend: str = "cuda") -> SmokeRun:
    """The smoke run of family ``op`` on (batch, heads, seqlen, head dim) ``size``: its
    default kernel for this GPU compiled and loaded (timed), launched once on NaN-poisoned
    outputs and compared with the family's float64 reference, then timed (no baseline).
    ``backend="emulator"`` with a CPU timer runs the same steps on the CPU (tests)."""

    def run(timer: Timer) -> SmokeOutcome:
        import torch

        from flashtune import families
        from flashtune.codegen.arch import get_arch
        from flashtune.codegen.spec import DType
        from flashtune.codegen.spec import Shape as LaunchShape
        from flashtune.commands.codegen import parse_problem
        from flashtune.runtime import launch
        from flashtune.runtime.backends import get_backend
        from flashtune.runtime.device import DeviceInfo

        batch, heads, seqlen, head_dim = size
        family = families.get(op)
        problem = parse_problem(op, head_dim, DType.BF16, False)  # FP8: bf16 is O's type
        # The family's own first tuning shape where it has them (decoding, MLA: one query
        # row over a cache, MLA's one latent head), else the square shape.
        own = family.tuning_shapes(problem, seqlen, [(batch, heads)])
        shape = own[0][0] if own else LaunchShape(batch, heads, heads, seqlen, seqlen)
        on_gpu = timer.device == "cuda"
        arch = DeviceInfo.current().spec if on_gpu else get_arch("sm_90")
        if family.target_arch is not None and not get_arch(family.target_arch).runs_on(arch):
            return SmokeOutcome(True, f"SKIP: built for {family.target_arch}, which "
                                f"{arch.name} does not run", {})
        config = family.default_config(problem, arch)
        t0 = time.perf_counter()
        kernel = get_backend(backend).load(family.render(problem, config))
        first_s = time.perf_counter() - t0
        stream = torch.cuda.current_stream().cuda_stream if on_gpu else 0
        prepared = launch.prepare(kernel, shape, timer.device, seed=SEED, poison=True,
                                  stream=stream)
        prepared.run()
        timer.sync()
        verdict = prepared.verdict()
        times = timer.time(prepared.run, timer.flusher())
        median = sorted(times)[len(times) // 2]
        tflops = family.flops(problem, shape) / (median * 1e-3) / 1e12
        summary = (f"{'PASS' if verdict.ok else 'FAIL'} error {verdict.rel_frobenius:.1e} "
                   f"vs float64{'' if verdict.ok else f' ({verdict.message})'}; "
                   f"{median:.3f} ms {tflops:.1f} TFLOP/s [{config.key()}]; "
                   f"compile and load {first_s:.2f} s")
        return SmokeOutcome(verdict.ok, summary, {
            "first_call_s": first_s, "rel_err": verdict.rel_frobenius, "max_abs":
            verdict.max_abs, "median_ms": median, "tflops": tflops, "config": config.key()})

    return run


def _smoke_cases() -> tuple[SmokeCase, ...]:
    """The forward first (through flashtune.attention, against SDPA), then every other
    registered family through the launch seam: a family that lands gets its line here."""
    from flashtune import families

    batch, heads, seqlen, _ = FAMILY_SHAPE
    others = tuple(
        SmokeCase(f.op, f"bf16 d{d} full b{batch} n{seqlen} h{heads}",
                  ("--op", f.op, "--head-dim", str(d), "--dtype", "bf16", "--no-causal"),
                  family_smoke(f.op, (batch, heads, seqlen, d)))
        for f in families.all_families() if f.op != "fwd"
        for d in (family_head_dim(f.op),))
    forward = SmokeCase("forward", f"{FORWARD_SHAPE.label()} h{FORWARD_SHAPE.heads}",
                        _forward_args(FORWARD_SHAPE), forward_smoke)
    return (forward, *others)


#: Every family's smoke line, the forward first.
SMOKE_CASES: tuple[SmokeCase, ...] = _smoke_cases()


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


def dry_run(cases: Sequence[SmokeCase], arch: str) -> int:
    """Print the plan and compile each case's kernel for ``arch`` with `flashtune compile`,
    run in this process (one interpreter start for every case, not one each)."""
    from typer.testing import CliRunner

    from flashtune.cli import app

    runner = CliRunner()
    status = 0
    for case in cases:
        t0 = time.perf_counter()
        result = runner.invoke(app, ["compile", "--arch", arch, *case.compile_args],
                               env={"COLUMNS": "160", "NO_COLOR": "1"})
        ok, tail = result.exit_code == 0, result.output.strip()
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            tail += f"\n{type(result.exception).__name__}: {result.exception}"
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
        from flashtune.toolchain import nvrtc
        from flashtune.toolchain.cuda import find_toolchain

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
