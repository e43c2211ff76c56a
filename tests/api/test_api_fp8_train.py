"""``flashtune.attention_fp8``: 16-bit q, k, v quantised to FP8 per (batch, KV head), the FP8
forward and, through ``loss.backward()``, the FP8 backward (emulator, a virtual sm_90).

The bound is flash-attn's rule against float64 autograd of the attention of the dequantised
inputs (quantised here independently: amax / max per (batch, KV head), torch's conversion):
O and each gradient within 3x plain PyTorch's own error in the inputs' 16-bit type (on the
dequantised inputs rounded to it); the
gradients reach q, k and v straight through the quantiser."""

from __future__ import annotations

import os

import pytest
import torch
from grad_helpers import gradients, make_inputs, within_rule

import flashtune
from flashtune.errors import InvalidInput
from flashtune.families.fwd.reference import attention_reference

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])


@pytest.fixture(autouse=True)
def _sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHTUNE_EMULATOR_ARCH", "sm_90")


def dequantised(x: torch.Tensor, heads_kv: int, fmt: torch.dtype) -> torch.Tensor:
    """x rounded to ``fmt`` with one float32 descale per (batch, KV head group), amax / max,
    the division in float32 (the documented quantisation), dequantised in float64."""
    b, n, h, d = x.shape
    groups = x.float().reshape(b, n, heads_kv, h // heads_kv, d)
    scale = groups.abs().amax(dim=(1, 3, 4), keepdim=True) / torch.finfo(fmt).max
    values = (groups / scale).to(fmt).double() * scale.double()
    return values.reshape(b, n, h, d)


@pytest.mark.emulator
@pytest.mark.parametrize("dtype, fmt, causal, shape, deterministic", [
    (torch.bfloat16, torch.float8_e4m3fn, True, (2, 70, 45, 4, 2), False),
    (torch.float16, torch.float8_e5m2, False, (1, 33, 80, 2, 1), True),
])
def test_fp8_training_matches_float64_of_the_dequantised_inputs(
        dtype: torch.dtype, fmt: torch.dtype, causal: bool,
        shape: tuple[int, int, int, int, int], deterministic: bool) -> None:
    """(``deterministic``: the gradients of ``bwd8det``, its slices summed in order.)"""
    inputs, dout = make_inputs(shape, 64, dtype, SEED)
    heads_kv = shape[4]
    scale = 64 ** -0.5

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = flashtune.attention_fp8(q, k, v, causal=causal, fp8_dtype=fmt,
                                      deterministic=deterministic, backend="emulator")
        assert isinstance(out, torch.Tensor) and out.dtype == dtype
        return out

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention_reference(q, k, v, causal, scale)[0]

    got = gradients(ours, inputs, dout)
    assert all(got[n].dtype == dtype for n in ("dq", "dk", "dv"))
    given = tuple(dequantised(t, heads_kv, fmt) for t in inputs)
    low = gradients(plain, tuple(t.to(dtype) for t in given), dout)  # the rule's yardstick
    exact = gradients(plain, given, dout)
    within_rule(got, low, exact, f"seed={SEED} {dtype} {fmt} causal={causal}")


def test_bad_inputs_are_refused_naming_them() -> None:
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(InvalidInput, match=r"fp8_dtype=torch.float16; expected "
                                           r"torch.float8_e4m3fn \(the default\)"):
        flashtune.attention_fp8(q, q, q, fp8_dtype=torch.float16, backend="emulator")
    p = torch.randn(1, 8, 2, 40, dtype=torch.bfloat16)
    with pytest.raises(InvalidInput, match=r"head dim 40: the FP8 kernels take multiples of "
                                           r"32; pad q, k and v with zeros to 64"):
        flashtune.attention_fp8(p, p, p, backend="emulator")
