"""``flashtune check``: verify a kernel end to end without a GPU.

For each arch: render the kernel, compile it with NVRTC (registers, spills, shared memory),
run it in the CPU emulator on fresh random inputs of the given shape (by default in both
thread schedules, which expose races in either direction) and compare O and LSE with a
float64 reference. One table row per (config, arch); exits with status 1 if anything fails.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import numpy as np
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flashtune.codegen import space
from flashtune.codegen.render import render
from flashtune.codegen.spec import DType, KernelConfig, KernelSource, Problem
from flashtune.commands.codegen import (
    DEFAULT_ARCH,
    BlockM,
    BlockN,
    Causal,
    ConfigChoice,
    ConfigKey,
    DTypeOpt,
    HeadDim,
    Stages,
    Warps,
    parse_arch,
    parse_problem,
)
from flashtune.errors import FlashtuneError, InvalidInput
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions, Schedule
from flashtune.runtime.kernel_args import FwdArgs, TensorView

if TYPE_CHECKING:  # torch is imported when a check runs, not when the CLI starts
    import torch

#: Output tolerance relative to max |V|: P and O are rounded to the 16-bit type, so errors
#: of a few units in the last place of the type are expected.
OUTPUT_TOLERANCE = {DType.FP16: 2e-3, DType.BF16: 1.6e-2}
#: LSE tolerance relative to max(1, |LSE|) (f32 arithmetic, exp2 instead of exp).
LSE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Shape:
    """Run-time sizes of one check."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int

    def __post_init__(self) -> None:
        for name in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k"):
            value = getattr(self, name)
            if value < 1:
                raise InvalidInput(f"{name}={value} must be >= 1")
        if self.heads_q % self.heads_kv:
            raise InvalidInput(f"heads={self.heads_q} is not a multiple of heads_kv="
                               f"{self.heads_kv}; GQA needs whole groups")


@dataclass(frozen=True)
class Numerics:
    """How the emulated outputs compare with the reference (worst over schedules)."""

    max_abs: float
    rel: float
    lse_err: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.tolerance and self.lse_err <= LSE_TOLERANCE


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, scale: float
              ) -> tuple[np.ndarray, np.ndarray]:
    """float64 attention of (batch, seq, heads, dim) arrays; GQA by contiguous head groups.

    The causal mask is aligned to the bottom-right corner (row i sees key j iff
    j <= i + seqlen_k - seqlen_q); a row that sees no key has O = 0 and LSE = +inf.
    """
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    sq, sk = q.shape[1], k.shape[1]
    if causal:
        s = np.where(np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p / np.where(total > 0, total, 1.0), v)
    with np.errstate(divide="ignore"):
        lse = (np.log(total) + m)[..., 0]
    return o, np.where(np.isneginf(lse), np.inf, lse)


def _view(t: torch.Tensor) -> TensorView:
    s = t.stride()
    return TensorView(t.data_ptr(), s[0], s[1], s[2])


def _compare(o: torch.Tensor, lse: torch.Tensor, ref_o: np.ndarray, ref_lse: np.ndarray,
             tolerance: float) -> Numerics:
    got = o.double().numpy()
    diff = np.abs(got - ref_o)
    max_abs = float(np.nan_to_num(diff, nan=np.inf).max())
    norm = float(np.linalg.norm(ref_o))
    rel = float(np.linalg.norm(np.nan_to_num(got - ref_o, nan=np.inf))) / max(norm, 1e-30)
    got_lse = lse.double().numpy()
    finite = np.isfinite(ref_lse)
    lse_err = float(np.nan_to_num(
        np.abs(got_lse[finite] - ref_lse[finite]) / np.maximum(1.0, np.abs(ref_lse[finite])),
        nan=np.inf).max(initial=0.0))
    if (got_lse[~finite] != ref_lse[~finite]).any():
        lse_err = math.inf
    return Numerics(max_abs, rel, lse_err, tolerance)


def run_in_emulator(source: KernelSource, shape: Shape, schedules: list[Schedule],
                    seed: int) -> Numerics:
    """Launch ``source`` on random inputs (outputs poisoned with NaN) once per schedule."""
    import torch

    problem = source.problem
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float16 if problem.dtype is DType.FP16 else torch.bfloat16
    d = problem.head_dim

    def randn(seq: int, heads: int) -> torch.Tensor:
        return torch.randn(shape.batch, seq, heads, d, generator=gen).to(dtype)

    q, k, v = (randn(shape.seqlen_q, shape.heads_q), randn(shape.seqlen_k, shape.heads_kv),
               randn(shape.seqlen_k, shape.heads_kv))
    scale = 1.0 / math.sqrt(d)
    ref_o, ref_lse = reference(q.float().numpy(), k.float().numpy(), v.float().numpy(),
                               problem.causal, scale)
    tolerance = OUTPUT_TOLERANCE[problem.dtype] * max(float(v.abs().max()), 1e-30)
    worst: Numerics | None = None
    for schedule in schedules:
        kernel = EmulatorBackend(options=LaunchOptions(schedule=schedule)).load(source)
        o = torch.full_like(q, float("nan"))
        lse = torch.full((shape.batch, shape.heads_q, shape.seqlen_q), float("nan"))
        args = FwdArgs(_view(q), _view(k), _view(v), _view(o), lse.data_ptr(), shape.seqlen_q,
                       shape.seqlen_k, shape.heads_q, shape.heads_kv, scale)
        kernel.launch(source.grid(shape.batch, shape.heads_q, shape.seqlen_q), args.packed())
        result = _compare(o, lse, ref_o, ref_lse, tolerance)
        if worst is None or (result.max_abs, result.lse_err) > (worst.max_abs, worst.lse_err):
            worst = result
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
    from flashtune.runtime.compiler import compile_source

    try:
        res = compile_source(source, arch).resources
    except FlashtuneError as exc:
        return [f"NVRTC ({arch}): {exc}"]
    row.registers = str(res.registers)
    row.spills = f"{res.spill_stores}/{res.spill_loads}"
    row.smem = f"{res.static_smem + source.smem_bytes}"
    return []


def check_command(
    arch: Annotated[list[str] | None, typer.Option(
        "--arch", help=f"Target arch, repeatable (default {DEFAULT_ARCH}).")] = None,
    head_dim: HeadDim = 128,
    dtype: DTypeOpt = DType.FP16,
    causal: Causal = False,
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
) -> None:
    """Compile a kernel with NVRTC, run it in the CPU emulator and compare with float64.

    Exits with status 1 if any kernel fails to compile, faults in the emulator (bad address,
    race, deadlock) or misses the tolerance. Register spills are shown, not failures.
    """
    console = Console(width=max(Console().width, 110))
    problem: Problem = parse_problem(head_dim, dtype, causal)
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
    seed = secrets.randbelow(1 << 31) if seed is None else seed

    rows: list[_Row] = []
    emulated: dict[str, Numerics | str] = {}
    for spec in specs:
        cfg = choice.resolve(problem, spec)
        row = _Row(cfg, spec.name)
        rows.append(row)
        reason = space.static_check(problem, cfg, spec)
        if reason is not None:
            row.failures = (f"{cfg.key()} cannot run on {spec.name}: {reason}",)
            continue
        source = render(problem, cfg)
        failures = [] if no_compile else _compile_cells(row, source, spec.name)
        if source.digest not in emulated:
            try:
                emulated[source.digest] = run_in_emulator(source, shape, schedules, seed)
            except FlashtuneError as exc:
                emulated[source.digest] = f"emulator: {exc}"
        outcome = emulated[source.digest]
        if isinstance(outcome, str):
            failures.append(outcome)
        else:
            row.max_abs = f"{outcome.max_abs:.3g}"
            row.rel = f"{outcome.rel:.3g}"
            if not outcome.ok:
                failures.append(
                    f"{cfg.key()}: max abs error {outcome.max_abs:.3g} (tolerance "
                    f"{outcome.tolerance:.3g}), LSE error {outcome.lse_err:.3g} (tolerance "
                    f"{LSE_TOLERANCE:g})")
        row.failures = tuple(failures)

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
