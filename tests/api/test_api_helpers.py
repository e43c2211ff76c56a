"""The test helpers themselves: the error measure works across devices."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch
from runtime_helpers import rel_fro


def _targets_cpu(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    targets = [*args, kwargs.get("device")]
    return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu"
               for t in targets)


class OnAnotherDevice(torch.Tensor):
    """Stands in, on a CPU-only machine, for a tensor on a GPU: like one, it takes part in no
    operation with CPU tensors; only a copy to the CPU (``.cpu()``, ``.to("cpu", ...)``)
    yields its values, and ``detach`` keeps it where it is."""

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any,
                           args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
                           ) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        with torch._C.DisableTorchFunctionSubclass():
            if name == "detach":
                return func(*args, **kwargs).as_subclass(cls)
            if name == "cpu" or (name == "to" and _targets_cpu(args[1:], kwargs)):
                return func(*args, **kwargs).as_subclass(torch.Tensor)
        raise RuntimeError(f"Expected all tensors to be on the same device ({name} was "
                           "called on a tensor on another device)")


def _elsewhere(t: torch.Tensor) -> torch.Tensor:
    return t.clone().as_subclass(OnAnotherDevice)


def test_the_stand_in_refuses_to_mix_with_cpu_tensors() -> None:
    with pytest.raises(RuntimeError, match="same device"):
        _ = _elsewhere(torch.ones(2)) - torch.ones(2)
    with pytest.raises(RuntimeError, match="same device"):
        _elsewhere(torch.ones(2)).to(torch.float64)  # a dtype change stays on the device


@pytest.mark.parametrize("where", ["actual", "expected", "both"])
def test_rel_fro_takes_both_tensors_to_the_cpu(where: str) -> None:
    gen = torch.Generator().manual_seed(20)
    expected = torch.randn(3, 5, 7, generator=gen, dtype=torch.float64)
    actual = (expected + 1e-3 * torch.randn(3, 5, 7, generator=gen, dtype=torch.float64)
              ).to(torch.bfloat16)
    want = float((actual.double() - expected).norm() / expected.norm())
    a = _elsewhere(actual) if where in ("actual", "both") else actual
    e = _elsewhere(expected) if where in ("expected", "both") else expected
    assert rel_fro(a, e) == pytest.approx(want, rel=1e-12)
    assert 1e-4 < want < 1e-2  # bf16 rounding of a small perturbation: a real, nonzero error
