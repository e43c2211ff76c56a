"""benchmarks/gpu_check.sh: its dry run produces every output file, and its stage runner
records passes, failures, time-outs and budget exhaustion without losing other stages."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")


def _env(wheels: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["GC_WHEEL_DIR"] = str(wheels)
    env["FLASHTUNE_PYTHON"] = sys.executable
    env.pop("FLASHTUNE_GPU_CHECK_DRY", None)
    return env


def _run(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run with a wheel folder holding only a wheel for another platform (skipped), so the
    interpreter's own packages are used."""
    wheels = cwd / "wheels"
    wheels.mkdir(exist_ok=True)
    (wheels / "otherplatform-1.0-cp27-cp27m-win32.whl").write_bytes(b"not a zip")
    return subprocess.run(argv, capture_output=True, text=True, errors="replace",
                          env=_env(wheels), timeout=timeout, cwd=cwd)


def _summary(out: Path) -> dict[str, dict[str, str]]:
    with (out / "summary.tsv").open() as f:
        return {row["stage"]: row for row in csv.DictReader(f, delimiter="\t")}


def test_dry_run_writes_every_file(tmp_path: Path) -> None:
    out = tmp_path / "check"
    tarball = tmp_path / "back" / "check.tar.gz"
    proc = _run(["bash", str(SCRIPT), "--dry", "--tar", str(tarball), str(out)], tmp_path, 150)
    stages = _summary(out)
    assert list(stages) == ["install", "env", "gpu-tests", "tune-options", "sweep-plan",
                            "tune", "sweep", "host"], proc.stdout
    for name in ("install", "env", "tune-options", "sweep-plan"):
        assert stages[name]["status"] == "passed", (name, stages[name], proc.stdout)
    for name in ("gpu-tests", "tune", "sweep", "host"):
        assert stages[name]["status"] == "skipped"
        assert "dry run" in stages[name]["note"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The summary is the last thing printed, then the tarball line.
    assert "gpu_check summary" in proc.stdout and "packed" in proc.stdout.splitlines()[-1]
    with (out / "sweep" / "attention.csv").open() as f:
        plan = list(csv.DictReader(f))
    assert plan and {r["status"] for r in plan} == {"planned"}
    assert {(r["dtype"], r["head_dim"]) for r in plan} == {("bf16", "128")}
    assert '"date_utc"' in (out / "env.json").read_text()
    install = (out / "logs" / "install.log").read_text()
    assert "skipping otherplatform-1.0" in install and "imports ok" in install
    with tarfile.open(tarball) as tar:
        names = set(tar.getnames())
    for rel in ("summary.tsv", "env.json", "sweep/attention.csv", "logs/sweep-plan.log",
                "logs/tune-options.log"):
        assert f"check/{rel}" in names


def _run_stages(tmp_path: Path, script: str) -> subprocess.CompletedProcess[str]:
    body = f'source "{SCRIPT}"\n{script}\n'
    return _run(["bash", "-c", body], tmp_path, 60)


def test_stage_runner_keeps_going_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "o"
    proc = _run_stages(tmp_path, f"""
        GC_RESERVE_S=0 GC_MIN_STAGE_S=1
        gc_init "{out}" 40
        gc_stage ok 10 bash -c 'echo hello; echo result > "{out}/kept.txt"'
        gc_stage bad 10 bash -c 'echo something broke >&2; exit 3'
        gc_stage slow 2 sleep 30
        gc_stage after 10 true
        gc_finish ""
        echo "finish=$?"
    """)
    stages = _summary(out)
    assert stages["ok"]["status"] == "passed"
    assert (out / "kept.txt").read_text() == "result\n"
    assert (out / "logs" / "ok.log").read_text() == "hello\n"
    assert stages["bad"]["status"] == "failed"
    assert "exit 3" in stages["bad"]["note"] and "something broke" in stages["bad"]["note"]
    assert stages["slow"]["status"] == "timed out"
    assert 1 <= int(stages["slow"]["seconds"]) <= 5
    assert stages["after"]["status"] == "passed"
    assert "finish=1" in proc.stdout


def test_stage_runner_skips_when_the_budget_is_spent(tmp_path: Path) -> None:
    out = tmp_path / "o"
    proc = _run_stages(tmp_path, f"""
        GC_RESERVE_S=0
        gc_init "{out}" 3
        gc_stage late 10 true
        gc_finish ""
        echo "finish=$?"
    """)
    stages = _summary(out)
    assert stages["late"]["status"] == "skipped"
    assert "no time left" in stages["late"]["note"]
    assert "finish=0" in proc.stdout


@pytest.mark.parametrize("argv", [[], ["--budget", "5", "x"], ["--bogus", "x"]])
def test_bad_arguments(tmp_path: Path, argv: list[str]) -> None:
    proc = _run(["bash", str(SCRIPT), *argv], tmp_path, 30)
    assert proc.returncode == 2
    assert "error:" in proc.stderr
