"""``flashtune profile``: SASS statistics, resources, occupancy and a PREDICTED time of one
kernel on a named GPU, without a GPU."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from flashtune.codegen.spec import Shape
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
    FixOpt,
    HeadDim,
    InputDTypeOpt,
    OpOpt,
    Stages,
    Warps,
    fail,
)
from flashtune.errors import FlashtuneError

if TYPE_CHECKING:  # flashtune.perf imports torch: loaded when a profile runs
    from flashtune.perf.profile import KernelProfile
    from flashtune.perf.sass.parse import InstructionMix


def _shape(batch: int, heads: int, heads_kv: int | None, seqlen: int, seqlen_k: int | None
           ) -> Shape:
    try:
        return Shape(batch, heads, heads_kv or heads, seqlen, seqlen_k or seqlen)
    except FlashtuneError as exc:
        raise typer.BadParameter(str(exc), param_hint="--batch/--heads/--seqlen") from exc


def _widths(widths: dict[int, int]) -> str:
    return ", ".join(f"{n} x {bits}-bit" for bits, n in sorted(widths.items())) or "-"


def _ops(mix: InstructionMix, *categories: str) -> str:
    """'n OPCODE, ...' of the mix's opcodes in ``categories``."""
    from flashtune.perf.sass.parse import categorize

    return ", ".join(f"{n} {op}" for op, n in mix.by_opcode.items()
                     if categorize(op) in categories)


def _counted(mix: InstructionMix, *categories: str) -> str:
    n = sum(mix.by_category[c] for c in categories)
    ops = _ops(mix, *categories)
    return f"{n}" + (f" ({ops})" if ops else "")


def _mix_rows(mix: InstructionMix) -> list[tuple[str, str]]:
    c = mix.by_category
    tensor = "; ".join(f"{t.count} {t.opcode} x {t.flops_per_instruction} FLOP per {t.scope}"
                       for t in mix.tensor_ops())
    return [
        ("tensor-core MMA", f"{c['mma'] + c['wgmma']}" + (f" ({tensor})" if tensor else "")),
        ("warp's tensor FLOPs", str(mix.mma_flops)),
        ("wgmma fence / wait (WARPGROUP)", _counted(mix, "wgsync")),
        ("ldmatrix (LDSM)", str(c["ldsm"])),
        ("cp.async (LDGSTS)", str(c["ldgsts"])),
        ("TMA (UTMALDG, UTMACCTL)", _counted(mix, "tma")),
        ("mbarrier (SYNCS, ARRIVES)", _counted(mix, "mbarrier")),
        ("global loads (LDG)", _widths(dict(mix.load_widths))),
        ("global stores (STG)", _widths(dict(mix.store_widths))),
        ("local memory (LDL / STL)", f"{c['ldl']} / {c['stl']}"),
        ("CTA barriers (BAR 0)", str(c["bar"])),
        ("named barriers (BAR id, count)", str(c["namedbar"])),
        ("fences (FENCE, MEMBAR)", _counted(mix, "fence")),
        ("register realloc (USETMAXREG)", _counted(mix, "regalloc")),
        ("special functions (MUFU)", _counted(mix, "mufu")),
        ("FP32 + conversions", f"{c['fp32']} + {c['convert']}"),
        ("shuffles (SHFL)", str(c["shfl"])),
        ("all instructions", str(mix.total)),
    ]


def _print(profile: KernelProfile) -> None:
    console = Console()
    pred = profile.prediction
    shape = profile.shape
    console.print(f"[bold]{profile.entry}[/] for {profile.arch}; shape batch={shape.batch} "
                  f"heads={shape.heads_q}/{shape.heads_kv} seqlen={shape.seqlen_q}/"
                  f"{shape.seqlen_k}", highlight=False)
    res = profile.resources
    console.print(f"resources: {res.registers} registers, spills {res.spill_stores} B stored /"
                  f" {res.spill_loads} B loaded, smem {res.static_smem} B static + "
                  f"{res.dynamic_smem} B dynamic", highlight=False)
    table = Table(title="SASS instruction mix (static counts)")
    table.add_column("instructions")
    table.add_column("whole kernel", justify="right")
    loop = profile.loop
    title = "main loop" if loop is None else f"main loop [{loop.start:#x}-{loop.end:#x}]"
    table.add_column(title, justify="right")
    loop_rows = (_mix_rows(profile.loop_mix) if profile.loop_mix is not None
                 else [("", "-")] * len(_mix_rows(profile.kernel_mix)))
    for (name, whole), (_, in_loop) in zip(_mix_rows(profile.kernel_mix), loop_rows,
                                           strict=True):
        table.add_row(name, whole, in_loop)
    console.print(table)
    per_iteration = profile.tensor_flops_per_iteration
    if per_iteration is not None and profile.loop_mix is not None:
        per_tile = profile.tensor_flops_per_tile
        console.print(f"main loop tensor FLOPs per iteration: {per_iteration} (the warp's "
                      f"{profile.loop_mix.mma_flops} x {profile.compute_warps} compute "
                      "warps)" + ("" if per_tile is None else
                                  f"; per K/V tile 4 x {profile.config.block_m} x "
                                  f"{profile.config.block_n} x head dim = {per_tile}"),
                      highlight=False)
    _print_inner_loops(console, profile)
    _print_loop_budget(console, profile)
    _print_reference_loop(console, profile)
    occ = profile.occupancy
    waves = f"; {pred.waves:.2f} waves on {profile.gpu.sm_count} SMs" if pred else ""
    console.print(f"occupancy on {profile.arch}: {occ.blocks_per_sm} blocks/SM, "
                  f"{occ.warps_per_sm} warps/SM ({occ.ratio:.0%}), limited by {occ.limiter}"
                  f"{waves}", highlight=False)
    if pred is None:
        console.print(f"no PREDICTED time: the cost model describes the 16-bit forward "
                      f"kernels and fwd8, not the {profile.problem.op!r} family",
                      highlight=False)
        return
    console.print(f"[bold]PREDICTED[/] on {profile.gpu.full_name}: time {pred.time_ms:.4g} ms, "
                  f"{pred.tflops:.1f} TFLOP/s, {pred.bound}-bound "
                  f"({pred.path} path, model {pred.model_version}; a prediction, not a "
                  "measurement)", highlight=False)
    for note in pred.notes:
        console.print(f"  note: {note}", highlight=False)
    for assumption in pred.assumptions:
        console.print(f"  assumed: {assumption}", highlight=False)
    console.print(f"  model: {pred.fitted_summary()}", highlight=False)
    for fig in profile.published:
        console.print(f"  published {fig.kernel} on {fig.gpu}: {fig.tflops:g} TFLOP/s; "
                      f"predicted / published = {fig.ratio(pred.tflops):.2f} (a sanity check, "
                      "not fitted)", highlight=False)
    if profile.emulated is not None:
        _print_counters(console, profile)


def _print_inner_loops(console: Console, profile: KernelProfile) -> None:
    """Name the loops inside the main loop: the static counts take their bodies once."""
    parts = []
    for lp, mix in profile.inner_loops:
        mma = mix.by_category["mma"] + mix.by_category["wgmma"]
        parts.append(f"[{lp.start:#x}-{lp.end:#x}] {mix.total} instructions, {mma} MMA")
    if not parts:
        return
    console.print(f"the main loop holds {len(parts)} inner loop(s): {'; '.join(parts)}; the "
                  "static counts take each body once per iteration (the SASS does not give "
                  "their trip counts)", highlight=False)


def _print_loop_budget(console: Console, profile: KernelProfile) -> None:
    """Instructions per main-loop iteration per warp, by class, masked and unmasked loop."""
    from flashtune.perf.sass.budget import class_table

    loops = {f"{lp.kind.value} loop [{lp.loop.start:#x}-{lp.loop.end:#x}]": lp
             for lp in profile.loops}
    if not loops:
        return
    table = Table(title="per main-loop iteration per warp (static)")
    table.add_column("class")
    for name in loops:
        table.add_column(name, justify="right")
    for row in class_table({name: lp.mix for name, lp in loops.items()}):
        table.add_row(*row)
    table.add_row("local memory (LDL+STL, in MMA chains)",
                  *(f"{lp.local.accesses} ({lp.local.in_mma_chain})" for lp in loops.values()))
    table.add_row("executed when no row max changed",
                  *(str(lp.executed_min) for lp in loops.values()))
    console.print(table)


def _print_reference_loop(console: Console, profile: KernelProfile) -> None:
    """The measured reference kernel's loop beside this one's, and their ratio per tensor
    FLOP (the busiest loop the finder found: unmasked, else masked)."""
    from flashtune.perf.sass.reference_loops import reference_loop

    ref = reference_loop(profile.problem)
    if ref is None or profile.loop_mix is None or profile.loop_mix.mma_flops == 0:
        return
    ours, flops = profile.loop_mix.total, profile.loop_mix.mma_flops
    console.print(f"reference: {ref.kernel}: {ref.instructions} instructions per warp per "
                  f"iteration for {ref.tensor_flops} tensor FLOPs; this kernel: {ours} for "
                  f"{flops}; instructions per tensor FLOP, this / reference = "
                  f"{ref.ratio(ours, flops):.2f}", highlight=False)


def _print_counters(console: Console, profile: KernelProfile) -> None:
    emu = profile.emulated
    assert emu is not None
    c = emu.counters
    s = emu.sample
    console.print(f"emulator counters (sample batch=1 heads=1 seqlen={s.seqlen_q}/{s.seqlen_k}"
                  f"; fed to the prediction):", highlight=False)
    console.print(f"  cp.async: {c.cp_async_bytes} B read ({emu.read_ratio:.3f} x the "
                  f"algorithm's minimum), {c.sectors_per_request:.1f} sectors per warp request"
                  f" (coalescing {c.coalescing_efficiency:.0%}), "
                  f"{c.cp_async_smem_conflicts} shared bank conflicts", highlight=False)
    console.print(f"  ldmatrix: {c.ldmatrix_count} instructions, {c.ldmatrix_conflicts} bank "
                  f"conflicts; mma {c.mma_count}, shuffles {c.shfl_count}, barriers "
                  f"{c.barrier_count}; bank-conflict factor "
                  f"{c.smem_bank_conflict_factor:.3f}", highlight=False)
    console.print(f"  global read for the predicted shape: {emu.traffic.global_read_bytes} B "
                  "(O and LSE stores are not counted: analytic)", highlight=False)
    for site in c.conflicting_sites():
        console.print(f"  conflicts at {site.where} ({site.kind}): {site.bank_conflicts} extra "
                      f"wavefronts over {site.phases} phases", highlight=False)


def profile(
    op: OpOpt = "fwd",
    head_dim: HeadDim = None,
    dtype: DTypeOpt = DEFAULT_DTYPE,
    input_dtype: InputDTypeOpt = None,
    causal: Causal = False,
    config: ConfigKey = None,
    block_m: BlockM = None,
    block_n: BlockN = None,
    warps: Warps = None,
    stages: Stages = None,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Batch size.")] = 4,
    heads: Annotated[int, typer.Option("--heads", min=1, help="Query heads.")] = 16,
    heads_kv: Annotated[int | None, typer.Option(
        "--heads-kv", min=1, help="Key/value heads (default: --heads).")] = None,
    seqlen: Annotated[int, typer.Option("--seqlen", min=1, help="Query sequence length.")
                      ] = 4096,
    seqlen_k: Annotated[int | None, typer.Option(
        "--seqlen-k", min=1, help="Key/value sequence length (default: --seqlen).")] = None,
    arch: Annotated[str, typer.Option("--arch", help="Arch to compile for.")] = DEFAULT_ARCH,
    gpu: Annotated[str | None, typer.Option(
        "--gpu", help="GPU of the prediction (default: the arch's reference GPU, e.g. H100 "
        "for sm_90).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")
                       ] = False,
    counters: Annotated[bool, typer.Option(
        "--counters", help="Also run the kernel in the CPU emulator on a small shape and feed "
        "its measured global bytes and bank conflicts to the prediction.")] = False,
    fix: FixOpt = None,
) -> None:
    """Compile one kernel and print its SASS statistics (whole kernel and main loop: the
    instruction budget per tile), resources, occupancy and, for the forward, its PREDICTED
    time and TFLOP/s on a GPU (a cost-model prediction; no GPU is used)."""
    from flashtune.perf.profile import profile_kernel

    problem = parse_problem(op, head_dim, dtype, causal, input_dtype)
    spec = parse_arch(arch)
    kernel_config = ConfigChoice(config, block_m, block_n, warps, stages,
                                 tuple(fix or ())).resolve(problem, spec)
    shape = _shape(batch, heads, heads_kv, seqlen, seqlen_k)
    try:
        result = profile_kernel(problem, kernel_config, shape, spec.name, gpu,
                                counters=counters)
    except (FlashtuneError, ValueError) as exc:
        raise fail(str(exc)) from exc
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2, sort_keys=True))
    else:
        _print(result)
