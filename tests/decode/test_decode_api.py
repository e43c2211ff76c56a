"""flashtune.attention_with_kvcache in the emulator: O and LSE against float64 attention over
each sequence's keys on a seeded sample of the grid (the whole grid behind the sweep
marker), the cache appended in place, split + combine equal to the unsplit call, the
split-count heuristic, and hostile inputs refused with clear errors (before a launch from
the metadata; from the kernel for lengths and pages, immediately)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from decode_cases import GRID, GridCase, call_api, inputs_of, problem_of, sample

import flashtune
from flashtune.api.decode import default_num_splits
from flashtune.api.kvcache_ops import attention_with_kvcache_op
from flashtune.api.validate_kvcache import check_kvcache_inputs
from flashtune.errors import BackwardNotAvailable, InvalidInput
from flashtune.families.base import Inputs, close_enough
from flashtune.families.checks import LSE_TOLERANCE, O_TOLERANCE
from flashtune.families.decode.reference import (
    attention_with_kvcache_reference,
    expected_caches,
)

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])


def _call(inputs: Inputs, causal: bool, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = call_api(inputs, causal=causal, return_lse=True, backend="emulator", **kwargs)
    return out, lse


def _check(inputs: Inputs, causal: bool, out: torch.Tensor, lse: torch.Tensor) -> None:
    ref_o, ref_lse = attention_with_kvcache_reference(inputs, causal)
    dtype = flashtune.DType.FP16 if out.dtype == torch.float16 else flashtune.DType.BF16
    for name, got, want, tol in (("O", out, ref_o, O_TOLERANCE[dtype]),
                                 ("LSE", lse, ref_lse, LSE_TOLERANCE)):
        _, _, wrong = close_enough(name, got, want, tol)
        assert not wrong, wrong
    for name, want in expected_caches(inputs).items():
        got = inputs.tensors[name]
        assert ((got == want) | (torch.isnan(got) & torch.isnan(want))).all(), name


def _check_grid_case(case: GridCase) -> None:
    inputs = inputs_of(case, problem_of(case))
    out, lse = _call(inputs, case.causal, num_splits=case.num_splits)
    _check(inputs, case.causal, out, lse)


@pytest.mark.emulator
@pytest.mark.parametrize("case", sample(SEED + 1, 6), ids=lambda c: c.key)
def test_attention_with_kvcache_matches_float64(case: GridCase) -> None:
    _check_grid_case(case)


@pytest.mark.sweep
@pytest.mark.emulator
@pytest.mark.parametrize("case", GRID, ids=lambda c: c.key)
def test_attention_with_kvcache_whole_grid(case: GridCase) -> None:
    _check_grid_case(case)


@pytest.mark.emulator
def test_split_and_combine_equal_the_unsplit_call_and_the_heuristic_is_used() -> None:
    case = GridCase(16, 4, (8, 2), True, False, 1, seed=SEED)
    inputs = inputs_of(case, problem_of(case))
    unsplit, unsplit_lse = _call(inputs, True, num_splits=1)
    no_key = torch.isposinf(unsplit_lse)  # sequence 0 is empty, sequence 1 full
    assert no_key[0].all() and not no_key[1].any()
    assert (unsplit[0] == 0).all()
    for splits in (2, 5, 19, 128, None, 0):  # 0: flash-attn's "choose", as None
        out, lse = _call(inputs, True, num_splits=splits)
        assert torch.allclose(out.float(), unsplit.float(), atol=2e-3, rtol=2e-3), splits
        assert torch.allclose(lse, unsplit_lse, atol=1e-5, rtol=1e-6), splits
    layout = check_kvcache_inputs(inputs.tensors["q"], inputs.tensors["k_cache"],
                                  inputs.tensors["v_cache"], inputs.tensors["cache_seqlens"],
                                  inputs.tensors["block_table"])
    decode, _ = flashtune.explain_kvcache(inputs.tensors["q"], inputs.tensors["k_cache"],
                                          inputs.tensors["v_cache"],
                                          inputs.tensors["cache_seqlens"],
                                          block_table=inputs.tensors["block_table"],
                                          causal=True, backend="emulator")
    chosen = default_num_splits(layout, decode.config.block_m, decode.config.block_n, 132)
    assert chosen > 1  # 3 sequences x 2 kv heads on a 132-SM virtual GPU: split


@pytest.mark.emulator
def test_the_custom_op_path_and_its_fake_agree() -> None:
    case = GridCase(None, 2, (4, 2), False, True, 3, seed=SEED)
    inputs = inputs_of(case, problem_of(case))
    t = inputs.tensors
    direct = _call(inputs, False, num_splits=3)[0]
    via_op, _ = attention_with_kvcache_op(t["q"], t["k_cache"], t["v_cache"],
                                          t["cache_seqlens"], None, t["k_new"], t["v_new"],
                                          False, 0.125, 3, "emulator")
    assert torch.equal(direct, via_op)
    meta = {n: x.to("meta") for n, x in t.items()}
    fake, fake_lse = flashtune.attention_with_kvcache(
        meta["q"], meta["k_cache"], meta["v_cache"], meta["cache_seqlens"], k=meta["k_new"],
        v=meta["v_new"], return_lse=True)
    assert fake.shape == direct.shape and fake_lse.shape == (3, 4, 2)


# ------------------------------------------------------------------------- bad inputs


def _tensors() -> tuple[Inputs, dict[str, Any]]:
    case = GridCase(16, 2, (4, 2), True, True, 2, seed=SEED)
    inputs = inputs_of(case, problem_of(case))
    t = inputs.tensors
    kwargs = {"q": t["q"], "k_cache": t["k_cache"], "v_cache": t["v_cache"],
              "cache_seqlens": t["cache_seqlens"], "block_table": t["block_table"],
              "k": t["k_new"], "v": t["v_new"]}
    return inputs, kwargs


def _api(kwargs: dict[str, Any], **extra: Any) -> Any:
    args = dict(kwargs)
    positional = [args.pop(n) for n in ("q", "k_cache", "v_cache", "cache_seqlens")]
    call: Any = flashtune.attention_with_kvcache
    return call(*positional, **args, causal=True, backend="emulator", **extra)


_META_CASES: list[tuple[str, Any, str]] = [
    ("q", lambda t: t.float(), "q has dtype torch.float32"),
    ("k_cache", lambda t: t.bfloat16(), "k_cache has dtype torch.bfloat16"),
    ("cache_seqlens", lambda t: t.long(), "cache_seqlens has dtype torch.int64; expected "
                                          "torch.int32"),
    ("block_table", lambda t: t.long(), "block_table has dtype torch.int64"),
    ("block_table", lambda t: t.to("meta"), "block_table is on meta but q is on cpu"),
    ("cache_seqlens", lambda t: t[:2], r"cache_seqlens has shape \(2\); expected \(3,\)"),
    ("block_table", lambda t: t[:, :0], "max_pages >= 1"),
    ("k", lambda t: t[:, :, :1], "expected both"),
    ("v", lambda t: None, "pass both k and v"),
    ("k_cache", lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2),
     "stride .* in its last"),
    ("k_cache", lambda t: t[:1].expand(t.shape[0], *t.shape[1:]), "share memory"),
    ("v_cache", lambda t: t[:, :, :1], "k_cache has shape .* but v_cache has"),
    ("q", lambda t: t[..., :8], "q has head_dim 8 but the cache has 64"),
    ("block_table", lambda t: t.t().contiguous().t(), "block_table has stride"),
    ("q", lambda t: t.repeat(1, 1, 1, 2)[..., 1:65], "stride|aligned"),
]


@pytest.mark.parametrize("name, edit, message", _META_CASES,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(_META_CASES)])
def test_hostile_metadata_is_refused_before_a_launch(name: str, edit: Any,
                                                     message: str) -> None:
    _, kwargs = _tensors()
    kwargs[name] = edit(kwargs[name])
    with pytest.raises(InvalidInput, match=message):
        _api(kwargs)


def test_bad_num_splits_scale_and_grad_are_refused() -> None:
    _, kwargs = _tensors()
    for bad in (-1, 129, True, 2.0):
        with pytest.raises(InvalidInput, match="num_splits"):
            _api(kwargs, num_splits=bad)
    with pytest.raises(InvalidInput, match="softmax_scale"):
        _api(kwargs, softmax_scale=-1.0)
    kwargs["q"] = kwargs["q"].clone().requires_grad_()
    with pytest.raises(BackwardNotAvailable):
        _api(kwargs)


@pytest.mark.emulator
@pytest.mark.parametrize("edit, message", [
    ("table_high", r"block_table\[1, 5\] = 60 is not a page of the cache.*\[0, 60\)"),
    ("table_negative", r"block_table\[2, 0\] = -1 is not a page"),
    ("negative", r"cache_seqlens\[0\] = -3 is negative"),
    ("beyond", r"cache_seqlens\[2\] = 303 plus the 2 appended rows exceeds the cache "
               r"capacity of 304 rows"),
])
def test_bad_lengths_and_pages_raise_at_once_on_the_emulator(edit: str,
                                                            message: str) -> None:
    inputs, kwargs = _tensors()
    if edit.startswith("table"):
        table = kwargs["block_table"].clone()
        if edit == "table_high":
            table[1, 5] = 60
        else:
            table[2, 0] = -1
        kwargs["block_table"] = table
    else:
        lengths = kwargs["cache_seqlens"].clone()
        lengths[0 if edit == "negative" else 2] = -3 if edit == "negative" else 303
        kwargs["cache_seqlens"] = lengths
    before = [kwargs[n].clone() for n in ("k_cache", "v_cache")]
    with pytest.raises(InvalidInput, match=message):
        _api(kwargs)
    # Refused before anything is written: the valid sequences' rows were not appended.
    assert all(torch.equal(kwargs[n].view(torch.int16), b.view(torch.int16))
               for n, b in zip(("k_cache", "v_cache"), before, strict=True))
    # Slots past a sequence's pages may hold anything: -1 there is never looked at.
    table = inputs.tensors["block_table"]
    assert (table[0, 1:] == -1).all()  # sequence 0 holds only its 2 new rows, in slot 0
    _api(dict(kwargs, block_table=table, cache_seqlens=inputs.tensors["cache_seqlens"]))


@pytest.mark.emulator
def test_a_page_shared_while_appending_is_refused_and_a_shared_prefix_is_not() -> None:
    """A page that one sequence appends into and another slot uses is refused before
    anything is written; pages only read by several sequences (a shared prefix) are
    served."""
    inputs, kwargs = _tensors()
    lengths = inputs.tensors["cache_seqlens"].tolist()
    table = kwargs["block_table"].clone()
    page_size = kwargs["k_cache"].shape[1]
    writing = lengths[2] // page_size  # the slot sequence 2 appends into
    assert lengths[1] > page_size  # sequence 1 reads its slot 0
    table[2, writing] = table[1, 0]
    before = [kwargs[n].clone() for n in ("k_cache", "v_cache")]
    with pytest.raises(InvalidInput, match=rf"block_table\[2, {writing}\] = "
                                           rf"{int(table[1, 0])}: sequence 2 appends.*"
                                           r"block_table\[1, 0\] \(sequence 1\).*copy"):
        _api(dict(kwargs, block_table=table))
    assert all(torch.equal(kwargs[n].view(torch.int16), b.view(torch.int16))
               for n, b in zip(("k_cache", "v_cache"), before, strict=True))
    # Without new rows the same table is only read: served, against float64.
    shared = dict(inputs.tensors, block_table=table)
    for name in ("k_new", "v_new"):
        shared.pop(name)
    read_only = Inputs(shared, inputs.scalars)
    out, lse = _call(read_only, True)
    _check(read_only, True, out, lse)


@pytest.mark.parametrize("missing", ["k_cache", "v_cache", "cache_seqlens", "q"])
def test_a_missing_tensor_is_named(missing: str) -> None:
    _, kwargs = _tensors()
    kwargs[missing] = None
    with pytest.raises(InvalidInput, match=f"{missing} must be a torch.Tensor .* got "
                                           "NoneType"):
        _api(kwargs)


@pytest.mark.emulator
@pytest.mark.parametrize("append", [True, False], ids=["append", "noappend"])
def test_a_head_dim_not_a_multiple_of_8_is_padded(append: bool) -> None:
    """Head dim 59 (the forward pads it; so does decoding): O and LSE against float64 over
    the unpadded tensors, and the new rows appended into the caller's own caches."""
    case = GridCase(16, 2, (4, 2), True, append, 2, seed=SEED)
    wide = inputs_of(case, problem_of(case))
    tensors = {n: t[..., :59].contiguous() if t.dim() == 4 else t
               for n, t in wide.tensors.items()}
    inputs = Inputs(tensors, dict(wide.scalars, softmax_scale=59 ** -0.5))
    out, lse = _call(inputs, True)
    assert out.shape[-1] == 59
    _check(inputs, True, out, lse)
