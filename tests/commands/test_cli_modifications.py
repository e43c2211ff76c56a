"""``flashtune show --score-mod MODULE:FUNCTION --mask-mod ...``: the kernel with the traced
expression; an unsupported operation and a bad MODULE:FUNCTION are usage errors naming the
problem."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.codegen.spec import Problem
from flashtune.commands.modifications import with_modifications

runner = CliRunner()
ENV = {"COLUMNS": "200", "NO_COLOR": "1"}

MODULE = '''
import torch

def bias(score, b, h, q_idx, kv_idx):
    return score - 0.125 * torch.abs(q_idx - kv_idx)

def window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 64)

def bad(score, b, h, q_idx, kv_idx):
    return torch.sin(score)
'''


@pytest.fixture
def mods(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "cli_user_mods.py").write_text(MODULE)
    sys.path.insert(0, str(tmp_path))
    try:
        yield "cli_user_mods"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("cli_user_mods", None)


def test_show_prints_the_traced_expression(mods: str) -> None:
    result = runner.invoke(app, ["show", "--head-dim", "64", "--bindings", "--score-mod",
                                 f"{mods}:bias", "--mask-mod", f"{mods}:window"], env=ENV)
    assert result.exit_code == 0, result.output
    assert "struct ScoreMods" in result.output
    assert "(score - (0.125f * ((float)(ft::flex::iabs((q_idx - kv_idx))))))" in result.output
    assert "((q_idx >= kv_idx) && ((q_idx - kv_idx) < 64))" in result.output


def test_a_modification_keeps_the_problems_other_fields(mods: str) -> None:
    """The traced feature joins the problem's features; its element types per operand and
    V's head dim stay."""
    for problem in (Problem(128, "bf16", op="decode8", kv_dtype="e4m3", causal=True),
                    Problem(192, "bf16", head_dim_v=128)):
        modified = with_modifications(problem, f"{mods}:bias", None)
        assert (modified.dtypes, modified.head_dim_v, modified.causal, modified.op) == (
            problem.dtypes, problem.head_dim_v, problem.causal, problem.op)
        assert len(modified.features) == len(problem.features) + 1


def test_an_unsupported_operation_and_a_bad_name_are_usage_errors(mods: str) -> None:
    result = runner.invoke(app, ["show", "--score-mod", f"{mods}:bad"], env=ENV)
    assert result.exit_code == 2
    assert "sin()" in result.output and "cli_user_mods.py:11 in bad" in result.output
    result = runner.invoke(app, ["show", "--mask-mod", f"{mods}:missing"], env=ENV)
    assert result.exit_code == 2 and "has no function 'missing'" in result.output
    result = runner.invoke(app, ["show", "--mask-mod", "no_colon"], env=ENV)
    assert result.exit_code == 2 and "is not MODULE:FUNCTION" in result.output


@pytest.mark.emulator
def test_tune_verifies_and_stores_a_modification_as_its_own_bucket(mods: str,
                                                                   tmp_path: Path) -> None:
    """``tune --score-mod/--mask-mod --dry-run``: the traced problem is its own tuning key
    (``flex`` + digest), its candidates compile in this process and are verified against
    the modification's float64 reference in the emulator, and the trials are stored under
    that key; more than one worker is refused."""
    from flashtune.db import TuningStore

    db = f"sqlite:///{tmp_path / 't.db'}"
    args = ["tune", "--head-dim", "64", "--dtype", "fp16", "--seqlens", "128", "--trials",
            "1", "--score-mod", f"{mods}:bias", "--mask-mod", f"{mods}:window", "--db", db]
    result = runner.invoke(app, [*args, "--dry-run"], env=ENV)
    assert result.exit_code == 0, result.output
    with TuningStore(db) as store:
        trials = store.trials()
    assert trials and {t.problem.key.rsplit("_", 1)[-1][:4] for t in trials} == {"flex"}
    assert any(t.status.value == "verified_untimed" for t in trials), trials
    refused = runner.invoke(app, [*args, "--workers", "2"], env=ENV)
    assert refused.exit_code == 1 and "--workers 1" in " ".join(refused.output.split())
