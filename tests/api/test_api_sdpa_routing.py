"""torch's flash-attention operators routed to flashtune (``flashtune.register_sdpa``).

On this machine the operators' CPU dispatch key stands in for the CUDA key the opt-in
registers (the same kernels, run by the emulator): SDPA's flash operator and its backward
through autograd against float64 with flash-attn's 3x rule, torch's own ``varlen_attn``
(packed sequences, causal and sliding windows) against the float64 reference per sequence
and its gradients (flash-attn's rule against float64 autograd per sequence), and the
refusals. The registration itself is checked on the CUDA key: activated it holds
flashtune's kernels, restored it does not. The GPU test runs SDPA end to end on a GPU.
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from grad_helpers import (
    error_ratios,
    feature_scores,
    gradients,
    packed_inputs,
    per_sequence,
    within_rule,
)
from runtime_helpers import check_varlen_outputs

import flashtune
from flashtune.api import sdpa_routing
from flashtune.api.sdpa_routing import route_flash_operators
from flashtune.errors import FeatureNotSupported
from flashtune.families.fwd.reference import varlen_reference

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
SDPA_OP = "aten::_scaled_dot_product_flash_attention"
TOL = {torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """torch's flash-attention registry, empty and inactive, restored afterwards."""
    reg = torch.nn.attention._registry
    monkeypatch.setattr(reg, "_FLASH_ATTENTION_IMPLS", {})
    monkeypatch.setattr(reg, "_FLASH_ATTENTION_ACTIVE", None)
    yield torch.nn.attention
    torch.nn.attention.restore_flash_attention_impl(_raise_warn=False)


@pytest.fixture
def routed_cpu() -> Iterator[None]:
    """flashtune's kernels on the operators' CPU key, run by the emulator."""
    routing = route_flash_operators("CPU", "emulator")
    yield
    routing.remove()


def _cuda_kernel(op: str) -> str:
    table = torch._C._dispatch_dump_table(op).splitlines()
    return next((line for line in table if line.startswith("CUDA:")), "")


def test_register_adds_flashtune_and_activates_nothing(registry: Any) -> None:
    assert flashtune.register_sdpa() == "flashtune"
    assert "flashtune" in registry.list_flash_attention_impls()
    assert registry.current_flash_attention_impl() is None
    assert "sdpa_routing.py" not in _cuda_kernel(SDPA_OP)


def test_activation_routes_the_cuda_kernels_until_restored(registry: Any) -> None:
    flashtune.register_sdpa()
    registry.activate_flash_attention_impl("flashtune")
    assert registry.current_flash_attention_impl() == "flashtune"
    for op in ("_scaled_dot_product_flash_attention",
               "_scaled_dot_product_flash_attention_backward", "_flash_attention_forward",
               "_flash_attention_forward_no_dropout_inplace", "_flash_attention_backward"):
        assert "sdpa_routing.py" in _cuda_kernel(f"aten::{op}"), op
    registry.restore_flash_attention_impl()
    assert registry.current_flash_attention_impl() is None
    assert "sdpa_routing.py" not in _cuda_kernel(SDPA_OP)


def test_a_torch_without_the_registry_is_told_what_to_use(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.delattr(torch.nn.attention, "register_flash_attention_impl")
    with pytest.raises(FeatureNotSupported, match="flashtune.scaled_dot_product_attention"):
        flashtune.register_sdpa()


def _sdpa_op(causal: bool) -> Callable[..., torch.Tensor]:
    """SDPA's flash operator on flash-attn's (B, N, H, D) layout."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._scaled_dot_product_flash_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)[0]
        return out.transpose(1, 2)
    return attend


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher", "poisoned_outputs", "routed_cpu")
@pytest.mark.parametrize(("shape", "head_dim", "dtype", "causal"), [
    ((1, 33, 33, 4, 2), 64, torch.float16, True),
    ((2, 17, 45, 2, 2), 128, torch.bfloat16, False),
], ids=["gqa-causal-d64-fp16", "full-d128-bf16"])
def test_routed_sdpa_forward_and_backward_follow_float64(
        shape: tuple[int, int, int, int, int], head_dim: int, dtype: torch.dtype,
        causal: bool) -> None:
    error_ratios(shape, head_dim, dtype, causal, SEED, attend=_sdpa_op(causal))


def _torch_sdpa_errors(attend: Callable[..., torch.Tensor], seqlens: tuple[int, int],
                       heads: tuple[int, int], dtype: torch.dtype, seed: int) -> None:
    """``attend(q, k, v)`` on (B, H, N, D) inputs against torch's own CPU
    scaled_dot_product_attention with ``is_causal=True`` (its top-left mask): O, dQ, dK and
    dV in float64 as the truth, flash-attn's 3x rule against torch in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    (seqlen_q, seqlen_k), (heads_q, heads_kv) = seqlens, heads
    inputs = [torch.randn(2, h, n, 64, generator=gen).to(dtype)
              for h, n in ((heads_q, seqlen_q), (heads_kv, seqlen_k), (heads_kv, seqlen_k))]
    dout = torch.randn(2, heads_q, seqlen_q, 64, generator=gen)

    def torch_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=heads_q != heads_kv)

    def run(fn: Callable[..., torch.Tensor], wide: bool) -> list[torch.Tensor]:
        leaves = [(t.double() if wide else t.clone()).requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        out.backward(dout.to(out.dtype))  # type: ignore[no-untyped-call]  # unannotated in torch
        return [out.detach().double()] + [t.grad.double() for t in leaves if t.grad is not None]

    exact, low, got = run(torch_sdpa, True), run(torch_sdpa, False), run(attend, False)
    where = f"L={seqlen_q} S={seqlen_k} heads={heads} {dtype} seed={seed}"
    for name, e, lo, g in zip(("O", "dQ", "dK", "dV"), exact, low, got, strict=True):
        ours, theirs = float((g - e).abs().max()), float((lo - e).abs().max())
        assert ours <= 3 * theirs + 1e-6, f"{where}: {name} error {ours} vs torch's {theirs}"


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher", "poisoned_outputs", "routed_cpu")
@pytest.mark.parametrize("seqlens", [(5, 37), (40, 9)], ids=["L<S", "L>S"])
def test_routed_sdpa_is_causal_with_l_not_s_is_torchs_top_left_mask(
        seqlens: tuple[int, int]) -> None:
    """SDPA's flash operator with is_causal and L != S, forward and backward, computes what
    torch's own SDPA computes (the mask aligned to the top-left corner)."""
    def routed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, is_causal=True)[0]
        return out

    _torch_sdpa_errors(routed, seqlens, (2, 2), torch.float16, SEED)


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher", "poisoned_outputs")
@pytest.mark.parametrize("seqlens", [(5, 37), (40, 9)], ids=["L<S", "L>S"])
def test_the_sdpa_drop_in_is_causal_with_l_not_s_is_torchs_top_left_mask(
        seqlens: tuple[int, int]) -> None:
    """flashtune.scaled_dot_product_attention with is_causal and L != S (GQA too), forward
    and backward, against torch's own SDPA."""
    def drop_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flashtune.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                      enable_gqa=True, backend="emulator")

    _torch_sdpa_errors(drop_in, seqlens, (4, 2), torch.float16, SEED + 1)


def _packed(lens: list[int], heads: int, dim: int, dtype: torch.dtype, seed: int
            ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(sum(lens), heads, dim, generator=gen).to(dtype) for _ in range(3))
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher", "poisoned_outputs", "routed_cpu")
def test_torch_varlen_attn_runs_on_flashtune() -> None:
    """torch.nn.attention.varlen.varlen_attn (packed, zero-length sequences included) with a
    causal mask and with a sliding window, against the float64 reference per sequence."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    seed = random.Random(SEED).randrange(2**31)
    rng = random.Random(seed)
    lens = [rng.randrange(0, 9) for _ in range(5)] + [rng.randrange(60, 130)]
    rng.shuffle(lens)
    q, k, v, cu = _packed(lens, 2, 64, torch.float16, seed)
    for window in ((-1, 0), (rng.randrange(4, 40), rng.randrange(0, 8))):
        out, lse = varlen_attn(q, k, v, cu, cu, max(lens), max(lens), window_size=window,
                               return_aux=AuxRequest(lse=True))
        ref_o, ref_lse = varlen_reference(q, k, v, cu, cu, False, 64 ** -0.5, window=window)
        where = f"seed={seed} lens={lens} window={window}"
        check_varlen_outputs(out, lse, ref_o, ref_lse, 4 * TOL[torch.float16], where)


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher", "routed_cpu")
@pytest.mark.parametrize("window", [random.Random(SEED).choice([(-1, 0), (12, 3)])], ids=str)
def test_gradients_through_routed_varlen_follow_flash_attns_rule(
        window: tuple[int, int]) -> None:
    """torch's varlen_attn backward (its own autograd formula calling the routed
    _flash_attention_backward) on packed sequences, a zero-length one included, against
    float64 autograd per sequence; causal or a sliding window, drawn from the run's seed."""
    from torch.nn.attention.varlen import varlen_attn

    lens = [30, 0, 9, 41]
    seed = random.Random(f"{SEED}-{window}").randrange(2**31)
    inputs, dout, cu, _ = packed_inputs(lens, lens, 2, 2, 32, torch.float16, seed)

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = varlen_attn(q, k, v, cu, cu, max(lens), max(lens), window_size=window)
        assert isinstance(out, torch.Tensor)
        return out

    def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int) -> torch.Tensor:
        scores, visible, v = feature_scores(q, k, v, False, window, None, None)
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)

    plain = per_sequence(dense, cu, cu)
    got = gradients(ours, inputs, dout)
    low = gradients(plain, inputs, dout)
    exact = gradients(plain, tuple(t.double() for t in inputs), dout)
    within_rule(got, low, exact, f"routed varlen window={window} seed={seed}")


@pytest.mark.usefixtures("routed_cpu")
@pytest.mark.parametrize(("call", "needle"), [
    (lambda q: torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.1),
     "dropout_p=0.1"),
    (lambda q: torch.ops.aten._scaled_dot_product_flash_attention(
        q, q, q, return_debug_mask=True), "return_debug_mask"),
    (lambda q: torch.ops.aten._flash_attention_forward(
        q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), None, None, 8, 8, 0.0, False,
        False, alibi_slopes=torch.ones(2)), "ALiBi slopes on inputs that require grad"),
    (lambda q: torch.ops.aten._flash_attention_forward(
        q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), None, None, 8, 8, 0.0, False,
        False, num_splits=2), "num_splits"),
], ids=["dropout", "debug-mask", "alibi-grad", "num-splits"])
def test_calls_flashtune_does_not_serve_are_refused(call: Callable[[torch.Tensor], Any],
                                                     needle: str) -> None:
    q = torch.randn(1, 2, 8, 32, dtype=torch.float16, requires_grad=True)
    with pytest.raises(FeatureNotSupported, match=needle) as info:
        call(q)
    assert "restore_flash_attention_impl" in str(info.value)


@pytest.mark.gpu
def test_gpu_sdpa_runs_flashtune_once_activated(registry: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU: torch.nn.functional.scaled_dot_product_attention, forced onto the flash
    backend, runs flashtune's kernels forward and backward within flash-attn's 3x rule."""
    calls: list[str] = []
    forward = sdpa_routing._Kernels.sdpa_forward

    def counted(self: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        calls.append("fwd")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(sdpa_routing._Kernels, "sdpa_forward", counted)
    flashtune.register_sdpa()
    registry.activate_flash_attention_impl("flashtune")

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)

    error_ratios((2, 500, 500, 4, 4), 128, torch.bfloat16, True, SEED, backend="cuda",
                 device="cuda", attend=attend)
    assert calls, "SDPA did not reach flashtune's kernels"
