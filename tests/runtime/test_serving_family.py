"""A family that ``serves`` the forward with other kernel arguments serves
``flashtune.attention`` with no edit outside its folder: the warp-specialised sm_90a family
(whose ABI adds three tensor maps), which serves "fwd" on compute capability 9.0, runs the
torch API's calls on the emulator's virtual sm_90a device through its own hot-path packer
(stored in the plan), after its first-use check, and matches float64."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

import flashtune
from flashtune.codegen.abi import ArgType
from flashtune.families.fwd.reference import attention_reference
from flashtune.families.hopper.ws import HOPPER_WS_FORWARD
from flashtune.runtime import first_use, plans
from flashtune.runtime.dispatch import Dispatcher

pytestmark = pytest.mark.emulator

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])


@pytest.fixture
def serving_ws(monkeypatch: pytest.MonkeyPatch, dispatcher: Dispatcher) -> Iterator[str]:
    monkeypatch.setenv("FLASHTUNE_BACKEND", "emulator")
    monkeypatch.setenv("FLASHTUNE_EMULATOR_ARCH", "sm_90a")
    monkeypatch.delenv("FLASHTUNE_ARCH_SPECIFIC", raising=False)
    first_use.forget()
    plans.clear_caches()
    yield HOPPER_WS_FORWARD.op
    first_use.forget()
    plans.clear_caches()


def test_the_ws_family_serves_attention_through_its_own_packer(serving_ws: str) -> None:
    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(1, 100, 4, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 90, 2, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 90, 2, 64, generator=gen).to(torch.bfloat16)
    assert flashtune.explain(q, k, v, causal=True).problem.op == serving_ws
    out, lse = flashtune.attention(q, k, v, causal=True, return_lse=True)
    assert first_use.refused("virtual-sm_90a") is None  # it passed its first-use check
    (plan,) = [p for key, p in plans.cached().items() if key[-1] == "fwd"]
    assert plan.decision.problem.op == serving_ws
    grid, args = plan.pack(q, k, v, torch.empty_like(q), torch.empty(1, 4, 100), 0.125)
    assert [t for t, _ in args[-3:]] == [ArgType.TMAP] * 3 and len(args) == 25
    assert grid == (1, 4, 1)  # 100 rows in one block of 128
    ref_o, ref_lse = attention_reference(q, k, v, True, 64 ** -0.5)
    assert torch.allclose(out.double(), ref_o, atol=2.5e-2, rtol=2.5e-2)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-3, rtol=2e-6)
