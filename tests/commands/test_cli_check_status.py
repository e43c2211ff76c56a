"""`flashtune check` says on stderr what its long steps do (an emulator build takes 15-30 s
the first time) when stderr is a terminal, and prints nothing extra otherwise."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.commands import check
from flashtune.errors import FlashtuneError


def _slow_emulator(*args: object, **kwargs: object) -> None:
    time.sleep(0.5)  # the status line redraws meanwhile
    raise FlashtuneError("stand-in emulator: not run")


@pytest.mark.parametrize("terminal", [True, False])
def test_check_shows_a_status_line_on_a_terminal(monkeypatch: pytest.MonkeyPatch,
                                                 terminal: bool) -> None:
    monkeypatch.setattr(check, "run_in_emulator", _slow_emulator)
    env = {"COLUMNS": "200", "TTY_COMPATIBLE": "1" if terminal else "0"}
    result = CliRunner().invoke(app, ["check", "--head-dim", "64", "--no-compile",
                                      "--seqlen-q", "64"], env=env)
    assert result.exit_code == 1, result.output  # the stand-in's failure
    assert "stand-in emulator" in result.stderr
    shown = "building the emulated kernel (g++, 15-30 s the first time)" in result.stderr
    assert shown == terminal, result.stderr
    assert "building the emulated kernel" not in result.stdout
