"""``flashtune show`` (print a generated kernel), ``flashtune compile`` (NVRTC resources) and
``flashtune space`` (the size of a search space).

Both take a problem (--head-dim, --dtype, --causal) and a config: --config KEY and/or
--block-m/--block-n/--warps/--stages, each given field overriding the base config (the
--config key, else the default config of the problem on the arch).

The kernel family registry (``flashtune.families``) imports torch, so it is imported inside
the functions that use it: the command line starts without it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flashtune.codegen.arch import ArchSpec, get_arch
from flashtune.codegen.spec import DType, KernelConfig, KernelSource, Problem
from flashtune.commands.modifications import MaskModOpt, ScoreModOpt, with_modifications
from flashtune.commands.options import (
    DEFAULT_DTYPE,
    BlockM,
    BlockN,
    Causal,
    ConfigKey,
    DTypeOpt,
    FixOpt,
    HeadDim,
    HeadDimV,
    InputDTypeOpt,
    OpOpt,
    Stages,
    Warps,
    fail,
    problem_dtypes,
)
from flashtune.commands.safety import output_dir
from flashtune.errors import FlashtuneError, InvalidConfig, InvalidProblem

if TYPE_CHECKING:  # the families are imported where a command uses them (see above)
    from flashtune.families.fixed import Fixed

DEFAULT_ARCH = "sm_90"
ArchList = Annotated[list[str] | None, typer.Option(
    "--arch", help=f"Target arch, repeatable (default {DEFAULT_ARCH}).")]


def render(problem: Problem, config: KernelConfig) -> KernelSource:
    """The KernelSource of ``problem`` x ``config``, rendered by its family
    (``flashtune.families.render``)."""
    from flashtune import families

    return families.render(problem, config)


@dataclass(frozen=True)
class ConfigChoice:
    """The config options as given; ``resolve`` turns them into a config for one arch."""

    key: str | None
    block_m: int | None
    block_n: int | None
    num_warps: int | None
    num_stages: int | None
    fix: tuple[str, ...] = ()  # --fix NAME=VALUE: knobs set after the fields

    @property
    def overrides(self) -> dict[str, int]:
        fields = {"block_m": self.block_m, "block_n": self.block_n,
                  "num_warps": self.num_warps, "num_stages": self.num_stages}
        return {k: v for k, v in fields.items() if v is not None}

    @property
    def given(self) -> bool:
        return self.key is not None or bool(self.overrides)

    def resolve(self, problem: Problem, spec: ArchSpec) -> KernelConfig:
        from flashtune import families

        try:
            base = (KernelConfig.from_key(self.key) if self.key is not None
                    else families.of(problem).default_config(problem, spec))
        except InvalidConfig as exc:
            raise typer.BadParameter(str(exc), param_hint="--config") from exc
        try:
            config = KernelConfig.from_dict({**base.to_dict(), **self.overrides})
        except InvalidConfig as exc:
            raise typer.BadParameter(
                f"{exc} (from {base.key()} with {self.overrides})",
                param_hint="--block-m/--block-n/--warps/--stages") from exc
        from flashtune.families import fixed as fixing

        family = families.of(problem)
        try:
            return fixing.apply(family, config, parse_fix(problem, self.fix))
        except InvalidConfig as exc:
            raise typer.BadParameter(f"{exc} (from {config.key()})", param_hint="--fix") from exc


def parse_fix(problem: Problem, texts: Sequence[str] | None) -> Fixed:
    """The knobs ``--fix NAME=VALUE`` holds in the space of ``problem``'s family (a usage
    error naming the family's knobs, or the knob's values, otherwise)."""
    from flashtune import families
    from flashtune.families import fixed as fixing

    try:
        return fixing.parse(families.of(problem), problem, texts or ())
    except InvalidConfig as exc:
        raise typer.BadParameter(str(exc), param_hint="--fix") from exc


def parse_problem(op: str, head_dim: int | None, dtype: DType, causal: bool,
                  input_dtype: str | None = None, head_dim_v: int | None = None) -> Problem:
    """The Problem of the options, served by a registered family (else a usage error);
    its head dim --head-dim (None: the family's ``default_head_dim``), its element types as
    ``options.problem_dtypes`` reads --dtype and --input-dtype, V's head dim --head-dim-v
    (None: --head-dim's)."""
    from flashtune import families

    try:
        family = families.get(op)
    except InvalidProblem as exc:
        raise typer.BadParameter(str(exc), param_hint="--op") from exc
    types = problem_dtypes(family, dtype, input_dtype)
    if head_dim is None:
        head_dim = family.default_head_dim
    try:
        problem = Problem.from_dict({"head_dim": head_dim, "causal": causal, "op": op,
                                     "head_dim_v": head_dim_v, **types})
    except InvalidProblem as exc:
        raise typer.BadParameter(str(exc), param_hint="--head-dim") from exc
    if problem.split_head_dims:
        try:
            family.check_problem(problem)
        except InvalidProblem as exc:
            raise typer.BadParameter(str(exc), param_hint="--head-dim-v") from exc
    return problem


def parse_arch(value: str) -> ArchSpec:
    try:
        return get_arch(value)
    except InvalidConfig as exc:
        raise typer.BadParameter(str(exc), param_hint="--arch") from exc


def parse_archs(values: list[str] | None) -> list[ArchSpec]:
    """The archs of a repeatable --arch option, each once (default DEFAULT_ARCH)."""
    return list(dict.fromkeys(parse_arch(a) for a in (values or [DEFAULT_ARCH])))


def show(
    op: OpOpt = "fwd",
    head_dim: HeadDim = None,
    head_dim_v: HeadDimV = None,
    dtype: DTypeOpt = DEFAULT_DTYPE,
    input_dtype: InputDTypeOpt = None,
    causal: Causal = False,
    config: ConfigKey = None,
    block_m: BlockM = None,
    block_n: BlockN = None,
    warps: Warps = None,
    stages: Stages = None,
    arch: Annotated[str, typer.Option(
        "--arch", help="Arch whose default config is shown when no config is given.")
    ] = DEFAULT_ARCH,
    fix: FixOpt = None,
    bindings: Annotated[bool, typer.Option(
        "--bindings", help="Print only the rendered template (the parameter bindings and "
        "the entry point, which include the kernel's headers) instead of the whole source.")
    ] = False,
    score_mod: ScoreModOpt = None,
    mask_mod: MaskModOpt = None,
) -> None:
    """Print the CUDA source of one kernel exactly as NVRTC compiles it: the rendered
    template with every flashtune header it includes inlined (--bindings: the template
    alone); --score-mod / --mask-mod trace a modification into it."""
    from flashtune import families
    from flashtune.codegen.render import translation_unit

    problem = with_modifications(parse_problem(op, head_dim, dtype, causal, input_dtype,
                                               head_dim_v), score_mod, mask_mod)
    spec = parse_arch(arch)
    choice = ConfigChoice(config, block_m, block_n, warps, stages, tuple(fix or ()))
    kernel_config = choice.resolve(problem, spec)
    reason = families.of(problem).static_check(problem, kernel_config, spec)
    if reason is not None:
        Console(stderr=True).print(f"[yellow]note:[/] {kernel_config.key()} is excluded on "
                                   f"{spec.name}: {reason}", highlight=False)
    source = render(problem, kernel_config)
    typer.echo(source.code if bindings else translation_unit(source), nl=False)


@dataclass(frozen=True)
class _Row:
    problem: Problem
    source: KernelSource | None
    config: KernelConfig
    arch: str
    excluded: str | None


def _plan(problem: Problem, specs: list[ArchSpec], choice: ConfigChoice, all_configs: bool
          ) -> list[_Row]:
    from flashtune import families

    rows: list[_Row] = []
    for spec in specs:
        served = families.served_on_virtual(problem, spec)
        family = families.of(served)
        configs = (_space_configs(served, choice.fix) if all_configs
                   else [choice.resolve(served, spec)])
        for cfg in configs:
            reason = family.static_check(served, cfg, spec)
            if all_configs and reason is not None:
                continue  # counted by _print_space_sizes, not listed (10^5 for the forward)
            rows.append(_Row(served, None if reason else render(served, cfg), cfg, spec.name,
                             reason))
    return rows


def _space_configs(problem: Problem, fix: Sequence[str]) -> list[KernelConfig]:
    """The structurally legal configs of ``problem``'s family space, restricted by --fix."""
    from flashtune import families
    from flashtune.families import fixed as fixing

    family = families.of(problem)
    fixed = parse_fix(problem, fix)
    return [c for c in family.search_space(problem) if fixing.matches(family, c, fixed)]


def compile_command(
    arch: ArchList = None,
    op: OpOpt = "fwd",
    head_dim: HeadDim = None,
    head_dim_v: HeadDimV = None,
    dtype: DTypeOpt = DEFAULT_DTYPE,
    input_dtype: InputDTypeOpt = None,
    causal: Causal = False,
    config: ConfigKey = None,
    block_m: BlockM = None,
    block_n: BlockN = None,
    warps: Warps = None,
    stages: Stages = None,
    all_configs: Annotated[bool, typer.Option(
        "--all", help="Every config of the search space that passes each arch's static rules "
        "(the rest are counted); prints the space's size.")
    ] = False,
    ptx_dir: Annotated[Path | None, typer.Option(
        "--ptx-dir", file_okay=False, help="Write <entry>.<arch>.ptx files here.")] = None,
    sass_dir: Annotated[Path | None, typer.Option(
        "--sass-dir", file_okay=False,
        help="Write <entry>.<arch>.sass files here (needs nvdisasm).")] = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", min=1, help="Compile processes (default FLASHTUNE_COMPILE_WORKERS).")
    ] = None,
    fix: FixOpt = None,
) -> None:
    """Compile kernels with NVRTC for the given archs and print their resource usage.

    Exits with status 1 if any kernel fails to compile.
    """
    from flashtune.toolchain.compiler import compile_pairs, compile_source
    from flashtune.toolchain.cuda import find_toolchain, require_nvdisasm
    from flashtune.toolchain.disasm import disassemble

    problem = parse_problem(op, head_dim, dtype, causal, input_dtype, head_dim_v)
    specs = parse_archs(arch)
    choice = ConfigChoice(config, block_m, block_n, warps, stages, tuple(fix or ()))
    if all_configs and choice.given:
        raise typer.BadParameter("--all compiles every config; drop --config/--block-m/"
                                 "--block-n/--warps/--stages, or drop --all", param_hint="--all")
    for directory, option in ((ptx_dir, "--ptx-dir"), (sass_dir, "--sass-dir")):
        if directory is not None:
            output_dir(directory, option)
    try:
        if sass_dir is not None:
            require_nvdisasm(find_toolchain())
        if all_configs:  # pruning and rendering the space takes a minute or two
            Console(stderr=True, highlight=False).print(
                f"listing the configs of {problem.key()} that pass the static rules on "
                f"{', '.join(s.name for s in specs)} and rendering them (a minute or two on "
                "2 cores), then compiling them")
        rows = _plan(problem, specs, choice, all_configs)
        jobs = [(r.source, r.arch) for r in rows if r.source is not None]
        results = iter(compile_pairs(jobs, workers,
                                     on_progress=CompileStatus(len(jobs), workers)))
        console = Console()
        keys = ", ".join(dict.fromkeys(r.problem.key() for r in rows))
        table = Table(title=f"{keys}: NVRTC resource usage")
        table.add_column("config", no_wrap=True)
        table.add_column("arch", no_wrap=True)
        table.add_column("registers", justify="right")
        table.add_column("spill bytes st/ld", justify="right")
        table.add_column("smem B static+dynamic", justify="right")
        table.add_column("status")
        failures = []
        for row in rows:
            if row.source is None:
                table.add_row(row.config.key(), row.arch, "", "", "",
                              escape(f"excluded: {row.excluded}"))
                continue
            result = next(results)
            if result.kernel is None:
                assert result.failure is not None
                failures.append(result.failure)
                table.add_row(row.config.key(), row.arch, "", "", "",
                              "[bold red]FAILED[/]: " + escape(result.failure.message))
                continue
            res = result.kernel.resources
            spills = f"{res.spill_stores}/{res.spill_loads}"
            table.add_row(row.config.key(), row.arch, str(res.registers),
                          f"[yellow]{spills}[/]" if res.spill_bytes else spills,
                          f"{res.static_smem}+{res.dynamic_smem}", "ok")
            if ptx_dir is not None:
                ptx = compile_source(row.source, row.arch, ptx=True).ptx or ""
                ptx_dir.mkdir(parents=True, exist_ok=True)
                (ptx_dir / f"{row.source.entry}.{row.arch}.ptx").write_text(ptx)
            if sass_dir is not None:
                sass_dir.mkdir(parents=True, exist_ok=True)
                (sass_dir / f"{row.source.entry}.{row.arch}.sass").write_text(
                    disassemble(result.kernel.cubin))
        console.print(table)
        if all_configs:
            _print_space_sizes(console, specs, problem, choice.fix)
    except FlashtuneError as exc:
        raise fail(str(exc)) from exc
    except OSError as exc:  # writing --ptx-dir/--sass-dir files (e.g. a full disk)
        raise fail(f"cannot write {exc.filename}: {exc.strerror or exc}") from exc
    if failures:
        for failure in failures:
            Console(stderr=True).print(str(failure.error()), highlight=False, markup=False)
        raise fail(f"{len(failures)} of {len(jobs)} kernels failed to compile")


#: CPU seconds of one kernel's NVRTC compile, for the estimate printed before compiling
#: (1.25 s of CPU, 1.7 s wall, per head dim 128 forward kernel on a 2-core x86-64 VM at load
#: 5); while compiling, the time left comes from the measured rate.
SECONDS_PER_KERNEL = 1.5
#: When stderr is not a terminal (a log), a status line at most this often.
STATUS_EVERY_S = 30.0


class CompileStatus:
    """``compile_pairs``'s ``on_progress`` for the command line: before compiling, how many
    kernels and about how long; then, in a log (the terminal has a bar with the time left),
    a line at most every ``STATUS_EVERY_S`` with the time left at the measured rate."""

    def __init__(self, total: int, workers: int | None) -> None:
        from flashtune import settings

        self.total = total
        self.workers = settings.COMPILE_WORKERS.get() if workers is None else workers
        self.console = Console(stderr=True, highlight=False)
        self.start = self.last = time.monotonic()

    def __call__(self, done: int, pending: int) -> None:
        from flashtune.commands.tune_progress import _duration

        now = time.monotonic()
        if done == 0:
            self.start = self.last = now
            cores = max(1, min(self.workers, os.cpu_count() or 1, pending))
            if pending:
                estimate = pending * SECONDS_PER_KERNEL / cores
                self.console.print(
                    f"compiling {pending} of {self.total} kernels ({self.total - pending} "
                    f"cached) in {cores} process(es): about {_duration(estimate)} (at "
                    f"~{SECONDS_PER_KERNEL:g} s of CPU per kernel; longer on a loaded machine)")
            return
        if sys.stderr.isatty() or (now - self.last < STATUS_EVERY_S and done < pending):
            return
        self.last = now
        left = (now - self.start) / done * (pending - done)
        self.console.print(f"compiled {done}/{pending} in {_duration(now - self.start)}, "
                           f"about {_duration(left)} left")


def _print_space_sizes(console: Console, specs: list[ArchSpec], problem: Problem,
                       fix: Sequence[str] = ()) -> None:
    """The space of ``problem`` as each arch serves it (restricted by --fix): declared
    points, structurally legal configs, and those that pass the arch's static rules."""
    from flashtune import families
    from flashtune.families import fixed as fixing

    for spec in specs:
        served = families.served_on_virtual(problem, spec)
        family = families.of(served)
        fixed = parse_fix(served, fix)
        declared = fixing.restrict(family.space(served), fixed).size
        legal = _space_configs(served, fix)
        passing = [c for c in legal if family.static_check(served, c, spec) is None]
        knobs = f" with {fixing.text(fixed)}" if fixed else ""
        console.print(f"space of {served.key()} on {spec.name}{knobs}: {declared} declared "
                      f"points, {len(legal)} legal configs, {len(passing)} pass the static "
                      "rules", highlight=False)


def space_command(
    arch: ArchList = None,
    op: OpOpt = "fwd",
    head_dim: HeadDim = None,
    head_dim_v: HeadDimV = None,
    dtype: DTypeOpt = DEFAULT_DTYPE,
    input_dtype: InputDTypeOpt = None,
    causal: Causal = False,
    fix: FixOpt = None,
) -> None:
    """Print the size of a problem's search space per arch (nothing is compiled), and the
    knobs of the family's space (what --fix can hold)."""
    from flashtune import families

    problem = parse_problem(op, head_dim, dtype, causal, input_dtype, head_dim_v)
    specs = parse_archs(arch)
    console = Console()
    _print_space_sizes(console, specs, problem, fix or ())
    for spec in specs:
        served = families.served_on_virtual(problem, spec)
        knobs = "; ".join(f"{p.name} {list(p.values)}"
                          for p in families.of(served).space(served).params)
        console.print(f"knobs of {served.op} on {spec.name}: {knobs}", highlight=False)


def families_command() -> None:
    """List the kernel families: op, title, template and the size of the search space."""
    from flashtune import families

    table = Table(title="kernel families")
    for column in ("op", "what it computes", "template", "space (points)"):
        table.add_column(column)
    for family in families.all_families():
        problem = Problem(head_dim=128, dtype=DType.FP16, op=family.op)
        table.add_row(family.op, family.title, family.template,
                      str(family.space(problem).size))
    Console().print(table)
