"""``flashtune tune`` (search configs on this GPU, or a dry run for an arch) and
``flashtune report`` (plots of the studies in a tuning database)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.text import Text

from flashtune import settings
from flashtune.codegen.spec import FEATURES, DType, Problem
from flashtune.commands.modifications import MaskModOpt, ScoreModOpt, with_modifications
from flashtune.commands.options import (
    DEFAULT_DTYPE,
    DbOpt,
    FixOpt,
    InputDTypeOpt,
    fail,
    problem_dtypes,
)
from flashtune.db.records import printable
from flashtune.errors import DeviceError, FlashtuneError, TuningError
from flashtune.tuner.defaults import DEFAULT_MAX_SPILL_BYTES, DEFAULT_TOLERANCE, SAMPLERS

if TYPE_CHECKING:  # the tuner imports Optuna, SQLAlchemy and torch: loaded when a run starts
    from flashtune.commands.tune_progress import RichProgress
    from flashtune.tuner.measure.workload import BatchHeads
    from flashtune.tuner.options import BucketSummary, TuneOptions


def _below_one(value: float) -> float:
    """--tie-tolerance is a fraction in [0, 1) (1 would tie every finalist with the best).
    Checked here rather than by a typer range, whose bounds would widen the option column
    of --help."""
    if not 0.0 <= value < 1.0:
        raise typer.BadParameter(f"{value} is not in [0, 1); give a fraction such as 0.02 "
                                 "(2 %)")
    return value


def _at_least_one(value: int | None) -> int | None:
    """--trials counts candidates: 0 would accept the run and measure nothing."""
    if value is not None and value < 1:
        raise typer.BadParameter(f"{value} measures nothing; give at least 1 (the default "
                                 "is 40 per bucket)")
    return value


def tune_command(
    head_dim: Annotated[int | None, typer.Option(
        "--head-dim", help="Head dimension, e.g. 128 (not with --replay).")] = None,
    op: Annotated[str, typer.Option(
        "--op", help="Kernel family (`flashtune families` lists them).")] = "fwd",
    dtype: Annotated[str, typer.Option(
        "--dtype", help="Element type of q, k, v: fp16 or bf16 (O's where --input-dtype "
                        "differs, e.g. --op fwd8).")] = DEFAULT_DTYPE.value,
    input_dtype: InputDTypeOpt = None,
    causal: Annotated[bool, typer.Option("--causal/--no-causal", help="Causal mask.")] = False,
    features: Annotated[str | None, typer.Option(
        "--features", help="Attention features compiled in, comma-separated: window, "
                           "softcap, alibi, varlen, sinks, dropout (each its own tuning key; "
                           "default: none).")] = None,
    seqlens: Annotated[str, typer.Option(
        "--seqlens", help="Sequence lengths whose buckets to tune, e.g. 1024,4096,16k.")
    ] = "1024,4096,16384",
    shape_classes: Annotated[str | None, typer.Option(
        "--shape-classes", help="Classes of call shapes tuned apart in each bucket, "
                                "comma-separated; decoding's are g<group>q<rows>p<page> "
                                "(page 0: unpaged), e.g. g8q4p16,g1q1p0; 'none' tunes one "
                                "bucket for every shape (default: the family's own: "
                                "decoding's g1q1p16,g4q1p16,g8q1p16,g8q4p16).")] = None,
    batch_heads: Annotated[str | None, typer.Option(
        "--batch-heads", help="BATCHxHEADS pairs timed per bucket, e.g. 4x16,1x32 (default: "
                              "the standard sweep, hidden 2048 and ~16k tokens).")] = None,
    trials: Annotated[int | None, typer.Option(
        "--trials", callback=_at_least_one,
        help="Candidates measured per bucket, at least 1 (default 40; with --replay: no "
             "limit but the budget).")] = None,
    budget: Annotated[str | None, typer.Option(
        "--budget", help="Time budget of the whole run, compiles included, e.g. 10m; with "
                         "--replay simulated time, or a share of the landscape's brute-force "
                         "time such as 5%.")] = None,
    sampler: Annotated[str, typer.Option(
        "--sampler", help=f"Search strategy: {', '.join(SAMPLERS)} (guided: flashtune's "
                          "default).")] = "guided",
    seed: Annotated[int | None, typer.Option("--seed", help="Sampler seed.")] = 0,
    db: DbOpt = None,
    study: Annotated[str | None, typer.Option(
        "--study", help="Study name prefix (default: flashtune/<device>/<bucket>/<digest>).")
    ] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue existing studies (also: join other workers).")] = False,
    workers: Annotated[int, typer.Option(
        "--workers", help="Worker processes on this machine, one per GPU.")] = 1,
    compile_workers: Annotated[int | None, typer.Option(
        "--compile-workers", help="NVRTC processes (default: FLASHTUNE_COMPILE_WORKERS).")
    ] = None,
    max_spill_bytes: Annotated[int, typer.Option(
        "--max-spill-bytes", help="Register spill stores per thread tolerated.")
    ] = DEFAULT_MAX_SPILL_BYTES,
    tie_tolerance: Annotated[float, typer.Option(
        "--tie-tolerance", callback=_below_one,
        help="Finalists within this fraction of the best tie (0 to below 1).")] = DEFAULT_TOLERANCE,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="No GPU: compile for --arch and verify in the emulator, untimed.")
    ] = False,
    arch: Annotated[str | None, typer.Option(
        "--arch", help="Arch of a dry run (default sm_90); a GPU run uses the GPU's.")] = None,
    prune_predicted: Annotated[float | None, typer.Option(
        "--prune-predicted", help="Skip configs the cost model predicts more than this factor "
                                  "slower than its best prediction, e.g. 3.0 (default: off).")
    ] = None,
    cost_model_gpu: Annotated[str | None, typer.Option(
        "--cost-model-gpu", help="GPU of the cost model's predictions, e.g. H100 (default: "
                                 "this GPU when the model knows it; a dry run: the arch's "
                                 "reference GPU).")] = None,
    warm_start_from: Annotated[str | None, typer.Option(
        "--warm-start-from", metavar="DEVICE",
        help="Start from DEVICE's results of the same buckets in the database (with "
             "--replay: the same kernel's landscape of DEVICE next to FILE), e.g. A100.")
    ] = None,
    replay: Annotated[Path | None, typer.Option(
        "--replay", metavar="FILE", help="Replay a recorded landscape (T4 JSON, see the "
                                         "README; or a packaged one's name, e.g. "
                                         "convolution_A6000) on a simulated clock instead "
                                         "of tuning.")
    ] = None,
    fix: FixOpt = None,
    score_mod: ScoreModOpt = None,
    mask_mod: MaskModOpt = None,
) -> None:
    """Tune a kernel family (default: the forward) on this GPU; store each bucket's winner.

    --score-mod / --mask-mod tune a traced modification (its own tuning key, as a feature).
    With --replay FILE the same search runs against a recorded landscape of any kernel."""
    from flashtune import families
    from flashtune.commands.tune_progress import RichProgress
    from flashtune.tuner.interrupt import deferred
    from flashtune.tuner.landscape import parse_budget
    from flashtune.tuner.measure.workload import parse_batch_heads, parse_seqlens
    from flashtune.tuner.options import TuneOptions

    if replay is not None:
        if fix:
            raise fail("--fix restricts a kernel family's space; a --replay searches the "
                       "landscape's own space (drop --fix)")
        _replay(replay, budget, trials, sampler, seed, warm_start_from)
        return
    try:
        if head_dim is None:
            raise TuningError("--head-dim is required (e.g. --head-dim 128), unless the "
                              "run is a --replay of a landscape")
        try:
            types = problem_dtypes(families.get(op), DType(dtype.lower()), input_dtype)
        except ValueError:  # not a DType: the Problem names the choices
            types = {"dtype": dtype}
        problem = Problem.from_dict({"head_dim": head_dim, "causal": causal, "op": op,
                                     **types, **parse_features(features)})
        families.of(problem).check_problem(problem)  # unknown op, missing feature
        problem = with_modifications(problem, score_mod, mask_mod)
        if problem.features and (score_mod or mask_mod):
            families.of(problem).check_problem(problem)  # a family without modifications
        traced = bool(score_mod or mask_mod)
        if traced and workers != 1:
            raise TuningError("a traced modification is registered in this process only: "
                              "tune it with --workers 1")
        lengths = parse_seqlens(seqlens)
        pairs = parse_batch_heads(batch_heads)
        classes = parse_shape_classes(shape_classes, families.of(problem).default_shape_classes)
        options = TuneOptions(
            trials=40 if trials is None else trials,
            budget_s=parse_budget(budget) if budget else None,
            sampler=sampler, seed=seed, study_prefix=study, resume=resume,
            # a traced modification is registered here only: its kernels compile in this
            # process, not in compile workers
            compile_workers=0 if traced else (settings.COMPILE_WORKERS.get()
                                              if compile_workers is None else compile_workers),
            max_spill_bytes=max_spill_bytes, tie_tolerance=tie_tolerance,
            prune_predicted=prune_predicted, cost_model_gpu=cost_model_gpu,
            warm_start_from=warm_start_from)
        if arch is not None and not dry_run:
            raise TuningError("--arch applies to --dry-run only: a run on the GPU tunes for "
                              "the GPU's own arch")
        problem = _served_problem(problem, (arch or "sm_90") if dry_run else None)
        if fix:  # the knobs of the family that is tuned (the served one)
            from flashtune.families import fixed as fixing

            options = dataclasses.replace(options, fixed=fixing.parse(
                families.of(problem), problem, fix))
        if dry_run and workers != 1:
            raise TuningError("a dry run runs in one process; parallel compiles are "
                              "--compile-workers")
        # the status line follows one process's phases; workers report through the database
        progress = RichProgress(options.trials, phases=workers == 1 or dry_run)
        parallel = workers > 1 and not dry_run
        # Ctrl-C stops the run between trials (see tuner.interrupt); a second one at once
        with deferred("stopping the workers (Ctrl-C again to stop at once)" if parallel else
                      "stopping once the trial in progress is saved (Ctrl-C again to stop "
                      "at once)"):
            if parallel:
                summaries = _run_workers(problem, lengths, classes, pairs, options, db,
                                         workers, progress)
            else:
                summaries = _run_local(problem, lengths, classes, pairs, options, db,
                                       progress, dry_arch=(arch or "sm_90") if dry_run
                                       else None)
    except (FlashtuneError, ValueError) as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        sys.stdout.flush()  # the table first, then the hint on a line of its own
        Console(stderr=True).print("interrupted: every finished trial is saved; rerun the same "
                                   "command with --resume to continue", highlight=False)
        raise typer.Exit(130) from None
    from flashtune.commands.tune_progress import final_table, predicted_tables

    console = Console()
    console.print()
    console.print(final_table(summaries))
    for note in progress.failure_notes():  # why the configs under "failures" failed
        console.print(Text(printable(note)), soft_wrap=True)
    for s in summaries:
        if s.warm_start:
            console.print(f"{s.bucket.key()}: {s.warm_start}", highlight=False)
    if dry_run:
        for table in predicted_tables(summaries):
            console.print(table)


def _served_problem(problem: Problem, dry_arch: str | None) -> Problem:
    """The problem the device's calls of ``problem`` run, which is the one worth tuning: on
    a compute capability 9.0 GPU the sm_90a family that serves its op there (unless
    FLASHTUNE_ARCH_SPECIFIC=0), on a virtual device of ``dry_arch`` only when that arch is
    the sm_90a target itself (runtime.dispatch's choice). Said when it differs."""
    from flashtune.runtime.device import DeviceInfo
    from flashtune.runtime.dispatch import served_problem

    try:
        device = DeviceInfo.virtual(dry_arch) if dry_arch else DeviceInfo.current()
    except DeviceError:
        return problem  # no usable GPU: the measurer says so
    served = served_problem(problem, device)
    if served != problem:
        other = ("--arch sm_90 tunes the portable one" if dry_arch else
                 f"FLASHTUNE_ARCH_SPECIFIC=0 tunes and serves {problem.op} instead")
        Console(stderr=True).print(
            f"note: on {device.name} the {served.op} family serves {problem.op} calls, so it "
            f"is the one tuned ({served.key()}); {other}", highlight=False)
    return served


def _replay(path: Path, budget: str | None, trials: int | None, sampler: str,
            seed: int | None, warm_start_from: str | None) -> None:
    """``--replay``: the tuner's search against a recorded landscape, with a live table."""
    from flashtune.commands.tune_progress import ReplayProgress
    from flashtune.tuner.landscape import Landscape, parse_budget
    from flashtune.tuner.replay import replay, warm_start_prior
    from flashtune.tuner.search.sampler import Prior

    console = Console()
    progress: ReplayProgress | None = None  # the run so far, for a Ctrl-C's line
    try:
        landscape = Landscape.load(path)
        budget_s = parse_budget(budget, landscape) if budget else None
        if budget_s is None and trials is None:
            raise TuningError("a replay needs a budget: --budget 5% (of the brute-force "
                              "time), --budget 10m (simulated) or --trials N")
        if sampler not in SAMPLERS:
            raise TuningError(f"sampler {sampler!r} is unknown; expected one of "
                              f"{list(SAMPLERS)}")
        prior: Prior | None = None
        note = None
        if warm_start_from is not None:
            prior, note = warm_start_prior(landscape, Landscape.load(
                landscape.sibling(warm_start_from)))
        console.print(note or "no warm start (pass --warm-start-from DEVICE to use another "
                              "device's results)", highlight=False)
        progress = ReplayProgress(console)
        try:
            summary = replay(landscape, sampler=sampler, seed=seed, budget_s=budget_s,
                             trials=trials, prior=prior, warm_start=note, observer=progress)
        finally:
            progress.close()
    except (FlashtuneError, ValueError) as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:
        sofar = progress.summary if progress is not None else None
        done = (f" after {len(sofar.trace)} evaluations (best so far "
                f"{landscape.quality(sofar.best):.3f} of the optimum)") if sofar is not None else ""
        console.print()  # the live table's last line ends here
        Console(stderr=True).print(f"interrupted{done}: a replay writes nothing, so there is "
                                   "nothing to resume; rerun it to start again",
                                   highlight=False)
        raise typer.Exit(130) from None
    best = "-" if summary.best is None else f"{summary.best:.6g}"
    # T4 landscapes record their times in milliseconds (the "time" objective has no unit
    # of its own); another objective is named as it is recorded
    unit = " ms" if landscape.objective == "time" else ""
    share = 100 * summary.clock_s / landscape.brute_force_s
    console.print()
    console.print(f"{len(summary.trace)} evaluations ({summary.failures} failed) in "
                  f"{summary.clock_s / 60:.1f} simulated minutes ({share:.2f}% of the "
                  f"brute-force {landscape.brute_force_s / 3600:.2f} h); best "
                  f"{landscape.objective} {best}{unit}, optimum {landscape.optimum:.6g}{unit}: "
                  f"{landscape.quality(summary.best):.3f} of it", highlight=False)
    config = summary.best_config
    if config is not None:
        point = dict(zip(landscape.space.names, config, strict=True))
        console.print(f"best config: {landscape.space.key(point)}", highlight=False)


def parse_features(text: str | None) -> dict[str, bool]:
    """``--features window,softcap`` as Problem switches; TuningError naming the choices."""
    if not text:
        return {}
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in FEATURES]
    if unknown:
        raise TuningError(f"--features {text!r}: unknown {', '.join(unknown)}; expected a "
                          f"comma-separated subset of {', '.join(FEATURES)}")
    return dict.fromkeys(names, True)


def parse_shape_classes(text: str | None, defaults: tuple[str, ...]) -> tuple[str, ...]:
    """``--shape-classes``: the named classes ('none': none), ``defaults`` when not given
    (each is checked against the family when its buckets are made)."""
    if text is None:
        return defaults
    words = tuple(w.strip() for w in text.split(",") if w.strip())
    if words == ("none",):
        return ()
    if not words or "none" in words:
        raise TuningError(f"--shape-classes {text!r}: expected class words separated by "
                          "commas (e.g. g8q4p16,g1q1p0), or 'none'")
    return words


def _run_local(problem: Problem, lengths: tuple[int, ...], classes: tuple[str, ...],
               pairs: tuple[BatchHeads, ...], options: TuneOptions, db: str | None,
               progress: RichProgress, *, dry_arch: str | None) -> list[BucketSummary]:
    from flashtune.tuner.driver import tune
    from flashtune.tuner.measure.factory import DEFAULT_DRY_RUN_ARCH

    with progress:
        return tune(problem.head_dim, problem.dtypes, problem.causal, lengths, op=problem.op,
                    features=problem.features, dry_run=dry_arch is not None,
                    arch=dry_arch or DEFAULT_DRY_RUN_ARCH, db=db, options=options,
                    batch_heads=pairs, observer=progress, shape_classes=classes)


def _run_workers(problem: Problem, lengths: tuple[int, ...], classes: tuple[str, ...],
                 pairs: tuple[BatchHeads, ...], options: TuneOptions, db: str | None,
                 workers: int, progress: RichProgress) -> list[BucketSummary]:
    """One worker process per GPU; the live table follows the database."""
    import torch

    from flashtune.runtime.device import DeviceInfo
    from flashtune.tuner.measure.cuda import NO_GPU
    from flashtune.tuner.workers import WorkerSpec, tune_parallel

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise TuningError(NO_GPU)
    if workers > count:
        raise TuningError(f"--workers {workers} exceeds the {count} GPU(s) here: one worker "
                          "per GPU (timings on a shared GPU disturb each other)")
    info = DeviceInfo.current(0)
    spec = WorkerSpec(
        head_dim=problem.head_dim, dtype=problem.dtype.value, causal=problem.causal,
        kv_dtype=problem.dtypes.kv.value, o_dtype=problem.dtypes.o.value, op=problem.op,
        features=problem.features, seqlens=lengths, shape_classes=classes,
        db=db or "",
        measurer="cuda",
        batch_heads=tuple((p.batch, p.heads) for p in pairs), options=options)
    with progress:
        return tune_parallel(spec, workers, device=info.name, arch=info.spec,
                             gpus=list(range(workers)), observer=progress)


def report_command(
    db: DbOpt = None,
    out: Annotated[Path, typer.Option("--out", help="Output directory.")] = Path(
        "flashtune-report"),
    fmt: Annotated[str, typer.Option("--format", help="png or html.")] = "png",
    study: Annotated[str | None, typer.Option(
        "--study", help="Only buckets whose <device>/<bucket> or study name contains "
                        "this text.")] = None,
) -> None:
    """Plot the tuning results in a database, tuned or imported: the best so far per
    bucket, each bucket's B_r x B_c landscape per (warps, stages), and the winners."""
    from flashtune.commands.report import write_report
    from flashtune.db.engine import require_existing

    try:
        require_existing(db)  # a read command: never create a database on a mistyped path
        written = write_report(db, out, fmt, study_filter=study)
    except (FlashtuneError, ValueError) as exc:
        raise fail(str(exc)) from None
    for path in written:
        Console().print(f"wrote {path}")
