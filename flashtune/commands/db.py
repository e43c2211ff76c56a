"""``flashtune db ...``: inspect, upgrade, export, import and merge the tuning database.

Every command takes ``--db URL`` (before the command name: ``flashtune db --db URL list``);
the default is the setting FLASHTUNE_DB. Failures print one message and exit with status 1.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from flashtune.codegen.spec import Problem, ProblemBucket
from flashtune.commands.fit import print_rows
from flashtune.commands.options import DbOpt, fail
from flashtune.db.records import (
    PREFER_CHOICES,
    BestEntry,
    Prefer,
    Provenance,
    TrialRecord,
    TrialStatus,
    printable,
)
from flashtune.errors import DatabaseError, FlashtuneError

if TYPE_CHECKING:  # SQLAlchemy (and torch, for the installed kernels) load when a command runs
    from flashtune.db.sharing import ShareReport
    from flashtune.db.store import TuningStore

db_app = typer.Typer(name="db", no_args_is_help=True, rich_markup_mode=None,
                     help="Inspect, upgrade, export, import and merge the tuning database.")


def _out() -> Console:
    # Made per call, so that the terminal width (COLUMNS) is read when printing.
    return Console()

PreferOpt = Annotated[str, typer.Option(
    "--prefer", help="Per bucket keep: local-first (the faster, but never displace a "
    "result measured here), faster, ours or theirs: " + "|".join(PREFER_CHOICES))]
MixedOpt = Annotated[bool, typer.Option(
    "--allow-mixed-digests",
    help="Merge even where results were measured on different kernel sources.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Report what would change; write "
                                                           "nothing.")]
TrustOpt = Annotated[bool, typer.Option(
    "--trust", help="Trust this source: its results of other devices may then serve this "
                    "one through the fallback (same_arch) tier. Without it they serve only "
                    "their own device (or what FLASHTUNE_TRUSTED_SOURCES names).")]


@db_app.callback()
def _db(ctx: typer.Context, db: DbOpt = None) -> None:
    """The tuning database (devices, trials, best config per device and bucket)."""
    ctx.obj = db


def _open(ctx: typer.Context, db: str | None, *, create: bool = True) -> TuningStore:
    """The store named by the command's --db, else the group's --db, else the setting FLASHTUNE_DB.

    ``create=False`` (the read commands) refuses a missing file and opens read-only.
    """
    from flashtune.db.store import TuningStore
    from flashtune.runtime.installed import installed_digest

    try:
        return TuningStore(db if db is not None else ctx.obj, create=create,
                           installed=installed_digest)
    except FlashtuneError as exc:
        raise fail(exc) from None


@contextmanager
def _target(ctx: typer.Context, db: str | None, dry_run: bool) -> Iterator[TuningStore]:
    """The database an import or a merge writes. A dry run must write nothing, so for a
    SQLite file that does not exist yet it reads an empty stand-in in a temporary
    directory instead (everything then counts as added) and never creates the file."""
    from flashtune.db.engine import resolve_url, sqlite_file

    try:
        path = sqlite_file(resolve_url(db if db is not None else ctx.obj))
    except FlashtuneError as exc:
        raise fail(exc) from None
    if not dry_run or path is None or path.exists():
        with _open(ctx, db) as store:
            yield store
        return
    with tempfile.TemporaryDirectory(prefix="flashtune-dry-run-") as scratch, \
            _open(ctx, str(Path(scratch) / "empty.db")) as store:
        yield store


def _prefer(value: str) -> Prefer:
    for choice in PREFER_CHOICES:
        if value == choice:
            return choice
    raise typer.BadParameter(f"{value!r}; expected one of {list(PREFER_CHOICES)}",
                             param_hint="--prefer")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _when(value: datetime) -> str:
    return value.strftime("%Y-%m-%d %H:%M")


def _table(*columns: str, title: str | None = None) -> Table:
    return Table(*columns, title=title, title_justify="left")


def _cells(*cells: object) -> list[str]:
    # Names and error messages from a database are printed as Text (never read as rich
    # markup), with bidi or line-separator characters shown escaped.
    return [printable(str(cell)) for cell in cells]


def _row(table: Table, *cells: object) -> None:
    table.add_row(*(Text(cell) for cell in _cells(*cells)))


def _source(provenance: Provenance | None) -> str:
    if provenance is None:
        return "local"
    trust = "trusted" if provenance.trusted else "untrusted"
    return f"import {provenance.bundle_sha256[:12]} ({trust})"


def _state(entry: BestEntry) -> str:
    """How the entry stands on the installed kernel sources (only the first two serve)."""
    from flashtune.runtime.installed import serving_state

    return {"current": "served", "reverified": "served (re-verified)", "stale": "stale",
            "failed": "FAILED verify"}[serving_state(entry)]


_BEST_COLUMNS = ("device", "arch", "bucket", "config", "median ms", "TFLOP/s", "digest",
                 "state", "source", "host", "measured")


def _print_best(entries: list[BestEntry], title: str) -> None:
    rows = []
    for entry in entries:
        trial = entry.trial
        rows.append(_cells(entry.device, entry.arch, trial.bucket, entry.config.key,
                           _ms(trial.median_ms),
                           "-" if trial.tflops is None else f"{trial.tflops:.1f}",
                           trial.template_digest[:12], _state(entry),
                           _source(entry.provenance), trial.host, _when(trial.created_at)))
    print_rows(_out(), title, _BEST_COLUMNS, rows)


@db_app.command("info")
def info_command(ctx: typer.Context, db: DbOpt = None) -> None:
    """Print the database URL, its schema version and how many rows each table holds."""
    store = _open(ctx, db, create=False)
    with store:
        problems = store.integrity_problems()
        if problems:
            shown = "\n  ".join(printable(p) for p in problems[:10])
            raise fail(DatabaseError(
                f"{store.where} failed SQLite's integrity check:\n  {shown}\nRestore it from "
                "a backup (or export what still reads and import it into a new database)"))
        try:
            counts = store.counts()
        except FlashtuneError as exc:
            raise fail(exc) from None
        _out().print(Text(printable(f"database: {store.where}\nschema revision: "
                                    f"{store.schema.current}\nintegrity: ok")))
        table = _table("table", "rows")
        for name, count in counts.items():
            _row(table, name, count)
        _out().print(table)


@db_app.command("upgrade")
def upgrade_command(ctx: typer.Context, db: DbOpt = None) -> None:
    """Migrate the database to this flashtune's schema (back it up first)."""
    from flashtune.db.engine import make_engine, resolve_url
    from flashtune.db.schema import ensure_schema, schema_state

    try:
        url = resolve_url(db if db is not None else ctx.obj)
        engine = make_engine(url, create=True)
        try:
            before = schema_state(engine).current
            after = ensure_schema(engine, create=True, upgrade=True).current
        finally:
            engine.dispose()
    except FlashtuneError as exc:
        raise fail(exc) from None
    if before == after:
        _out().print(Text(f"schema revision {after}: already up to date"))
    else:
        _out().print(Text(f"schema revision {before or 'none'} -> {after}"))


@db_app.command("list")
def list_command(
    ctx: typer.Context,
    db: DbOpt = None,
    device: Annotated[str | None, typer.Option("--device", help="Only this device.")] = None,
    problem: Annotated[str | None, typer.Option(
        "--problem", help="Only this problem key, e.g. fwd_d128_bf16_causal.")] = None,
) -> None:
    """List the devices and the best config of every (device, bucket)."""
    with _open(ctx, db, create=False) as store:
        try:
            devices = store.devices([device] if device else [])
            entries = store.best_entries(device=device, problem=problem)
        except FlashtuneError as exc:
            raise fail(exc) from None
    print_rows(_out(), "devices", ("device", "arch", "SMs", "memory GiB", "driver", "CUDA",
                                   "NVRTC", "CuPy"),
               [_cells(d.name, d.arch, d.sm_count, f"{d.memory_bytes / 2**30:.1f}",
                       d.driver_version, d.cuda_version, d.nvrtc_version, d.cupy_version)
                for d in devices])
    _print_best(entries, f"best configs ({len(entries)})")


@db_app.command("show")
def show_command(
    ctx: typer.Context,
    bucket: Annotated[str, typer.Argument(
        metavar="BUCKET", help="Bucket key, e.g. fwd_d128_bf16_causal_n4096.")],
    db: DbOpt = None,
    device: Annotated[str | None, typer.Option("--device", help="Only this device.")] = None,
    status: Annotated[TrialStatus | None, typer.Option(
        "--status", metavar="STATUS",
        help=f"Only this status: {', '.join(s.value for s in TrialStatus)}.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many trials.")] = 50,
) -> None:
    """Show the best configs and the trials of one bucket, fastest first."""
    try:
        parsed = ProblemBucket.from_key(bucket)
    except FlashtuneError as exc:
        raise typer.BadParameter(str(exc), param_hint="BUCKET") from None
    problem, seqlen = parsed.problem.key(), parsed.seqlen
    with _open(ctx, db, create=False) as store:
        try:
            best = store.best_entries(device=device, problem=problem, seqlen=seqlen)
            trials = store.trials(device=device, problem=problem, seqlen=seqlen, status=status)
            trials.sort(key=_speed_order)
            origins = store.provenance([t.uid for t in trials[:limit]])
        except FlashtuneError as exc:
            raise fail(exc) from None
    _print_best(best, f"best for {bucket}")
    for entry in best:
        _out().print(Text(printable(f"{entry.device}: {entry.origin} ({_state(entry)})")))
    columns = ("device", "config", "status", "median ms", "min", "max", "n", "TFLOP/s",
               "predicted", "digest", "source", "host", "study", "measured", "error")
    rows = [_cells(t.device, t.config.key, t.status.value, _ms(t.median_ms), _ms(t.min_ms),
                   _ms(t.max_ms), t.count, "-" if t.tflops is None else f"{t.tflops:.1f}",
                   _ms(t.predicted_ms), t.template_digest[:12], _source(origins.get(t.uid)),
                   t.host, t.study or "-", _when(t.created_at), (t.error or "").strip())
            for t in trials[:limit]]
    print_rows(_out(), f"trials ({min(limit, len(trials))} of {len(trials)})", columns, rows,
               notes=("error",))


def _speed_order(trial: TrialRecord) -> tuple[bool, float, str]:
    return (trial.median_ms is None, trial.median_ms or 0.0, trial.config.key)


def _print_report(report: ShareReport, what: str) -> None:
    note = "dry run, nothing written" if report.dry_run else "written"
    print_rows(_out(), f"{what} ({note})", ("kind", "added", "updated", "skipped"),
               [_cells(*row) for row in report.rows()])
    if report.provenance is not None:
        _out().print(Text(printable(f"provenance: {report.provenance.describe()}")))
    if report.stale:
        _out().print(Text(f"{report.stale} trial(s) were measured on other kernel sources than "
                          "this flashtune's: kept, but stale (never served until re-measured "
                          "or re-verified with `flashtune db verify`)", style="yellow"))
    if report.kept_local:
        _out().print(Text(f"{report.kept_local} bucket(s) kept the best measured here over "
                          "the imported one (pass --prefer faster or --prefer theirs to let "
                          "imported results displace local measurements)"))
    if report.digest_conflicts:
        _out().print(Text(f"merged despite {len(report.digest_conflicts)} template digest "
                        "differences:", style="yellow"))
        for conflict in report.digest_conflicts:
            _out().print(Text("  " + conflict.describe()))


@db_app.command("export")
def export_command(
    ctx: typer.Context,
    output: Annotated[Path, typer.Option("-o", "--output", help="Bundle file to write.")],
    db: DbOpt = None,
    device: Annotated[list[str] | None, typer.Option(
        "--device", help="Only this device (repeatable).")] = None,
    problem: Annotated[list[str] | None, typer.Option(
        "--problem", help="Only this problem key (repeatable).")] = None,
    best_only: Annotated[bool, typer.Option(
        "--best-only", help="Only the best trial of each bucket, no other trials.")] = False,
) -> None:
    """Write a self-describing JSON bundle of tuning results for sharing."""
    from flashtune.db.bundle import write_bundle
    from flashtune.db.sharing import export_bundle

    for key in problem or []:
        try:
            Problem.from_key(key)
        except FlashtuneError as exc:
            raise typer.BadParameter(str(exc), param_hint="--problem") from None
    with _open(ctx, db, create=False) as store:
        try:
            bundle = export_bundle(store, devices=device or [], problems=problem or [],
                                   best_only=best_only)
            write_bundle(bundle, output)
        except (FlashtuneError, OSError) as exc:
            raise fail(exc) from None
    _out().print(Text(printable(f"wrote {output}: {len(bundle.devices)} devices, "
                                f"{len(bundle.trials)} trials, {len(bundle.best)} best "
                                "entries")))


@db_app.command("import")
def import_command(
    ctx: typer.Context,
    bundle_path: Annotated[Path | None, typer.Argument(
        metavar="BUNDLE", help="Bundle file to read (or --sample).")] = None,
    db: DbOpt = None,
    prefer: PreferOpt = "local-first",
    allow_mixed_digests: MixedOpt = False,
    dry_run: DryRunOpt = False,
    trust: TrustOpt = False,
    sample: Annotated[bool, typer.Option(
        "--sample", help="Import the sample bundle shipped with flashtune instead of a file: "
        "results DERIVED from published H100 figures, not measured, for trying sharing "
        "without a GPU (served only when imported with --trust).")] = False,
) -> None:
    """Validate a bundle completely, then add its results in one transaction, with their
    provenance (bundle digest, time of import, claimed origin)."""
    from flashtune.db.bundle import read_bundle
    from flashtune.db.samples import SAMPLE_BUNDLE, SAMPLE_SOURCE
    from flashtune.db.sharing import import_bundle

    choice = _prefer(prefer)
    if (bundle_path is None) == (not sample):
        raise typer.BadParameter("give a bundle file or --sample (one of them); e.g. "
                                 "`flashtune db import h100.json` or "
                                 "`flashtune db import --sample`", param_hint="BUNDLE")
    path = SAMPLE_BUNDLE if bundle_path is None else bundle_path
    try:
        bundle = read_bundle(path)
    except FlashtuneError as exc:
        raise fail(exc) from None
    with _target(ctx, db, dry_run) as store:
        try:
            report = import_bundle(store, bundle, prefer=choice,
                                   allow_mixed_digests=allow_mixed_digests, dry_run=dry_run,
                                   source=SAMPLE_SOURCE if sample else str(path),
                                   trusted=trust)
        except FlashtuneError as exc:
            raise fail(exc) from None
    _print_report(report, f"import of {'the sample bundle' if sample else path}")


@db_app.command("merge")
def merge_command(
    ctx: typer.Context,
    other: Annotated[str, typer.Argument(help="The other database: URL or SQLite file path.")],
    db: DbOpt = None,
    prefer: PreferOpt = "local-first",
    allow_mixed_digests: MixedOpt = False,
    dry_run: DryRunOpt = False,
    trust: TrustOpt = False,
) -> None:
    """Merge another database's results into this one, keeping provenance."""
    from flashtune.db.sharing import merge_databases
    from flashtune.db.store import TuningStore

    choice = _prefer(prefer)
    try:
        source = TuningStore(other, create=False)
    except FlashtuneError as exc:
        raise fail(exc) from None
    with source, _target(ctx, db, dry_run) as store:
        try:
            report = merge_databases(store, source, prefer=choice,
                                     allow_mixed_digests=allow_mixed_digests, dry_run=dry_run,
                                     trusted=trust)
        except FlashtuneError as exc:
            raise fail(exc) from None
    _print_report(report, f"merge of {source.where}")


@db_app.command("verify")
def verify_command(
    ctx: typer.Context,
    db: DbOpt = None,
    device: Annotated[list[str] | None, typer.Option(
        "--device", help="Only this device (repeatable).")] = None,
    problem: Annotated[list[str] | None, typer.Option(
        "--problem", help="Only this problem key (repeatable).")] = None,
    backend: Annotated[str, typer.Option(
        "--backend", help="auto (the GPU if there is one, else the emulator), cuda (the "
                          "GPU) or emulator, as FLASHTUNE_BACKEND names them.")] = "auto",
) -> None:
    """Re-check the configs this database serves on the installed kernels: numerics in the
    CPU emulator without a GPU, numerics and timing on a GPU. Records each verdict (a pass
    makes a stale entry servable again, a failure stops it being served); exits with
    status 1 if any check fails."""
    from flashtune.commands.db_verify import (
        RESULT_COLUMNS,
        Checked,
        measurer_for,
        result_cells,
        verify_store,
    )
    from flashtune.db.store import TuningStore
    from flashtune.tuner.measure.factory import measurer_names

    # one spelling, FLASHTUNE_BACKEND's (auto, cuda, emulator); the measurers' other names
    # (gpu, dry-run) are still accepted
    if backend not in ("auto", *measurer_names()):
        raise typer.BadParameter(f"{backend!r}; expected auto, cuda or emulator",
                                 param_hint="--backend")
    with _open(ctx, db, create=False) as reader:
        where = reader.url
        try:
            entries = [e for e in reader.best_entries()
                       if (not device or e.device in device)
                       and (not problem or e.problem in problem)]
        except FlashtuneError as exc:
            raise fail(exc) from None
    if not entries:
        _out().print("no best entries to verify")
        return
    try:
        factory, cap = measurer_for(backend)
        # a status line on stderr (a terminal only): an emulator build takes 15-30 s
        with TuningStore(where) as store, Console(stderr=True).status(
                f"verifying {len(entries)} config(s): NVRTC, then the emulator or the GPU"
                ) as status:
            seen: list[Checked] = []

            def done(checked: Checked) -> None:
                seen.append(checked)
                status.update(f"verified {len(seen)} of {len(entries)} config(s)")

            results = verify_store(store, entries, factory, verify_cap=cap, on_result=done)
    except FlashtuneError as exc:
        raise fail(exc) from None
    print_rows(_out(), f"verification of {len(entries)} served config(s)", RESULT_COLUMNS,
               [result_cells(r) for r in results], notes=("detail",))
    failed = sum(not r.passed for r in results)
    _out().print(Text(f"{len(results) - failed} passed, {failed} failed"))
    if failed:
        raise typer.Exit(1)
