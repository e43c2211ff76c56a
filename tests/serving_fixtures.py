"""Fixtures of the runtime and API tests: a reference backend and a dispatcher with a test
store, used by the conftest.py of tests/runtime and tests/api."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import cast

import pytest
import torch
from runtime_helpers import ListSource, PyRefBackend

from flashtune.api import forward
from flashtune.runtime import first_use, plans
from flashtune.runtime.backends import register_backend, unregister_backend
from flashtune.runtime.backends.base import Backend
from flashtune.runtime.dispatch import Dispatcher, set_dispatcher


@pytest.fixture
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs start as NaN, so any element the kernel does not write is caught."""
    real = forward.empty_outputs

    def poisoned(q: torch.Tensor, head_dim_v: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = real(q, head_dim_v)
        return out.fill_(math.nan), lse.fill_(math.nan)

    monkeypatch.setattr(forward, "empty_outputs", poisoned)


@pytest.fixture
def source() -> ListSource:
    return ListSource()


@pytest.fixture
def dispatcher(source: ListSource) -> Iterator[Dispatcher]:
    """The process-wide dispatcher, reading ``source``; plans are cleared around the test."""
    d = Dispatcher(lambda: source)
    set_dispatcher(d)
    plans.clear_caches()
    yield d
    set_dispatcher(None)
    plans.clear_caches()


@pytest.fixture
def pyref(dispatcher: Dispatcher) -> Iterator[PyRefBackend]:
    """The reference backend registered as ``pyref`` (CPU tensors)."""
    backend = PyRefBackend()
    # a stand-in that launches only (its kernels have no ``bind``)
    register_backend("pyref", "cpu", lambda: cast(Backend, backend))
    yield backend
    unregister_backend("pyref")


@pytest.fixture
def shuffled() -> Iterator[list[str]]:
    """Three emulator backends that run blocks in shuffled orders (seeds 1, 2, 3)."""
    from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions

    names = [f"emushuffle{seed}" for seed in (1, 2, 3)]
    for seed, name in zip((1, 2, 3), names, strict=True):
        register_backend(name, "cpu", lambda seed=seed: EmulatorBackend(  # type: ignore[misc]
            options=LaunchOptions(block_order_seed=seed)))
    yield names
    for name in names:
        unregister_backend(name)


@contextlib.contextmanager
def on_virtual_sm90a(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The torch API on the emulator's virtual sm_90a device (the arch-specific families
    served after their first-use check), with first-use records and plans forgotten around
    the block."""
    monkeypatch.setenv("FLASHTUNE_BACKEND", "emulator")
    monkeypatch.setenv("FLASHTUNE_EMULATOR_ARCH", "sm_90a")
    monkeypatch.delenv("FLASHTUNE_ARCH_SPECIFIC", raising=False)
    first_use.forget()
    plans.clear_caches()
    try:
        yield
    finally:
        first_use.forget()
        plans.clear_caches()


@pytest.fixture
def virtual_sm90a(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``on_virtual_sm90a`` around the test."""
    with on_virtual_sm90a(monkeypatch):
        yield
