"""benchmarks/gpu_check.sh: its dry run produces every output file, and its stage runner
records passes, failures, time-outs and budget exhaustion without losing other stages."""

from __future__ import annotations

import csv
import os
import re
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


DRY_STAGES = ["install", "env", "nvidia-smi", "canary-list", "canary", "serving-plan",
              "serving", "smoke-compile", "smoke", "backward-plan", "backward",
              "precompile-d64",
              "precompile", "gpu-tests-collect", "gpu-tests", "gpu-tests-tuner",
              "tune-options", "tune", "sweep-plan", "sweep", "decode-plan", "decode", "host"]


@pytest.mark.slow  # eleven interpreters and every smoke kernel's compile: about 40 s of CPU
def test_dry_run_writes_every_file(tmp_path: Path) -> None:
    out = tmp_path / "check"
    tarball = tmp_path / "back" / "check.tar.gz"
    proc = _run(["bash", str(SCRIPT), "--dry", "--tar", str(tarball), str(out)], tmp_path, 300)
    stages = _summary(out)
    assert list(stages) == DRY_STAGES, proc.stdout
    for name in ("install", "env", "canary-list", "serving-plan", "smoke-compile",
                 "backward-plan", "precompile-d64", "gpu-tests-collect", "tune-options",
                 "sweep-plan", "decode-plan"):
        assert stages[name]["status"] == "passed", (name, stages[name], proc.stdout)
    for name in ("canary", "serving", "smoke", "backward", "precompile", "gpu-tests",
                 "gpu-tests-tuner", "tune", "sweep", "decode", "host"):
        assert stages[name]["status"] == "skipped"
        assert "dry run" in stages[name]["note"]
    assert stages["nvidia-smi"]["status"] in ("passed", "skipped")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The plan with its caps comes first; the smoke lines, then the summary, then the tarball.
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("stage plan (caps in seconds; budget 780 s)")
    assert any(line.split() == ["smoke", "30", *line.split()[2:]] for line in lines[:15])
    summary = lines.index(next(line for line in lines if "gpu_check summary" in line))
    for family in ("forward", "lse"):  # one smoke line per kernel family
        smoke = [i for i, line in enumerate(lines)
                 if line.startswith(f"  smoke {family} ") and "compiled for sm_90" in line]
        assert smoke and smoke[-1] < summary, proc.stdout
    assert "packed" in lines[-1]
    # the canary's kernels (the sm_90a forward's, then the backward's, as a cc 9.0 GPU
    # serves them), the plan of the serving forward at full-chip shapes
    said = (out / "logs" / "canary-list.log").read_text().split()
    listed = [word for word in said if word.startswith("flashtune_")]  # logs aside
    kinds = [e.split("_")[1] for e in listed]
    assert kinds and set(kinds) == {"fwd90aws", "bwd90a", "bwd90adet"}, said
    assert kinds == sorted(kinds, key=lambda op: not op.startswith("fwd")), said
    serving = (out / "logs" / "serving-plan.log").read_text()
    assert "18 cases x serving, sdpa-flash, sdpa-cudnn, pingpong, overlap, n176" in serving
    assert "b4 h16 n8192 d256 full" in serving
    with (out / "sweep" / "attention.csv").open() as f:
        plan = list(csv.DictReader(f))
    assert plan and {r["status"] for r in plan} == {"planned"}
    assert {(r["dtype"], r["head_dim"]) for r in plan} == {("bf16", "128")}
    with (out / "backward" / "attention.csv").open() as f:  # the training step's line
        plan = list(csv.DictReader(f))
    assert {(r["pass"], r["head_dim"], r["causal"], r["seqlen"]) for r in plan} == {
        ("fwdbwd", "128", "True", "8192"), ("fwdbwd", "64", "True", "8192")}, plan
    assert '"date_utc"' in (out / "env.json").read_text()
    install = (out / "logs" / "install.log").read_text()
    assert "skipping otherplatform-1.0" in install and "imports ok" in install
    assert "requirements of a GPU run:" in install and "  optuna " in install
    collected = (out / "logs" / "gpu-tests-collect.log").read_text()
    assert "tests/tuner/test_tuner_gpu.py::" in collected
    assert "tests/api/test_api_gpu.py::" in collected
    with tarfile.open(tarball) as tar:
        names = set(tar.getnames())
    for rel in ("summary.tsv", "env.json", "sweep/attention.csv", "logs/sweep-plan.log",
                "logs/tune-options.log", "logs/smoke-compile.log"):
        assert f"check/{rel}" in names


def _source(script: str) -> str:
    return f'source "{SCRIPT}"\n{script}\n'


def test_the_plan_fits_the_default_budget(tmp_path: Path) -> None:
    proc = _run(["bash", "-c", _source('echo "$(gc_plan_total) $GC_DEFAULT_BUDGET"\n'
                                       'printf "%s\\n" "${GC_PLAN[@]}"')], tmp_path, 30)
    first, *plan = proc.stdout.splitlines()
    total, budget = map(int, first.split())
    caps = {line.split("|")[0]: int(line.split("|")[1]) for line in plan}
    # 13 minutes, the install included: a 15-minute device allowance keeps 2 for the start
    assert budget == 780 and total <= budget
    assert total == sum(caps.values()) + 15
    # on a GPU: the canary first, then the serving forward's timings, then the rest
    assert list(caps)[:6] == ["install", "env", "nvidia-smi", "canary", "serving", "smoke"]
    assert caps["smoke"] <= 30 and caps["gpu-tests-tuner"] >= 60
    shown = _run(["bash", str(SCRIPT), "--plan"], tmp_path, 30).stdout
    for name, cap in caps.items():
        assert re.search(rf"^  {re.escape(name)} +{cap} ", shown, re.M), shown
    assert re.search(rf"^  total +{total}$", shown, re.M)


def test_a_failing_canary_turns_the_arch_specific_kernels_off_for_later_stages(
        tmp_path: Path) -> None:
    """Each forward kernel's check in its own process (the backward's together in one): one
    that never ends is killed at its cap, the canary fails naming it, and the stages after
    it run with FLASHTUNE_ARCH_SPECIFIC=0 (the summary says so)."""
    fake = tmp_path / "fake-python"
    fake.write_text("#!/usr/bin/env bash\n"
                    'case "$*" in\n'
                    '  *--list*) echo k-good; echo k-hung; echo k_bwd_a; echo k_bwd_b ;;\n'
                    '  *--compile-only*) echo compiled ;;\n'
                    '  *"--only k-hung"*) sleep 60 ;;\n'
                    '  *"--only k_bwd_a --only k_bwd_b"*) exit 0 ;;\n'
                    '  *k_bwd*) exit 3 ;;\n'
                    "esac\n")
    fake.chmod(0o755)
    out = tmp_path / "o"
    proc = _run_stages(tmp_path, f"""
        GC_RESERVE_S=0 GC_MIN_STAGE_S=1
        export GC_CANARY_KERNEL_S=2 GC_PY="{fake}"
        gc_init "{out}" 50
        gc_stage canary 30 bash "{SCRIPT}" --internal-canary "{out}/canary.status"
        gc_after_canary "{out}/canary.status"
        gc_stage later 10 bash -c 'echo "arch-specific=$FLASHTUNE_ARCH_SPECIFIC"'
        gc_finish ""
    """)
    stages = _summary(out)
    assert stages["canary"]["status"] == "failed", proc.stdout
    log = (out / "logs" / "canary.log").read_text()
    assert "canary k-good: pass" in log and "canary k-hung: killed after 2s" in log, log
    # the backward's kernels are checked together, in one process
    assert "canary the backward's 2 kernels: pass" in log, log
    assert stages["arch-specific"]["status"] == "off"
    assert "k-hung (killed after 2s)" in stages["arch-specific"]["note"]
    assert "FLASHTUNE_ARCH_SPECIFIC=0" in stages["arch-specific"]["note"]
    assert (out / "logs" / "later.log").read_text() == "arch-specific=0\n"
    # a canary that passes leaves them on
    (out / "canary.status").write_text("ok\n")
    again = _run_stages(tmp_path, f"""
        gc_init "{tmp_path / 'o2'}" 50
        gc_after_canary "{out}/canary.status"; echo "arch-specific=${{FLASHTUNE_ARCH_SPECIFIC:-on}}"
    """)
    assert "arch-specific=on" in again.stdout


def test_gpu_arch_comes_from_env_json(tmp_path: Path) -> None:
    out = tmp_path / "o"
    proc = _run(["bash", "-c", _source(f"""
        gc_init "{out}" 60; GC_PY="{sys.executable}"
        echo '{{"gpu": "NVIDIA H200", "gpu_capability": "9.0"}}' > "{out}/env.json"
        echo "arch=$(gc_gpu_arch)"
        echo '{{"gpu": null}}' > "{out}/env.json"
        echo "none=$(gc_gpu_arch)"
    """)], tmp_path, 60)
    assert "arch=sm_90" in proc.stdout and "none=\n" in proc.stdout + "\n"


def test_pytest_stage_reports_at_its_cap_even_with_sigint_ignored(tmp_path: Path) -> None:
    """At the cap pytest gets SIGINT and still writes its junit report, also when the run
    was started with SIGINT ignored (a background job)."""
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_slow.py").write_text(
        "import time\n\ndef test_fast():\n    pass\n\n"
        "def test_slow():\n    time.sleep(120)\n")
    out = tmp_path / "o"
    junit = out / "r.xml"
    cap = 8  # room for pytest to start on a loaded machine (no plugins: starts faster)
    proc = _run(["bash", "-c", "trap '' INT\n" + _source(f"""
        GC_RESERVE_S=0 GC_MIN_STAGE_S=1 GC_PY="{sys.executable}"
        gc_init "{out}" 60
        GC_STAGE_SIGNAL=INT PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 gc_stage t {cap} "$GC_PY" \\
          -m pytest -q -p no:cacheprovider --junitxml="{junit}" "{tests}"
        gc_finish ""
    """)], tmp_path, 90)
    stages = _summary(out)
    assert stages["t"]["status"] == "timed out", proc.stdout
    # stopped by SIGINT at the cap, not by the KILL that follows 10 s later
    assert int(stages["t"]["seconds"]) < cap + 10
    log = (out / "logs" / "t.log").read_text()
    assert "KeyboardInterrupt" in log, log
    assert 'name="test_fast"' in junit.read_text()


def _run_stages(tmp_path: Path, script: str) -> subprocess.CompletedProcess[str]:
    return _run(["bash", "-c", _source(script)], tmp_path, 60)


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

