"""Tracing modifications (codegen.trace): the traced expression means what the user's
Python function means (its float64 evaluation against the function itself, on dense index
grids, for every ready modification of api.flex_mods), operations outside the traced set
are refused with the operation and the user's line named, the key is the expression's
digest, and no text of the user's code reaches the CUDA source."""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from flashtune.api import flex_mods
from flashtune.codegen.trace import UnsupportedModification, trace
from flashtune.codegen.trace_expr import evaluate

_SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
B, H, L, S = 2, 3, 37, 53


def _grids() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(_SEED)
    return {"score": torch.randn(B, H, L, S, generator=gen, dtype=torch.float64) * 3,
            "batch": torch.arange(B).view(B, 1, 1, 1), "head": torch.arange(H).view(1, H, 1, 1),
            "q_idx": torch.arange(L).view(1, 1, L, 1), "kv_idx": torch.arange(S).view(1, 1, 1, S)}


def _library() -> dict[str, tuple[Callable[..., Any] | None, Callable[..., Any] | None]]:
    gen = torch.Generator().manual_seed(_SEED + 1)
    docs = torch.sort(torch.randint(0, 4, (max(L, S),), generator=gen)).values
    return {
        "t5": (flex_mods.t5_relative_bias(torch.randn(H, 32, generator=gen), max(L, S),
                                          max_distance=40), None),
        "alibi": (flex_mods.alibi(torch.rand(H, generator=gen)), None),
        "softcap": (flex_mods.softcap(2.5), None),
        "document": (None, flex_mods.document(docs)),
        "document-bidirectional": (None, flex_mods.document(docs, causal=False)),
        "prefix-lm": (None, flex_mods.prefix_lm(torch.tensor([5, 20]))),
        "sliding-window-causal": (None, flex_mods.sliding_window_causal(7)),
        "global-tokens": (None, flex_mods.global_tokens(3, 4)),
        "dilated-window": (None, flex_mods.dilated_window(4, 3)),
        "causal+softcap": (flex_mods.softcap(1.5), flex_mods.causal),
        "flashmask-causal": (None, flex_mods.flashmask(
            torch.arange(S) + torch.randint(0, 9, (H, S), generator=gen),
            torch.arange(S) + torch.randint(9, 20, (H, S), generator=gen))),
        "flashmask-bidirectional": (None, flex_mods.flashmask(
            torch.randint(20, 40, (B, H, S), generator=gen), None,
            torch.randint(0, 5, (S,), generator=gen), torch.randint(5, 15, (S,), generator=gen),
            causal=False)),
        "floor-ops": (lambda s, b, h, q, k: torch.where(
            (q - k) // 3 % 2 == 0, torch.minimum(s, (q - 2 * k) % 5 / 2.0), -torch.abs(s)
            + torch.sigmoid(s) * torch.exp(-s * s) - torch.log(1 + s * s) + (h - q) // -4), None),
    }


@pytest.mark.parametrize("name", list(_library()))
def test_the_expression_means_the_users_function(name: str) -> None:
    score_mod, mask_mod = _library()[name]
    traced = trace(score_mod, mask_mod)
    g = _grids()
    got = evaluate(traced.expression, g, list(traced.captured))
    want = g["score"]
    if score_mod is not None:
        want = score_mod(want, g["batch"], g["head"], g["q_idx"], g["kv_idx"]).to(torch.float64)
    if mask_mod is not None:
        keep = mask_mod(g["batch"], g["head"], g["q_idx"], g["kv_idx"])
        want = torch.where(keep, want, float("-inf"))
    want = want.expand(B, H, L, S)
    assert torch.equal(torch.isinf(got.expand_as(want)), torch.isinf(want)), name
    finite = torch.isfinite(want)
    # float32 captured tensors round in the user's function, not in the float64 evaluation.
    torch.testing.assert_close(got.expand_as(want)[finite], want[finite], rtol=1e-5, atol=1e-5)


def _line_of(fn: Callable[..., Any], offset: int) -> str:
    return f":{fn.__code__.co_firstlineno + offset} in {fn.__name__}"


def _math(s: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
    import math
    return math.tanh(s)


def _branch(s: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
    if q > k:
        return s
    return s


def _sin(s: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
    return torch.sin(s)


def _attribute(s: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
    return s.system


def _string(s: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
    return s + "); system(\"rm -rf /\"); (0"


def _slice(s: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
    return s + torch.zeros(4, 4)[q, :]


def _power(s: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
    return s ** 2


@pytest.mark.parametrize(("fn", "operation"), [
    (_math, "float() of a symbolic value"), (_branch, "Python control flow"),
    (_sin, "sin()"), (_attribute, "the attribute .system"),
    (_string, "an operand of type str"), (_slice, "an index of type slice"),
    (_power, "** (power)"),
])
def test_an_unsupported_operation_is_refused_naming_it_and_the_line(
        fn: Callable[..., Any], operation: str) -> None:
    with pytest.raises(UnsupportedModification) as info:
        trace(fn)
    message = str(info.value)
    assert operation in message, message
    assert any(_line_of(fn, n) in message for n in (1, 2)), message
    assert __file__ in message, message


def test_a_mask_must_be_a_comparison() -> None:
    with pytest.raises(UnsupportedModification, match="mask_mod returned a float"):
        trace(mask_mod=lambda b, h, q, k: q * 0.5)


class _EvilInt(int):
    def __repr__(self) -> str:
        return "0); asm(\"trap;\"); (0"

    __str__ = __repr__


class _EvilFloat(float):
    def __repr__(self) -> str:
        return "0.f); asm(\"trap;\"); (0"

    __str__ = __repr__


#: Every identifier the rendered expression may hold: the hook's arguments, the helpers,
#: CUDA math functions and the generated param names.
_TOKENS = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")
_ALLOWED = {"score", "batch", "head", "q_idx", "kv_idx", "ft", "flex", "floordiv", "mod",
            "fmodpy", "imin", "imax", "iabs", "sigmoid", "load1", "load2", "load3", "load4",
            "expf", "logf", "tanhf", "fabsf", "fminf", "fmaxf", "floorf", "INFINITY", "float",
            "int", "bool", "true", "false", "f", "e"}


def test_the_users_text_never_reaches_the_source() -> None:
    system_call = torch.ones(5, 5)  # a captured tensor whose variable name is C++-ish
    evil_int, evil_float = _EvilInt(3), _EvilFloat(0.25)

    def mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score * evil_float + system_call[q_idx % evil_int, kv_idx] - evil_int

    traced = trace(mod)
    assert "asm" not in traced.cuda and "system" not in traced.cuda and "trap" not in traced.cuda
    for token in _TOKENS.findall(traced.cuda):
        assert token in _ALLOWED or re.fullmatch(rf"{traced.name}_t\d+(_n\d+)?", token), token
    assert re.fullmatch(r"flex[0-9a-f]{12}", traced.name)
    assert " 3)" in traced.cuda and "0.25f" in traced.cuda  # the numbers, as numbers


def test_the_key_is_the_expressions_digest() -> None:
    def make(c: float, t: torch.Tensor) -> Callable[..., Any]:
        return lambda s, b, h, q, k: s * c + t[h]

    a = trace(make(0.5, torch.zeros(3)))
    assert a.name == trace(make(0.5, torch.ones(7))).name  # values are run-time arguments
    assert a.name != trace(make(0.25, torch.zeros(3))).name  # constants are the kernel's
    assert a.name != trace(make(0.5, torch.zeros(3, dtype=torch.int32))).name
    assert a.name != trace(make(0.5, torch.zeros(3)), tiles=True).name
    rng = random.Random(_SEED)
    c = rng.choice([0.1, 2.0, -3.5])
    assert trace(make(c, torch.zeros(2))).name == trace(make(c, torch.zeros(2))).name
