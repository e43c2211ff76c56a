"""The ``flashtune`` command line: one typer app; each command lives in flashtune/commands."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from flashtune import knobs
from flashtune._version import __version__
from flashtune.commands import codegen as codegen_commands
from flashtune.commands import perf_correlate
from flashtune.commands import profile as profile_commands
from flashtune.commands import runtime as runtime_commands
from flashtune.commands import tune as tune_commands
from flashtune.commands.check import check_command
from flashtune.commands.db import db_app

app = typer.Typer(
    name="flashtune",
    help="Autotuned, code-generated FlashAttention kernels for NVIDIA GPUs.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"flashtune {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """flashtune: generate, compile, verify, tune and serve attention kernels."""


@app.command("knobs")
def knobs_command() -> None:
    """List every environment variable flashtune reads, with its current value."""
    table = Table("variable", "value", "meaning")
    for knob in knobs.ALL:
        try:
            value = str(knob.get())
        except Exception as exc:  # a bad value is shown, not fatal, here
            value = f"INVALID ({exc})"
        table.add_row(knob.name, value if knob.is_set() else f"{value} (default)", knob.doc)
    Console().print(table)


# Command modules register themselves below, one line each.
app.add_typer(db_app, name="db")
app.command("families")(codegen_commands.families_command)
app.command("show")(codegen_commands.show)
app.command("compile")(codegen_commands.compile_command)
app.command("space")(codegen_commands.space_command)
app.command("check")(check_command)
app.command("profile")(profile_commands.profile)
app.command("explain")(runtime_commands.explain_command)
app.command("precompile")(runtime_commands.precompile_command)
app.command("tune")(tune_commands.tune_command)
app.command("report")(tune_commands.report_command)
app.command("correlate")(perf_correlate.correlate_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
