"""The ``flashtune`` command line: one typer app; each command lives in flashtune/commands."""

from __future__ import annotations

import inspect

import typer
from rich.console import Console
from rich.table import Table

from flashtune import settings
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
    # click's plain help: at 80 columns rich's panels squeeze the help of `tune` into a
    # 20-character column and cut long defaults; click's keeps a 30-column option column.
    rich_markup_mode=None,
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


@app.command("settings")
def settings_command() -> None:
    """List every environment variable flashtune reads, with its current value."""
    table = Table("variable", "value", "meaning")
    for setting in settings.ALL:
        try:
            value = str(setting.get())
        except Exception as exc:  # a bad value is shown, not fatal, here
            value = f"INVALID ({exc})"
        table.add_row(setting.name, value if setting.is_set() else f"{value} (default)",
                      setting.doc)
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


def _summary(doc: str | None) -> str:
    """The first paragraph of a docstring as one line (its own line breaks dropped)."""
    return " ".join(inspect.cleandoc(doc or "").partition("\n\n")[0].split())


def _one_line_summaries(group: typer.Typer) -> None:
    """Give every command of ``group`` (and its subgroups) its docstring's first paragraph
    as the short help of the commands list, whole: click would otherwise cut it to one
    line with '...'."""
    for command in group.registered_commands:
        if command.short_help is None and command.callback is not None:
            command.short_help = _summary(command.callback.__doc__)
    for sub in group.registered_groups:
        instance = sub.typer_instance
        if instance is None:
            continue
        if not isinstance(sub.short_help, str):  # unset: typer's DefaultPlaceholder
            help_text = sub.help if isinstance(sub.help, str) else instance.info.help
            sub.short_help = _summary(help_text if isinstance(help_text, str) else None)
        _one_line_summaries(instance)


_one_line_summaries(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
