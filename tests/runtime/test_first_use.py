"""The first-use check of arch-specific kernels (runtime/first_use.py), on the emulator's
virtual sm_90a device: a kernel of the sm_90a forward (fwd90aws) is verified against float64
once before it first serves a call; a kernel that fails it (a mismatch, or an error) turns the
arch-specific families off for the device, with a warning, and the call is served by the
mma.sync forward, correctly; so does one that cannot be built or loaded."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import flashtune
from flashtune.codegen.spec import KernelSource, Shape
from flashtune.errors import CompileError, EmulatorError
from flashtune.families.base import Verdict
from flashtune.families.fwd.reference import attention_reference
from flashtune.runtime import backends, first_use, launch, plans
from flashtune.runtime.backends.base import LoadedKernel

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
VIRTUAL_SM90A = "virtual-sm_90a"

pytestmark = [pytest.mark.emulator, pytest.mark.usefixtures("virtual_sm90a")]


def _inputs(seqlen_q: int = 70) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(1, seqlen_q, 4, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 90, 2, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 90, 2, 64, generator=gen).to(torch.bfloat16)
    return q, k, v


def _matches_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    out, lse = flashtune.attention(q, k, v, causal=True, return_lse=True)
    ref_o, ref_lse = attention_reference(q, k, v, True, 64 ** -0.5)
    assert torch.allclose(out.double(), ref_o, atol=2.5e-2, rtol=2.5e-2)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-3, rtol=2e-6)


def _spy(monkeypatch: pytest.MonkeyPatch, verdict: Verdict | Exception | None
         ) -> list[str]:
    """Record the kernels verify() checks; answer ``verdict`` (None: run the real check)."""
    seen: list[str] = []
    real = launch.verify

    def fake(kernel: LoadedKernel, shape: Shape, device: torch.device | str, **kw: object
             ) -> Verdict:
        seen.append(kernel.source.entry)
        assert shape == first_use.CHECK_SHAPE
        if isinstance(verdict, Exception):
            raise verdict
        return real(kernel, shape, device) if verdict is None else verdict

    monkeypatch.setattr(launch, "verify", fake)
    return seen


def test_an_sm90a_kernel_is_checked_once_before_it_serves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy(monkeypatch, None)
    q, k, v = _inputs()
    assert flashtune.explain(q, k, v, causal=True).problem.op == "fwd90aws"
    _matches_float64(q, k, v)
    assert len(seen) == 1 and seen[0].startswith("flashtune_fwd90aws_d64_bf16_causal_"), seen
    # the same kernel for another sequence bucket: a new plan, not a second check
    plans.clear_caches()
    _matches_float64(*_inputs(seqlen_q=150))
    assert len(seen) == 1 and first_use.refused(VIRTUAL_SM90A) is None


@pytest.mark.parametrize("failure", [
    Verdict(False, 3.0, 0.5, "o: 12 elements outside the tolerance"),
    EmulatorError("wgmma at hopper_fwd.cuh:1: a planted failure")],
    ids=["mismatch", "error"])
def test_a_failing_check_serves_the_mma_sync_forward_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        failure: Verdict | Exception) -> None:
    seen = _spy(monkeypatch, failure)
    q, k, v = _inputs()
    with caplog.at_level(logging.WARNING, logger="flashtune.runtime.first_use"):
        _matches_float64(q, k, v)
    assert len(seen) == 1 and seen[0].startswith("flashtune_fwd90aws_"), seen
    said = str(failure.message if isinstance(failure, Verdict) else failure)
    warned = [r.getMessage() for r in caplog.records]
    assert any(seen[0] in w and said in w and "FLASHTUNE_ARCH_SPECIFIC=0" in w
               for w in warned), warned
    why = first_use.refused(VIRTUAL_SM90A)
    assert why is not None and "failed its first-use check against float64" in why
    # from now on the device is served by the portable forward, and says so
    assert flashtune.explain(q, k, v, causal=True).problem.op == "fwd"
    plans.clear_caches()
    _matches_float64(*_inputs(seqlen_q=150))
    assert len(seen) == 1  # nothing arch-specific is checked (or served) again


def test_an_sm90a_kernel_that_cannot_be_loaded_gives_way_to_the_portable_one(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """E.g. no NVRTC beside a precompiled directory of the portable kernels only: the load
    error is said once, and the mma.sync forward serves."""
    real = backends.get_backend

    class NoSm90a:
        def __init__(self, name: str) -> None:
            self.inner = real(name)

        def load(self, source: KernelSource) -> LoadedKernel:
            if source.target == "sm_90a":
                raise CompileError("NVRTC is not installed and no precompiled kernel matches")
            return self.inner.load(source)

    monkeypatch.setattr(plans, "get_backend", NoSm90a)
    seen = _spy(monkeypatch, None)
    with caplog.at_level(logging.WARNING, logger="flashtune.runtime.first_use"):
        _matches_float64(*_inputs())
    assert seen == []  # nothing was loaded to check
    why = first_use.refused(VIRTUAL_SM90A)
    assert why is not None and "could not be loaded on virtual-sm_90a" in why
    assert "NVRTC is not installed" in why and any(why in r.getMessage() for r in caplog.records)
    assert flashtune.explain(*_inputs(), causal=True).problem.op == "fwd"
