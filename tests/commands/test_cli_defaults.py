"""One default and one name per thing across the commands: the same --dtype default in
every command, FLASHTUNE_BACKEND's backend names in `db verify`, --trials of at least 1,
and messages that read right (explain's precompiled-cubin line, a head dim above 256)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.core import TyperGroup, TyperOption
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.codegen.spec import DType
from flashtune.commands.options import DEFAULT_DTYPE

runner = CliRunner()
ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


def _flat(text: str) -> str:
    return " ".join(text.split())


def _dtype_defaults() -> dict[str, object]:
    """Every command's --dtype default (multi-valued options, 'all of them', left out)."""
    found: dict[str, object] = {}

    def walk(command: object, path: str) -> None:
        if isinstance(command, TyperGroup):
            for name, sub in command.commands.items():
                walk(sub, f"{path} {name}".strip())
            return
        for param in getattr(command, "params", []):
            if isinstance(param, TyperOption) and "--dtype" in param.opts and not param.multiple:
                found[path] = getattr(param.default, "value", param.default)

    walk(typer.main.get_command(app), "")
    return found


def test_every_command_defaults_to_the_same_dtype() -> None:
    defaults = _dtype_defaults()
    assert {"tune", "show", "compile", "check", "profile", "explain", "space"} <= set(defaults)
    assert set(defaults.values()) == {DEFAULT_DTYPE.value}, defaults
    assert DEFAULT_DTYPE is DType.FP16


def test_db_verify_names_the_backends_as_flashtune_backend_does(tmp_path: Path) -> None:
    help_text = _flat(runner.invoke(app, ["db", "verify", "--help"], env=ENV).output)
    assert "cuda (the GPU)" in help_text and "gpu or" not in help_text
    db = tmp_path / "empty.db"
    assert runner.invoke(app, ["db", "--db", str(db), "upgrade"], env=ENV).exit_code == 0
    for name in ("auto", "cuda", "emulator", "gpu"):  # gpu: still accepted, as an alias
        result = runner.invoke(app, ["db", "--db", str(db), "verify", "--backend", name],
                               env=ENV)
        assert result.exit_code == 0 and "no best entries" in result.output, result.output
    bad = runner.invoke(app, ["db", "--db", str(db), "verify", "--backend", "rocm"], env=ENV)
    assert bad.exit_code == 2 and "expected auto, cuda or emulator" in _flat(bad.output)


@pytest.mark.parametrize("value", ["0", "-3"])
def test_trials_below_one_is_refused_with_the_fix(value: str, tmp_path: Path) -> None:
    result = runner.invoke(app, ["tune", "--head-dim", "64", "--dry-run", "--trials", value,
                                 "--db", str(tmp_path / "t.db")], env=ENV)
    assert result.exit_code == 2, result.output
    text = _flat(result.output)
    assert "--trials" in text and "measures nothing; give at least 1" in text
    assert not (tmp_path / "t.db").exists()


def test_explain_without_precompiled_dirs_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLASHTUNE_PRECOMPILED_DIR", raising=False)
    result = runner.invoke(app, ["explain", "--head-dim", "64", "--seqlen", "1024",
                                 "--arch", "sm_80"], env=ENV)
    assert result.exit_code == 0, result.output
    assert "in no FLASHTUNE_PRECOMPILED_DIR" not in result.output
    assert "FLASHTUNE_PRECOMPILED_DIR is not set" in result.output


def test_a_head_dim_above_256_names_the_limit_not_padding() -> None:
    result = runner.invoke(app, ["show", "--head-dim", "512"], env=ENV)
    assert result.exit_code == 2
    text = _flat(result.output)
    assert "at most 256" in text and "pad" not in text
    odd = _flat(runner.invoke(app, ["show", "--head-dim", "60"], env=ENV).output)
    assert "pad the head dim of q, k and v with zeros to 64" in odd
