"""Input validation of the public API: every bad input gets an InvalidInput that says what was
wrong, what was expected and how to fix it."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from runtime_helpers import qkv

import flashtune
from flashtune.api import validate
from flashtune.api.validate import check_attention_inputs, check_softmax_scale
from flashtune.errors import InvalidInput


def _good(**kw: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = {"batch": 2, "seqlen_q": 24, "seqlen_k": 40, "heads_q": 4, "heads_kv": 2,
            "head_dim": 64}
    args.update(kw)
    return qkv(**args)  # type: ignore[arg-type]


def _raises(q: object, k: object, v: object, *fragments: str) -> str:
    with pytest.raises(InvalidInput) as info:
        check_attention_inputs(q, k, v)  # type: ignore[arg-type]
    text = str(info.value)
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in {text!r}"
    return text


def test_valid_inputs_pass() -> None:
    check_attention_inputs(*_good())
    check_attention_inputs(*_good(heads_kv=1))  # MQA
    check_attention_inputs(*qkv(1, 1, 1, 1, 1, 8, dtype=torch.bfloat16))
    q, k, v = _good()
    check_attention_inputs(q.to("meta"), k.to("meta"), v.to("meta"))


def test_not_a_tensor() -> None:
    q, k, v = _good()
    _raises(q.tolist(), k, v, "q must be a torch.Tensor", "got list", "torch.as_tensor")


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_wrong_rank(which: str) -> None:
    t = dict(zip("qkv", _good(), strict=True))
    t[which] = t[which][0]
    _raises(t["q"], t["k"], t["v"], f"{which} has 3 dims", "expected 4 dims",
            "scaled_dot_product_attention")


def test_dtype_float32() -> None:
    q, k, v = _good()
    _raises(q.float(), k.float(), v.float(), "dtype torch.float32", "float16 or torch.bfloat16",
            "q.half()")


def test_mixed_dtypes() -> None:
    q, k, v = _good()
    _raises(q, k, v.bfloat16(), "v has dtype torch.bfloat16 but q has torch.float16",
            "v.to(q.dtype)")


def test_mixed_devices() -> None:
    q, k, v = _good()
    _raises(q, k.to("meta"), v, "k is on meta but q is on cpu", "k.to(q.device)")


def test_batch_mismatch() -> None:
    q, _, _ = _good()
    _, k, v = _good(batch=3)
    _raises(q, k, v, "q has batch 2 but k and v have 3", "equal batch")


def test_k_v_shape_mismatch() -> None:
    q, k, v = _good()
    _raises(q, k, v[:, :-8], "k has shape (2, 40, 2, 64) but v has (2, 32, 2, 64)",
            "equal shapes")


def test_head_dim_mismatch() -> None:
    q, _, _ = _good()
    _, k, v = _good(head_dim=32)
    _raises(q, k, v, "q has head_dim 64 but k and v have 32")


@pytest.mark.parametrize("head_dim,fix", [(60, "pad q, k and v with zeros to head_dim 64"),
                                          (264, "the limit is 256"),
                                          (512, "the limit is 256")])
def test_unsupported_head_dim(head_dim: int, fix: str) -> None:
    _raises(*_good(head_dim=head_dim), f"head_dim={head_dim} is not supported", fix)


def test_split_qk_and_v_head_dims_are_refused_naming_the_fix() -> None:
    """Where one head dim is taken (every call but attention's forward)."""
    q, k, _ = _good(head_dim=192)
    _, _, v = _good(head_dim=128)
    _raises(q, k, v, "v has head dim 128 but q and k have 192",
            "this call takes one head dim for Q, K and V",
            "flashtune.attention's forward takes a V head dim of its own",
            "Pad the smaller one with zeros")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", [torch.jagged, torch.strided], ids=["jagged", "strided"])
@pytest.mark.parametrize("head_dim", [64, 59])
@pytest.mark.parametrize("which", ["q", "k"])
def test_nested_tensors_are_refused_by_attention(layout: torch.layout, head_dim: int,
                                                 which: str) -> None:
    """flashtune's own InvalidInput, not torch's internal error (also for a head dim that
    would be padded, and for a nested k beside a dense q)."""
    nested = torch.nested.nested_tensor(
        [torch.randn(8, 2, head_dim, dtype=torch.float16),
         torch.randn(5, 2, head_dim, dtype=torch.float16)], layout=layout)
    dense = torch.randn(2, 8, 2, head_dim, dtype=torch.float16)
    q, k = (nested, dense) if which == "q" else (dense, nested)
    with pytest.raises(InvalidInput, match=f"{which} is a nested tensor.*to_padded_tensor"):
        flashtune.attention(q, k, k, backend="emulator")


def test_heads_not_divisible() -> None:
    _raises(*_good(heads_q=5, heads_kv=2), "q has 5 heads but k and v have 2",
            "multiple of the k/v heads", "Repeat k and v")


@pytest.mark.parametrize("field", ["batch", "seqlen_q", "seqlen_k", "heads_q"])
def test_empty(field: str) -> None:
    kw = {field: 0}
    if field == "heads_q":
        kw["heads_kv"] = 0
    q, k, v = _good(**kw)
    name = "k" if field == "seqlen_k" else "q"
    _raises(q, k, v, f"{name} is empty", ">= 1")


def test_last_dim_stride() -> None:
    q, k, v = _good()
    q2 = torch.empty(2, 24, 4, 128, dtype=q.dtype)[..., ::2]
    assert q2.shape == q.shape
    _raises(q2, k, v, "q has stride 2 in its last (head_dim) dim", "expected 1",
            "q.contiguous()")


def test_row_stride_not_multiple_of_8() -> None:
    q, k, v = _good()
    # rows of 132 elements holding two heads of 64: strides (5280, 132, 64, 1)
    wide = torch.empty(2, 40, 132, dtype=k.dtype).as_strided((2, 40, 2, 64),
                                                             (40 * 132, 132, 64, 1))
    assert wide.shape == k.shape
    _raises(q, wide, v, "k has stride 132 in its seqlen dim", "multiples of 8",
            "k.contiguous()")


def test_grid_limit() -> None:
    q = torch.empty(65536, 1, 1, 8, dtype=torch.float16)
    _raises(q, q, q, "batch=65536", "<= 65535", "Split the call")


def test_fast_path_agrees_with_detailed_checks() -> None:
    """The hot-path predicate accepts exactly what the detailed checks accept."""
    base = dict(batch=2, seqlen_q=24, seqlen_k=40, heads_q=4, heads_kv=2, head_dim=64)
    variants = [{}, {"head_dim": 60}, {"head_dim": 8}, {"head_dim": 256}, {"head_dim": 264},
                {"heads_q": 6}, {"heads_kv": 3}, {"batch": 0}, {"seqlen_k": 0}]
    for change, dtype, transpose in itertools.product(
            variants, (torch.float16, torch.float32), (False, True)):
        q, k, v = qkv(**{**base, **change}, dtype=dtype)  # type: ignore[arg-type]
        if transpose:  # SDPA-style views: (B, H, N, D) memory seen as (B, N, H, D)
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
        detailed_ok = True
        try:
            for check in (validate._check_types, validate._check_rank, validate._check_dtypes,
                          validate._check_devices, validate._check_shapes,
                          validate._check_strides):
                check(q, k, v)
        except InvalidInput:
            detailed_ok = False
        assert validate._valid(q, k, v) == detailed_ok, (change, dtype, transpose)


@pytest.mark.parametrize("shape,strides,ok", [
    ((1, 24, 4, 64), (7, 256, 64, 1), True),      # batch of 1: its stride is never used
    ((2, 24, 4, 64), (6148, 256, 64, 1), False),  # batch stride not a multiple of 8
    ((2, 1, 4, 64), (256, 3, 64, 1), True),       # one row: row stride unused
    ((2, 24, 1, 64), (1536, 64, 5, 1), True),     # one head: head stride unused
    ((2, 24, 4, 64), (6144, 256, 68, 1), False),  # head stride 68
    ((2, 24, 4, 64), (0, 0, 0, 1), True),         # broadcast (expanded) views
])
def test_strides_of_q(shape: tuple[int, ...], strides: tuple[int, ...], ok: bool) -> None:
    _, k, v = _good(batch=shape[0], heads_kv=1)
    q = torch.empty(20_000, dtype=torch.float16).as_strided(shape, strides)
    if ok:
        check_attention_inputs(q, k, v)
    else:
        _raises(q, k, v, "multiples of 8 elements")


def test_softmax_scale() -> None:
    assert check_softmax_scale(None, 64) == pytest.approx(0.125)
    assert check_softmax_scale(2, 64) == 2.0
    for bad, text in ((math.nan, "not finite"), (-1.0, "positive"), (0.0, "positive"),
                      ("0.1", "must be a float"), (True, "must be a float")):
        with pytest.raises(InvalidInput, match=text):
            check_softmax_scale(bad, 64)


def test_public_api_validates(pyref: object) -> None:
    q, k, v = _good()
    with pytest.raises(InvalidInput, match="dtype torch.float32"):
        flashtune.attention(q.float(), k.float(), v.float(), backend="pyref")
    with pytest.raises(InvalidInput, match="causal=1 must be a bool"):
        flashtune.attention(q, k, v, causal=1, backend="pyref")  # type: ignore[call-overload]
    with pytest.raises(InvalidInput, match="softmax_scale"):
        flashtune.attention(q, k, v, softmax_scale=-0.5, backend="pyref")


def test_cpu_tensors_need_the_emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLASHTUNE_BACKEND", raising=False)
    q, k, v = _good()
    with pytest.raises(InvalidInput, match="backend='emulator' or FLASHTUNE_BACKEND=emulator"):
        flashtune.attention(q, k, v)
    with pytest.raises(InvalidInput, match="backend 'cuda' runs on CUDA tensors but the "
                                           "tensors are on cpu"):
        flashtune.attention(q, k, v, backend="cuda")
    with pytest.raises(InvalidInput, match="backend='nope' is unknown; expected one of"):
        flashtune.attention(q, k, v, backend="nope")


def test_misaligned_base_pointer(pyref: object) -> None:
    q, k, v = _good()
    flat = torch.empty(q.numel() + 4, dtype=q.dtype)
    shifted = flat[4:].view(q.shape)  # 8 bytes past an aligned allocation
    shifted.copy_(q)
    with pytest.raises(InvalidInput, match="q start.*not 16-byte aligned.*clone"):
        flashtune.attention(shifted, k, v, backend="pyref")


class TestSdpaArguments:
    def _bhnd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = _good(heads_kv=4, seqlen_k=24)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def test_attn_mask(self) -> None:
        q, k, v = self._bhnd()
        rows = q.shape[2]
        with pytest.raises(InvalidInput, match="attn_mask has dtype torch.int64; expected "
                                               "torch.bool"):
            flashtune.scaled_dot_product_attention(
                q, k, v, attn_mask=torch.ones(rows, 24, dtype=torch.int64))
        with pytest.raises(InvalidInput, match=r"attn_mask has shape \(5, 24\); expected one "
                                               "broadcastable to"):
            flashtune.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 24))
        with pytest.raises(InvalidInput, match="attn_mask together with is_causal"):
            flashtune.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(rows, 24),
                                                   is_causal=True)

    def test_dropout_of_one(self) -> None:
        q, k, v = self._bhnd()
        with pytest.raises(InvalidInput, match=r"dropout_p=1.0 is not in \[0, 1\)"):
            flashtune.scaled_dot_product_attention(q, k, v, dropout_p=1.0)

    def test_gqa_needs_enable_gqa(self) -> None:
        q, k, v = self._bhnd()
        with pytest.raises(InvalidInput, match="query has 4 heads but key/value have 2.*"
                                               "enable_gqa=True"):
            flashtune.scaled_dot_product_attention(q, k[:, :2], v[:, :2])

    def test_rank(self) -> None:
        q, k, v = self._bhnd()
        with pytest.raises(InvalidInput, match="query is \\(4, 24, 64\\); expected a 4-D"):
            flashtune.scaled_dot_product_attention(q[0], k, v)


def test_softmax_scale_accepts_real_numbers() -> None:
    import numpy as np

    value = check_softmax_scale(np.float32(0.5), 64)
    assert value == 0.5 and type(value) is float
