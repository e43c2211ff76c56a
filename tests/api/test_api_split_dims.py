"""``flashtune.attention(q, k, v)`` with v's head dim other than q's: O has v's head dim,
the LSE is as usual; served by the mma.sync forward (also where the sm_90a forward serves
plain calls); what is not served is refused naming the argument and the fix.

Numerics: the emulator against the float64 reference on fresh seeded inputs (the seed is
the session's, printed), outputs poisoned with NaN, every element within the forward's
tolerance (``families.checks``).
"""

from __future__ import annotations

import os

import pytest
import torch
from grad_helpers import attention_reference as plain_attention
from grad_helpers import gradients, within_rule

import flashtune
from flashtune.codegen.spec import Problem, Shape
from flashtune.errors import InvalidInput
from flashtune.families.base import element_type
from flashtune.families.fwd import FORWARD
from flashtune.families.fwd.reference import attention_reference
from flashtune.runtime import plans

_SEED = int(os.environ["FLASHTUNE_TEST_SEED"])


def split_qkv(shape: Shape, dim: int, dim_v: int, dtype: torch.dtype, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(shape.batch, shape.seqlen_q, shape.heads_q, dim, generator=gen)
    k = torch.randn(shape.batch, shape.seqlen_k, shape.heads_kv, dim, generator=gen)
    v = torch.randn(shape.batch, shape.seqlen_k, shape.heads_kv, dim_v, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher", "poisoned_outputs")
@pytest.mark.parametrize("dim, dim_v, dtype, causal", [
    (192, 128, torch.bfloat16, True), (64, 128, torch.float16, False)])
def test_attention_returns_o_of_v_head_dim(dim: int, dim_v: int, dtype: torch.dtype,
                                           causal: bool) -> None:
    seed = _SEED + dim
    print(f"seed={seed}")
    shape = Shape(2, 4, 2, 45, 70)
    q, k, v = split_qkv(shape, dim, dim_v, dtype, seed)
    out, lse = flashtune.attention(q, k, v, causal=causal, return_lse=True,
                                   backend="emulator")
    assert out.shape == (2, 45, 4, dim_v) and out.dtype == dtype
    assert lse.shape == (2, 4, 45) and lse.dtype == torch.float32
    ref_o, ref_lse = attention_reference(q, k, v, causal, dim ** -0.5)
    problem = Problem(dim, element_type(dtype), causal=causal, head_dim_v=dim_v)
    verdict = FORWARD.compare(problem, shape, {"o": out, "lse": lse},
                              {"o": ref_o, "lse": ref_lse})
    assert verdict.ok, f"{problem.key()} seed={seed}: {verdict.message}"
    # Under no_grad too (the direct call; above: inputs that need no grad).
    with torch.no_grad():
        again = flashtune.attention(q, k, v, causal=causal, backend="emulator")
    assert torch.equal(again, out)


def test_the_sm90a_device_serves_split_calls_of_whole_panels_on_fwd90aws() -> None:
    """A virtual sm_90a device: a plain call and split ones whose head dims are whole
    128-byte panels (128 / 64, DeepSeek's 192 / 128) go to the warp-specialised sm_90a
    forward; 96 / 64 stays on ``fwd`` (96 is not a sm_90a head dim)."""
    q = torch.empty(1, 64, 2, 128, dtype=torch.bfloat16, device="meta")
    split, _ = plans.decide(q, True, "emulator", "fwd", (), 64, arch="sm_90a",
                            operands=plans.Operands(head_dim_v=64))
    assert split.problem.key() == "fwd90aws_d128v64_bf16_causal"
    plain, _ = plans.decide(q, True, "emulator", "fwd", (), 64, arch="sm_90a")
    assert plain.problem.op != "fwd"
    q192 = torch.empty(1, 64, 2, 192, dtype=torch.bfloat16, device="meta")
    deepseek, _ = plans.decide(q192, True, "emulator", "fwd", (), 64, arch="sm_90a",
                               operands=plans.Operands(head_dim_v=128))
    assert deepseek.problem.key() == "fwd90aws_d192v128_bf16_causal"
    q96 = torch.empty(1, 64, 2, 96, dtype=torch.bfloat16, device="meta")
    partial, _ = plans.decide(q96, True, "emulator", "fwd", (), 64, arch="sm_90a",
                              operands=plans.Operands(head_dim_v=64))
    assert partial.problem.key() == "fwd_d96v64_bf16_causal"


def test_what_a_split_call_cannot_have_is_refused_naming_the_fix() -> None:
    q, k, v = split_qkv(Shape(1, 2, 1, 8, 8), 192, 128, torch.bfloat16, _SEED)
    for bad, match in ((100, "v has head dim 100; expected a multiple of 8.*Pad v with zeros "
                             "to 104"),
                       (264, "v has head dim 264; the limit is 256")):
        with pytest.raises(InvalidInput, match=match):
            flashtune.attention(q, k, v.new_zeros(1, 8, 1, bad), backend="emulator")
    with pytest.raises(InvalidInput, match=r"expected equal batch, seqlen and heads"):
        flashtune.attention(q, k, v.new_zeros(1, 9, 1, 128), backend="emulator")


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher")
@pytest.mark.parametrize("dim, dim_v, causal, deterministic, dtype", [
    (192, 128, True, False, torch.bfloat16), (64, 128, False, True, torch.float16)])
def test_gradients_of_split_head_dims_follow_flash_attn_rule(
        dim: int, dim_v: int, causal: bool, deterministic: bool, dtype: torch.dtype) -> None:
    """dQ, dK, dV (and O) through ``loss.backward()``: max|ours - float64| at most 3x max|plain
    PyTorch in the inputs' dtype - float64| (flash-attn's rule), dV of v's head dim. (The
    fp16 case runs the forward kernel of test_attention_returns_o_of_v_head_dim's.)"""
    seed = _SEED + 7 * dim
    shape = Shape(1, 4, 2, 50, 70)
    q, k, v = split_qkv(shape, dim, dim_v, dtype, seed)
    dout = split_qkv(Shape(1, 4, 4, 50, 50), dim_v, dim_v, dtype, seed + 1)[0]
    scale = dim ** -0.5

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = flashtune.attention(q, k, v, causal=causal, backend="emulator",
                                  deterministic=deterministic)
        assert isinstance(out, torch.Tensor)
        return out

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return plain_attention(q, k, v, causal, scale)[0]

    got = gradients(ours, (q, k, v), dout)
    assert got["dv"].shape == v.shape and got["dq"].shape == q.shape
    within_rule(got, gradients(plain, (q, k, v), dout),
                gradients(plain, (q.double(), k.double(), v.double()), dout),
                f"d{dim}v{dim_v} causal={causal} seed={seed}")
