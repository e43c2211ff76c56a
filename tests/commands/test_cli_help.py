"""``--help`` reads at 80 columns: every line fits, option help keeps a column of at least
45 characters, every default is printed whole, and the commands list gives each command's
first docstring paragraph as one text (not broken at the docstring's own line breaks)."""

from __future__ import annotations

import inspect

import pytest
import typer
from typer.core import TyperGroup, TyperOption
from typer.testing import CliRunner

from flashtune.cli import app

ENV = {"COLUMNS": "80", "NO_COLOR": "1"}


def _commands() -> list[tuple[str, ...]]:
    """The path of every command and group, e.g. ('tune',), ('db', 'show')."""
    paths: list[tuple[str, ...]] = []

    def walk(command: object, path: tuple[str, ...]) -> None:
        paths.append(path)
        if isinstance(command, TyperGroup):
            for name, sub in command.commands.items():
                walk(sub, (*path, name))

    walk(typer.main.get_command(app), ())
    return paths


def _help(*path: str) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env=ENV)
    assert result.exit_code == 0, result.output
    return result.output


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("path", _commands(), ids=lambda p: " ".join(p) or "flashtune")
def test_help_fits_80_columns_with_every_default_whole(path: tuple[str, ...]) -> None:
    text = _help(*path)
    for line in text.splitlines():
        assert len(line) <= 80, line
        if line.startswith(" " * 35) and line.strip():  # a help text squeezed to the right
            pytest.fail(f"help text starts beyond column 34: {line!r}")
    command = typer.main.get_command(app)
    for name in path:
        assert isinstance(command, TyperGroup)
        command = command.commands[name]
    for param in command.params:
        if not isinstance(param, TyperOption) or not param.show_default:
            continue
        default = param.default
        if default is None or default is False or isinstance(default, list | tuple):
            continue
        shown = param.secondary_opts[0].lstrip("-") if param.is_flag and param.secondary_opts \
            else str(getattr(default, "value", default))
        assert f"[default: {shown}" in _flat(text), (param.name, shown, text)


def test_tune_help_keeps_its_defaults_and_a_wide_help_column() -> None:
    text = _flat(_help("tune"))
    for default in ("[default: 1024,4096,16384]", "[default: guided]", "[default: 0.02]",
                    "(default: flashtune/<device>/<bucket>/<digest>)", "[default: no-causal]"):
        assert default in text, default


def test_main_help_gives_each_command_its_first_paragraph_whole() -> None:
    text = _flat(_help())
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    for name, command in group.commands.items():
        first = _flat(inspect.cleandoc(command.help or "").partition("\n\n")[0])
        assert f"{name} {first}" in text, (name, first)
