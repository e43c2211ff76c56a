"""`flashtune compile`'s status: the count and an estimate before a long compile, and the
time left while it runs (in a log, where no progress bar is drawn)."""

from __future__ import annotations

import os
import sys

import pytest

from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.commands import codegen
from flashtune.commands.codegen import CompileStatus
from flashtune.families import render
from flashtune.toolchain.compiler import compile_pairs


def test_the_count_and_estimate_come_first_then_the_time_left(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # what codegen calls
    status = CompileStatus(3356, workers=2)
    status(0, 3300)
    first = " ".join(capsys.readouterr().err.split())
    # 3300 kernels x 1.5 s over 2 processes = 41.25 min
    assert "compiling 3300 of 3356 kernels (56 cached) in 2 process(es): about 41.2 min" in first
    monkeypatch.setattr(codegen, "STATUS_EVERY_S", 0.0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)  # codegen writes there
    status(1100, 3300)
    line = " ".join(capsys.readouterr().err.split())
    assert line.startswith("compiled 1100/3300 in ") and line.endswith(" left")
    status(0, 0)  # everything cached: nothing to estimate
    assert capsys.readouterr().err == ""


def test_compile_pairs_reports_the_plan_and_each_compilation() -> None:
    problem = Problem(64, DType.FP16, causal=False)
    source = render(problem, KernelConfig(64, 64, 4, 2))
    calls: list[tuple[int, int]] = []
    [result] = compile_pairs([(source, "sm_80")], 1, on_progress=lambda d, n: calls.append((d, n)))
    assert result.kernel is not None
    assert calls[0][0] == 0 and calls[-1][0] == calls[-1][1]  # the plan, then each one done
    assert [d for d, _ in calls] == list(range(len(calls)))
