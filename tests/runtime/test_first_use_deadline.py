"""The first-use check cannot hang a process (runtime/first_use.py): a kernel that never
finishes is reported as hung within FLASHTUNE_FIRST_USE_TIMEOUT_S, naming the kernel and how
to continue, and recorded so that a later process skips it; the emulator's own deadlock is
reported as the check's failure; no check runs inside CUDA-graph capture; checks run ahead
(``check_ahead``, ``flashtune check --gpu``) are recorded and spare a serving process its own."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import flashtune
from flashtune import families
from flashtune.codegen.abi import ArgType, ArgValue
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import KernelConfig, KernelSource, Problem
from flashtune.errors import CheckDuringCapture, KernelHung
from flashtune.families.base import Verdict
from flashtune.families.fwd.reference import attention_reference
from flashtune.runtime import backends, first_use, launch, plans
from flashtune.runtime.backends.base import LoadedKernel
from flashtune.toolchain.cache import ArtifactCache

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
VIRTUAL = "virtual-sm_90a"
SM90A = get_arch("sm_90a")

pytestmark = pytest.mark.emulator


@pytest.fixture(autouse=True)
def sm90a_emulator(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv("FLASHTUNE_BACKEND", "emulator")
    monkeypatch.setenv("FLASHTUNE_EMULATOR_ARCH", "sm_90a")
    monkeypatch.delenv("FLASHTUNE_ARCH_SPECIFIC", raising=False)
    records = ArtifactCache(tmp_path / "records")
    monkeypatch.setattr(first_use, "_records", lambda: records)
    first_use.forget()
    plans.clear_caches()
    yield
    first_use.forget()
    plans.clear_caches()


class StandIn:
    """A loaded kernel whose launch blocks until ``release`` is set (a hung kernel), or
    returns at once without writing anything (``release`` None)."""

    def __init__(self, source: KernelSource, release: threading.Event | None) -> None:
        self.source = source
        self.release = release

    def launch(self, grid: tuple[int, int, int], args: Sequence[tuple[ArgType, ArgValue]],
               *, stream: int = 0) -> None:
        self.bind(grid, args, stream=stream)()

    def bind(self, grid: tuple[int, int, int], args: Sequence[tuple[ArgType, ArgValue]], *,
             stream: int = 0) -> Callable[[], None]:
        release = self.release

        def run() -> None:
            if release is not None:
                release.wait()
        return run


def _source(op: str = "fwd90a", config: KernelConfig | None = None) -> KernelSource:
    problem = Problem(head_dim=64, dtype=flashtune.DType.BF16, causal=True, op=op)
    return families.render(problem, config or families.get(op).default_config(problem, SM90A))


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(1, 70, 4, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 90, 2, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 90, 2, 64, generator=gen).to(torch.bfloat16)
    return q, k, v


@pytest.fixture
def hung(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every sm_90a kernel the runtime loads hangs (until the test ends)."""
    release = threading.Event()
    real = backends.get_backend

    class Hanging:
        def __init__(self, name: str) -> None:
            self.inner = real(name)

        def load(self, source: KernelSource) -> LoadedKernel:
            if source.target == "sm_90a":
                return StandIn(source, release)
            return self.inner.load(source)

    monkeypatch.setattr(plans, "get_backend", Hanging)
    yield release
    release.set()


def test_a_hung_kernel_is_named_within_its_deadline_and_skipped_from_then_on(
        monkeypatch: pytest.MonkeyPatch, hung: threading.Event,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("FLASHTUNE_FIRST_USE_TIMEOUT_S", "1.5")
    q, k, v = _inputs()
    start = time.monotonic()
    decision, _ = plans.decide(q, True, None, "fwd", (), q.shape[1])
    served = families.render(decision.problem, decision.config)
    with pytest.raises(KernelHung, match=served.entry + r" did not finish "
                       r"its first-use check on virtual-sm_90a within 1.5 s .*the kernel is "
                       r"hung.*restart it with FLASHTUNE_ARCH_SPECIFIC=0"):
        flashtune.attention(q, k, v, causal=True)
    assert time.monotonic() - start < 1.5 + 5.0
    assert "hung" in (first_use.refused(VIRTUAL) or "")
    said = first_use.recorded(VIRTUAL, served)
    assert said is not None and not said.ok and said.reason.endswith(": hung")
    # A new process (nothing in memory): the recorded hang refuses the sm_90a kernels at
    # once, and the portable forward serves the call correctly; no check runs.
    first_use.forget()
    plans.clear_caches()
    checked: list[str] = []
    monkeypatch.setattr(launch, "verify", lambda kernel, *a, **kw: checked.append("!"))
    with caplog.at_level(logging.WARNING, logger="flashtune.runtime.first_use"):
        out, lse = flashtune.attention(q, k, v, causal=True, return_lse=True)
    assert checked == []
    assert any("failed its recorded check" in r.getMessage() for r in caplog.records)
    ref_o, ref_lse = attention_reference(q, k, v, True, 64 ** -0.5)
    assert torch.allclose(out.double(), ref_o, atol=2.5e-2, rtol=2.5e-2)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-3, rtol=2e-6)


def test_the_emulators_deadlock_is_the_checks_failure_naming_the_barrier() -> None:
    """The warp-specialised kernel with its consumers never releasing a stage (a planted
    bug): the emulator reports the deadlock and the check returns it, well within time."""
    import dataclasses

    from flashtune.runtime.backends.emulator import EmulatorBackend

    config = KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    source = _source("fwd90aws", config)
    source = dataclasses.replace(source, options=(*source.options, "-DFT_WS_PLANTED_BUG=3"))
    start = time.monotonic()
    failure = first_use.run_check(EmulatorBackend().load(source), "cpu", VIRTUAL,
                                  timeout_s=300)
    assert failure is not None and failure.startswith("EmulatorDeadlock:"), failure
    assert "mbarrier" in failure and "arrivals missing" in failure
    assert time.monotonic() - start < 300


def test_no_check_runs_inside_cuda_graph_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(first_use, "_capturing", lambda device: True)
    source = _source()
    with pytest.raises(CheckDuringCapture, match=r"flashtune_fwd90a_\w+ .*cannot run inside "
                       r"CUDA-graph capture: make one call .* before capturing .*flashtune "
                       r"check --gpu"):
        first_use.check(StandIn(source, threading.Event()), "cpu", VIRTUAL)
    # a check recorded ahead serves inside capture with nothing run
    first_use.record(VIRTUAL, source, True)
    assert first_use.check(StandIn(source, threading.Event()), "cpu", VIRTUAL) is None


def test_checks_ahead_are_recorded_and_resume_past_a_hang(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``check_ahead`` records each result; a hung kernel stops the run (recorded as hung)
    and the next run skips what is recorded, so it gets past the hang."""
    release = threading.Event()
    good, bad = _source(), _source("fwd90aws")
    third = _source("fwd90a", KernelConfig(block_m=64, block_n=64, num_warps=4,
                                           num_stages=2))
    verdicts = {good.entry: Verdict(True, 0.0, 0.0, ""),
                third.entry: Verdict(False, 3.0, 0.5, "o: 12 elements outside the tolerance")}
    monkeypatch.setattr(launch, "verify",
                        lambda kernel, *a, **kw: (kernel.bind((1, 1, 1), [])(),
                                                  verdicts[kernel.source.entry])[1])
    kernels = [StandIn(good, None), StandIn(bad, release), StandIn(third, None)]
    seen: list[tuple[str, bool, bool]] = []
    try:
        with pytest.raises(KernelHung, match=bad.entry):
            for result, fresh in first_use.check_ahead(kernels, "cpu", VIRTUAL, timeout_s=0.5):
                seen.append((result.entry, result.ok, fresh))
        assert seen == [(good.entry, True, True)]
        seen.clear()
        for result, fresh in first_use.check_ahead(kernels, "cpu", VIRTUAL, timeout_s=0.5):
            seen.append((result.entry, result.ok, fresh))
    finally:
        release.set()
    assert seen == [(good.entry, True, False), (bad.entry, False, False),
                    (third.entry, False, True)]
    failed = first_use.recorded(VIRTUAL, third)
    assert failed is not None and "12 elements" in failed.reason
    # a serving process reads the records: the passing kernel needs no check of its own
    assert first_use.check(StandIn(good, threading.Event()), "cpu", VIRTUAL) is None


def test_check_gpu_lists_checks_and_records_the_served_kernels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``flashtune check --gpu`` on the emulator's virtual sm_90a: --list names the served
    sm_90a kernels; --only checks one (a stand-in that passes) and records it; a hung one
    exits with status 2 naming it."""
    from typer.testing import CliRunner

    from flashtune.cli import app

    release = threading.Event()
    monkeypatch.setattr(backends, "get_backend", lambda name: type(
        "StandIns", (), {"load": lambda self, s: StandIn(s, release if "full" in s.entry
                                                         else None)})())
    monkeypatch.setattr(launch, "verify", lambda kernel, *a, **kw: (
        kernel.bind((1, 1, 1), [])(), Verdict(True, 0.0, 0.0, ""))[1])
    listed = CliRunner().invoke(app, ["check", "--gpu", "--list"])
    assert listed.exit_code == 0, listed.output
    entries = listed.output.split()
    served = families.render(*_served(causal=True))
    # the forward's kernels, then the backward's (the sm_90a families serving bwd, bwddet)
    assert served.entry in entries and all(e.startswith(("flashtune_fwd90a", "flashtune_bwd90a"))
                                           for e in entries)
    assert entries[0].startswith("flashtune_fwd90a") and any("bwd90adet" in e for e in entries)
    from flashtune.toolchain import compiler

    compiled: list[tuple[str, str]] = []

    def compile_pairs(pairs: list[tuple[KernelSource, str]]) -> list[SimpleNamespace]:
        compiled.extend((source.entry, arch) for source, arch in pairs)
        return [SimpleNamespace(ok=True) for _ in pairs]

    monkeypatch.setattr(compiler, "compile_pairs", compile_pairs)
    built = CliRunner().invoke(app, ["check", "--gpu", "--compile-only"])
    assert built.exit_code == 0 and f"compiled {len(entries)} of {len(entries)}" in built.output
    assert compiled == [(e, "sm_90a") for e in entries]
    assert first_use.recorded(VIRTUAL, served) is None  # compiled, nothing checked
    done = CliRunner().invoke(app, ["check", "--gpu", "--only", served.entry])
    assert done.exit_code == 0 and "pass" in done.output, done.output
    said = first_use.recorded(VIRTUAL, served)
    assert said is not None and said.ok
    try:
        full = families.render(*_served(causal=False))
        hung = CliRunner().invoke(app, ["check", "--gpu", "--only", full.entry, "--timeout",
                                        "0.5"])
    finally:
        release.set()
    assert hung.exit_code == 2 and full.entry in hung.output, hung.output


def _served(causal: bool) -> tuple[Problem, KernelConfig]:
    q, _, _ = _inputs()
    decision, _ = plans.decide(q, causal, None, "fwd", (), q.shape[1])
    return decision.problem, decision.config
