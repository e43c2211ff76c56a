"""Fixtures of the runtime tests: a reference backend and a dispatcher with a test store."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_helpers import ListSource, PyRefBackend  # noqa: E402

from flashtune.api import forward  # noqa: E402
from flashtune.runtime.backends import register_backend, unregister_backend  # noqa: E402
from flashtune.runtime.dispatch import Dispatcher, set_dispatcher  # noqa: E402


@pytest.fixture
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs start as NaN, so any element the kernel does not write is caught."""
    real = forward.empty_outputs

    def poisoned(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = real(q)
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
    forward.clear_caches()
    yield d
    set_dispatcher(None)
    forward.clear_caches()


@pytest.fixture
def pyref(dispatcher: Dispatcher) -> Iterator[PyRefBackend]:
    """The reference backend registered as ``pyref`` (CPU tensors)."""
    backend = PyRefBackend()
    register_backend("pyref", "cpu", lambda: backend)
    yield backend
    unregister_backend("pyref")
