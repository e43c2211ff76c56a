"""``flashtune check``: verify a kernel end to end without a GPU.

For each arch: render the kernel, compile it with NVRTC (registers, spills, shared memory),
run it in the CPU emulator on fresh random inputs of the given shape (by default in both
thread schedules, which expose races in either direction) and compare the outputs with the
float64 reference of the kernel's family. One table row per (config, arch); exits with
status 1 if anything fails.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flashtune.api.limits import check_host_memory
from flashtune.codegen.spec import KernelConfig, KernelSource, Problem, Shape
from flashtune.commands.codegen import (
    DEFAULT_ARCH,
    ConfigChoice,
    parse_arch,
    parse_problem,
)
from flashtune.commands.options import (
    DEFAULT_DTYPE,
    BlockM,
    BlockN,
    Causal,
    ConfigKey,
    DTypeOpt,
    HeadDim,
    HeadDimV,
    InputDTypeOpt,
    OpOpt,
    Stages,
    Warps,
)
from flashtune.errors import FlashtuneError, InvalidInput

if TYPE_CHECKING:  # torch and the emulator load when a check runs, not when the CLI starts
    from flashtune.families.base import Verdict
    from flashtune.runtime.backends.emulator import Schedule


def run_in_emulator(source: KernelSource, shape: Shape, schedules: list[Schedule],
                    seed: int) -> Verdict:
    """Launch ``source`` on random inputs (outputs poisoned with NaN) once per schedule and
    return the worst verdict."""
    from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions
    from flashtune.runtime.launch import verify

    worst: Verdict | None = None
    for schedule in schedules:
        kernel = EmulatorBackend(options=LaunchOptions(schedule=schedule)).load(source)
        verdict = verify(kernel, shape, "cpu", seed=seed)
        if worst is None or (not verdict.ok, verdict.max_abs) > (not worst.ok, worst.max_abs):
            worst = verdict
    assert worst is not None
    return worst


@dataclass
class _Row:
    config: KernelConfig
    arch: str
    registers: str = "-"
    spills: str = "-"
    smem: str = "-"
    max_abs: str = "-"
    rel: str = "-"
    result: str = "pass"
    failures: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failures


def _compile_cells(row: _Row, source: KernelSource, arch: str) -> list[str]:
    from flashtune.toolchain.compiler import compile_source

    try:
        res = compile_source(source, arch).resources
    except FlashtuneError as exc:
        return [f"NVRTC ({arch}): {exc}"]
    row.registers = str(res.registers)
    row.spills = f"{res.spill_stores}/{res.spill_loads}"
    row.smem = f"{res.static_smem + source.smem_bytes}"
    return []


def _score(row: _Row, cfg: KernelConfig, outcome: Verdict | str, failures: list[str]
           ) -> None:
    """Fill ``row`` from the emulator's verdict (or its failure message)."""
    if isinstance(outcome, str):
        failures.append(outcome)
    else:
        row.max_abs = f"{outcome.max_abs:.3g}"
        row.rel = f"{outcome.rel_frobenius:.3g}"
        if not outcome.ok:
            failures.append(f"{cfg.key()}: {outcome.message}")
    row.failures = tuple(failures)


def check_command(
    arch: Annotated[list[str] | None, typer.Option(
        "--arch", help=f"Target arch, repeatable (default {DEFAULT_ARCH}).")] = None,
    head_dim: HeadDim = None,
    head_dim_v: HeadDimV = None,
    dtype: DTypeOpt = DEFAULT_DTYPE,
    input_dtype: InputDTypeOpt = None,
    causal: Causal = False,
    op: OpOpt = "fwd",
    config: ConfigKey = None,
    block_m: BlockM = None,
    block_n: BlockN = None,
    warps: Warps = None,
    stages: Stages = None,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Batch size.")] = 1,
    heads: Annotated[int, typer.Option("--heads", min=1, help="Query heads.")] = 2,
    heads_kv: Annotated[int | None, typer.Option(
        "--heads-kv", min=1, help="Key/value heads (default: --heads).")] = None,
    seqlen_q: Annotated[int, typer.Option("--seqlen-q", min=1, help="Query length.")] = 256,
    seqlen_k: Annotated[int | None, typer.Option(
        "--seqlen-k", min=1, help="Key length (default: --seqlen-q).")] = None,
    schedule: Annotated[str, typer.Option(
        "--schedule", help="Emulator thread order: forward, reverse or both.")] = "both",
    seed: Annotated[int | None, typer.Option(
        "--seed", help="Seed of the random inputs (default: a fresh one, printed).")] = None,
    no_compile: Annotated[bool, typer.Option(
        "--no-compile", help="Skip NVRTC; only run the emulator.")] = False,
    gpu: Annotated[bool, typer.Option(
        "--gpu", help="Instead: run ahead, on this GPU, the first-use check of every "
                      "arch-specific kernel the runtime would serve, and record the results "
                      "(a serving process then needs no check). Other options are ignored.")
    ] = False,
    recheck: Annotated[bool, typer.Option(
        "--recheck", help="With --gpu: check kernels recorded before again.")] = False,
    list_kernels: Annotated[bool, typer.Option(
        "--list", help="With --gpu: print the kernels that would be checked.")] = False,
    compile_only: Annotated[bool, typer.Option(
        "--compile-only", help="With --gpu: compile them into the cache; launch nothing.")
    ] = False,
    only: Annotated[list[str] | None, typer.Option(
        "--only", help="With --gpu: check this kernel entry only (repeatable).")] = None,
    timeout: Annotated[float | None, typer.Option(
        "--timeout", min=0.001, help="With --gpu: seconds before a kernel counts as hung "
                                     "(default FLASHTUNE_FIRST_USE_TIMEOUT_S).")] = None,
) -> None:
    """Compile a kernel with NVRTC, run it in the CPU emulator and compare with float64.

    Any kernel family (--op); the shape options give its batch, heads and lengths.

    Exits with status 1 if any kernel fails to compile, faults in the emulator (bad address,
    race, deadlock) or misses the tolerance. Register spills are shown, not failures.

    With --gpu: the first-use checks of the arch-specific kernels on this GPU, recorded
    (commands/check_gpu.py); status 1 if one fails, 2 if one hangs.
    """
    if gpu:
        from flashtune.commands.check_gpu import check_gpu

        check_gpu(recheck=recheck, list_only=list_kernels, only=only, timeout_s=timeout,
                  compile_only=compile_only)
        return
    from flashtune import families
    from flashtune.runtime.backends.emulator import Schedule

    console = Console(width=max(Console().width, 110))
    problem: Problem = parse_problem(op, head_dim, dtype, causal, input_dtype, head_dim_v)
    specs = list(dict.fromkeys(parse_arch(a) for a in (arch or [DEFAULT_ARCH])))
    choice = ConfigChoice(config, block_m, block_n, warps, stages)
    if schedule not in ("forward", "reverse", "both"):
        raise typer.BadParameter(f"{schedule!r}; expected forward, reverse or both",
                                 param_hint="--schedule")
    schedules = list(Schedule) if schedule == "both" else [Schedule(schedule)]
    try:
        shape = Shape(batch, heads, heads_kv or heads, seqlen_q, seqlen_k or seqlen_q)
    except InvalidInput as exc:
        raise typer.BadParameter(str(exc), param_hint="--heads/--heads-kv") from exc
    try:  # before anything is allocated
        check_host_memory(shape.batch, shape.heads_q, shape.heads_kv, shape.seqlen_q,
                          shape.seqlen_k, problem.head_dim, "flashtune check")
    except InvalidInput as exc:
        raise typer.BadParameter(str(exc), param_hint="--seqlen-q/--seqlen-k") from exc
    seed = secrets.randbelow(1 << 31) if seed is None else seed

    rows: list[_Row] = []
    emulated: dict[str, Verdict | str] = {}
    # a status line on stderr through the long steps (an emulator build takes 15-30 s the
    # first time); shown on a terminal only, so the printed table is all a pipe gets
    with Console(stderr=True).status("checking") as status:
        for spec in specs:
            cfg = choice.resolve(problem, spec)
            row = _Row(cfg, spec.name)
            rows.append(row)
            reason = families.of(problem).static_check(problem, cfg, spec)
            if reason is not None:
                row.failures = (f"{cfg.key()} cannot run on {spec.name}: {reason}",)
                continue
            source = families.render(problem, cfg)
            if not no_compile:
                status.update(f"{cfg.key()} on {spec.name}: compiling with NVRTC")
            failures = [] if no_compile else _compile_cells(row, source, spec.name)
            if source.digest not in emulated:
                status.update(f"{cfg.key()} on {spec.name}: building the emulated kernel (g++, "
                              "15-30 s the first time) and running it in the "
                              f"{' and '.join(s.value for s in schedules)} thread order")
                try:
                    emulated[source.digest] = run_in_emulator(source, shape, schedules, seed)
                except FlashtuneError as exc:
                    emulated[source.digest] = f"emulator: {exc}"
            _score(row, cfg, emulated[source.digest], failures)

    table = Table("config", "arch", "regs", "spill B st/ld", "smem B", "max abs err",
                  "rel err", "result",
                  title=f"{problem.key()}  batch {shape.batch}, heads {shape.heads_q}/"
                        f"{shape.heads_kv}, seqlen {shape.seqlen_q}/{shape.seqlen_k}, "
                        f"seed {seed}")
    for r in rows:
        table.add_row(r.config.key(), r.arch, r.registers, r.spills, r.smem, r.max_abs, r.rel,
                      "[green]pass[/]" if r.ok else "[bold red]FAIL[/]")
    console.print(table)
    failed = [f for r in rows for f in r.failures]
    for message in dict.fromkeys(failed):
        Console(stderr=True).print(f"[bold red]failure:[/] {escape(message)}", highlight=False)
    if failed:
        raise typer.Exit(1)
