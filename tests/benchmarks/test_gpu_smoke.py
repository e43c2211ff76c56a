"""benchmarks/gpu_smoke.py: the case table, the runner's per-case isolation and budget, the
dry mode's compile check; the forward case itself on a GPU."""

from __future__ import annotations

import gpu_smoke
import pytest
import torch
from _attention_impls import Timer
from _common import Deadline
from attention import Shape

from flashtune import families


def test_the_forward_is_first_and_every_family_has_a_line() -> None:
    first = gpu_smoke.SMOKE_CASES[0]
    assert first.family == "forward" and first.run is gpu_smoke.forward_smoke
    assert first.compile_args == ("--op", "fwd", "--head-dim", "128", "--dtype", "bf16",
                                  "--no-causal")
    others = [c.family for c in gpu_smoke.SMOKE_CASES[1:]]
    assert others == [f.op for f in families.all_families() if f.op != "fwd"]
    assert "lse" in others  # the second family has its own line


def test_a_family_line_verifies_and_times_its_default_kernel() -> None:
    """The steps of a family's line, on the CPU emulator: verified against the float64
    reference on poisoned outputs, then timed (CPU time: plumbing, not performance)."""
    run = gpu_smoke.family_smoke("lse", (1, 2, 40, 32), backend="emulator")
    outcome = run(Timer("cpu", 1, 2))
    assert outcome.passed, outcome.summary
    assert outcome.summary.startswith("PASS error ") and "vs float64" in outcome.summary
    assert 0 <= outcome.details["rel_err"] < 1e-3 and outcome.details["median_ms"] > 0


@pytest.mark.parametrize("op, head_dim", [("fwd8", 64), ("mla", 64)])
def test_a_family_with_its_own_types_or_head_dims_gets_a_line_it_runs(op: str,
                                                                       head_dim: int) -> None:
    """The FP8 forward's line takes bf16 as O's type (e4m3 inputs); MLA's its head dim of 64
    (the RoPE dims); each verifies on the emulator as a virtual sm_90."""
    assert gpu_smoke.family_head_dim(op) == (128 if op == "fwd8" else 64)
    case = next(c for c in gpu_smoke.SMOKE_CASES if c.family == op)
    assert f"d{gpu_smoke.family_head_dim(op)} " in case.description
    outcome = gpu_smoke.family_smoke(op, (1, 2, 40, head_dim), backend="emulator")(
        Timer("cpu", 1, 1))
    assert outcome.passed, outcome.summary


def _case(family: str, run: gpu_smoke.SmokeRun) -> gpu_smoke.SmokeCase:
    return gpu_smoke.SmokeCase(family, "tiny", ("--head-dim", "64"), run)


def test_each_case_prints_its_line_and_fails_alone(capsys: pytest.CaptureFixture[str]) -> None:
    def broken(timer: Timer) -> gpu_smoke.SmokeOutcome:
        raise RuntimeError("no kernel image is available\nsecond line")

    cases = [_case("a", lambda t: gpu_smoke.SmokeOutcome(True, "PASS fine")),
             _case("b", broken),
             _case("c", lambda t: gpu_smoke.SmokeOutcome(False, "FAIL error 0.5"))]
    outcomes = gpu_smoke.run_cases(cases, Timer("cpu", 1, 1), Deadline(60))
    assert [o.passed for _, o in outcomes] == [True, False, False]
    assert capsys.readouterr().out.splitlines() == [
        "smoke a tiny: PASS fine",
        "smoke b tiny: ERROR RuntimeError: no kernel image is available",
        "smoke c tiny: FAIL error 0.5"]
    assert all("seconds" in o.details for _, o in outcomes)


def test_cases_past_the_budget_are_reported_not_run(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    ran: list[str] = []

    class SpentAfterOneCase(Deadline):
        def expired(self) -> bool:
            return bool(ran)

    def run(timer: Timer) -> gpu_smoke.SmokeOutcome:
        ran.append("run")
        return gpu_smoke.SmokeOutcome(True, "PASS")

    outcomes = gpu_smoke.run_cases([_case("a", run), _case("b", run)], Timer("cpu", 1, 1),
                                   SpentAfterOneCase(60))
    assert ran == ["run"] and [o.passed for _, o in outcomes] == [True, False]
    assert "smoke b tiny: NOT RUN: the smoke budget was spent" in capsys.readouterr().out


def test_dry_run_reports_a_kernel_that_does_not_compile(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    bad = gpu_smoke.SmokeCase("forward", "bad", ("--head-dim", "7"), gpu_smoke.forward_smoke)
    assert gpu_smoke.dry_run([bad], "sm_90") == 1
    out = capsys.readouterr().out
    assert "smoke forward bad: planned; its kernel FAILED to compile for sm_90" in out
    assert "multiple of 8" in out  # the CLI's own message follows


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_smoke.main(["--budget", "5"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_forward_smoke_passes_on_the_gpu() -> None:
    outcome = gpu_smoke.forward_smoke(Timer("cuda", 1, 3), Shape("fp16", 64, True, 2, 512))
    assert outcome.passed, outcome.summary
    assert outcome.details["rel_err_vs_sdpa"] < 1e-2
    assert [r["status"] for r in outcome.details["results"]] == ["ok", "ok"]


@pytest.mark.gpu
@pytest.mark.parametrize("op", [f.op for f in families.all_families() if f.op != "fwd"])
def test_family_smoke_passes_on_the_gpu(op: str) -> None:
    size = (*gpu_smoke.FAMILY_SHAPE[:3], gpu_smoke.family_head_dim(op))
    outcome = gpu_smoke.family_smoke(op, size)(Timer("cuda", 1, 3))
    assert outcome.passed, outcome.summary
