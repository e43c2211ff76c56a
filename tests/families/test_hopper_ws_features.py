"""The warp-specialised sm_90a forward (``fwd90aws``) with the features it declares: sliding
windows (key tiles below every row's window never loaded, tiles inside it unmasked), softcap,
ALiBi, varlen (packs with zero-length sequences, Nq != Nk) and sinks, alone, with causal
masks and together, in the default schedule (ping-pong and overlap) and the plain one.

Every case runs the family's kernel in the emulator as a virtual sm_90a on fresh inputs from
a printed seed, with NaN-poisoned outputs, against a float64 reference written here from
the definitions (scores, tanh cap, |i + Nk - Nq - j| bias, window, sink in the
denominator), and against the family's own float64 reference. A counter test checks that a
narrow window loads fewer key bytes (it fails when tile skipping is disabled), and the
serving test that a cc 9.0 device runs these problems and dropout on ``fwd90aws`` (dropout's
numerics: tests/families/test_dropout_kernels.py). The default run takes a seeded sample
(``FLASHTUNE_TEST_SEED`` replays it), ``-m sweep`` the grid.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import random
from typing import Any, TypedDict, cast

import pytest
import torch
from dropout_philox import float32, mask
from grad_helpers import feature_scores, gradients, make_inputs, within_rule
from hopper_sample import emulate, forward_ops
from sampling import seeded_part
from serving_fixtures import (  # noqa: F401  (fixtures, by name)
    dispatcher,
    on_virtual_sm90a,
    source,
)

import flashtune
from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families.base import Inputs
from flashtune.families.hopper import space
from flashtune.families.hopper.ws import HOPPER_WS_FORWARD
from flashtune.runtime import first_use
from flashtune.runtime.backends.emulator import LaunchOptions
from flashtune.toolchain.compiler import compile_source

pytestmark = pytest.mark.emulator

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
SM90A = get_arch("sm_90a")
FAMILY = HOPPER_WS_FORWARD

#: (switches, window or None for a drawn one): each feature alone, with causal, together.
FEATURES: list[tuple[dict[str, bool], tuple[int, int] | None]] = [
    ({"window": True}, (16, 0)), ({"window": True}, (3, 40)), ({"window": True}, None),
    ({"softcap": True}, None), ({"softcap": True, "causal": True}, None),
    ({"alibi": True}, None), ({"alibi": True, "causal": True}, None),
    ({"sinks": True}, None), ({"sinks": True, "causal": True}, None),
    ({"window": True, "softcap": True, "alibi": True, "sinks": True}, (40, 8)),
    ({"varlen": True}, None), ({"varlen": True, "causal": True}, None),
    ({"varlen": True, "window": True, "softcap": True, "sinks": True}, (20, 5)),
    ({"varlen": True, "alibi": True, "causal": True}, None)]
#: GQA with odd lengths over several key tiles; Nq < Nk; Nq > Nk (varlen: up to these).
SHAPES = [Shape(1, 4, 2, 70, 150), Shape(2, 2, 1, 33, 130), Shape(3, 2, 2, 150, 70)]
#: Query and key lengths of the varlen packs: zero-length sequences on either side.
PACKS = [([37, 0, 65, 1], [50, 20, 0, 130]), ([70, 9], [70, 9]), ([0, 130], [64, 3])]

Case = tuple[dict[str, bool], tuple[int, int] | None, int, DType, str, Shape]


def _problem(switches: dict[str, bool], head_dim: int, dtype: DType) -> Problem:
    return Problem(head_dim, dtype, op=FAMILY.op, **cast(dict[str, Any], switches))


def _config(problem: Problem, schedule: str) -> KernelConfig:
    """The default config ("default": ping-pong and overlap) or the plain schedule."""
    config = FAMILY.default_config(problem, SM90A)
    if schedule == "plain":
        config = FAMILY.config({**FAMILY.point(config), space.PINGPONG: 0, space.OVERLAP: 0})
    return config


def _packed(problem: Problem, shape: Shape, pack: tuple[list[int], list[int]],
            seed: int) -> Inputs:
    """Varlen inputs of the lengths ``pack`` (the family's feature values otherwise)."""
    base = FAMILY.random_inputs(problem, Shape(len(pack[0]), shape.heads_q, shape.heads_kv,
                                               shape.seqlen_q, shape.seqlen_k), "cpu", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    dtype = base.tensors["q"].dtype
    lens_q, lens_k = pack
    tensors = dict(base.tensors)
    for name, rows, heads, dim in (("q", sum(lens_q), shape.heads_q, problem.head_dim),
                                   ("k", sum(lens_k), shape.heads_kv, problem.head_dim),
                                   ("v", sum(lens_k), shape.heads_kv, problem.v_head_dim)):
        tensors[name] = torch.randn(1, max(rows, 1), heads, dim, generator=gen).to(dtype)
    for name, lens in (("cu_seqlens_q", lens_q), ("cu_seqlens_k", lens_k)):
        tensors[name] = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    scalars = {**base.scalars, "max_seqlen_q": float(max(lens_q))}
    return Inputs(tensors, scalars)


def _inputs(problem: Problem, shape: Shape, window: tuple[int, int] | None, seed: int
            ) -> Inputs:
    if problem.varlen:
        inputs = _packed(problem, shape, PACKS[seed % len(PACKS)], seed)
    else:
        inputs = FAMILY.random_inputs(problem, shape, "cpu", seed=seed)
    if window is not None:
        inputs = Inputs(inputs.tensors, {**inputs.scalars, "window_left": window[0],
                                         "window_right": window[1]})
    return inputs


class _Attend64Keywords(TypedDict):
    """The keywords of ``_attend64``."""

    causal: bool
    window: tuple[int, int] | None
    cap: float | None
    scale: float


def _attend64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_slopes: torch.Tensor | None,
              sinks: torch.Tensor | None, *, causal: bool, window: tuple[int, int] | None,
              cap: float | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """O (Nq, Hq, D) and LSE (Hq, Nq) of one sequence in float64 from the definitions:
    s = scale q.k, then cap tanh(s / cap), then - slope |i + Nk - Nq - j|; row i sees key j
    iff j <= i + Nk - Nq (causal) or i + Nk - Nq - left <= j <= i + Nk - Nq + right (window,
    -1: unbounded); the sink joins the denominator. A row that sees nothing (and has no
    sink) has O = 0 and LSE = +inf."""
    nq, hq, _ = q.shape
    nk, hkv, _ = k.shape
    group = hq // hkv
    out = torch.zeros(nq, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((hq, nq), math.inf, dtype=torch.float64)
    if nq == 0:
        return out, lse
    i = torch.arange(nq, dtype=torch.float64)[:, None]
    j = torch.arange(nk, dtype=torch.float64)[None, :]
    diag = i + nk - nq
    visible = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        visible &= j <= diag
    if window is not None:
        left, right = window
        if right >= 0:
            visible &= j <= diag + right
        if left >= 0:
            visible &= j >= diag - left
    for h in range(hq):
        s = (q[:, h].double() @ k[:, h // group].double().T) * scale
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        if head_slopes is not None:
            s = s - float(head_slopes[h]) * (diag - j).abs()
        s = s.masked_fill(~visible, -math.inf)
        terms = [s]
        if sinks is not None:
            terms.append(torch.full((nq, 1), float(sinks[h]), dtype=torch.float64))
        full = torch.cat(terms, dim=1)
        m = (full.max(dim=1, keepdim=True).values if full.shape[1]
             else torch.zeros(nq, 1, dtype=torch.float64))
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        denom = torch.exp(full - m).sum(dim=1, keepdim=True)
        seen = denom[:, 0] > 0
        p = torch.where(seen[:, None], torch.exp(s - m) / denom.clamp_min(1e-300), 0.0)
        out[:, h] = p @ v[:, h // group].double()
        lse[h] = torch.where(seen, (m + denom.log())[:, 0], torch.full_like(m[:, 0], math.inf))
    return out, lse


def _reference64(problem: Problem, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """O and LSE of the whole launch (packed for varlen) in the kernel's layouts."""
    t, s = inputs.tensors, inputs.scalars
    window = ((int(s["window_left"]), int(s["window_right"])) if problem.window else None)
    cap = float(s["softcap"]) if problem.softcap else None
    sinks = t.get("sinks")
    slopes = t.get("alibi_slopes")
    kw: _Attend64Keywords = {"causal": problem.causal, "window": window, "cap": cap,
                             "scale": float(s["softmax_scale"])}
    if problem.varlen:
        cq, ck = t["cu_seqlens_q"].tolist(), t["cu_seqlens_k"].tolist()
        o = torch.zeros(*t["q"].shape[:-1], t["v"].shape[-1], dtype=torch.float64)
        lse = torch.full((1, t["q"].shape[2], t["q"].shape[1]), math.inf, dtype=torch.float64)
        for b in range(len(cq) - 1):
            rows = slice(cq[b], cq[b + 1])
            keys = slice(ck[b], ck[b + 1])
            ob, lb = _attend64(t["q"][0, rows], t["k"][0, keys], t["v"][0, keys],
                               None if slopes is None else slopes[b], sinks, **kw)
            o[0, rows], lse[0, :, rows] = ob, lb
        return o, lse
    batch = t["q"].shape[0]
    pairs = [_attend64(t["q"][b], t["k"][b], t["v"][b], None if slopes is None else slopes[b],
                       sinks, **kw) for b in range(batch)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def _launch(problem: Problem, config: KernelConfig, shape: Shape, inputs: Inputs,
            options: LaunchOptions | None = None) -> tuple[dict[str, torch.Tensor], object]:
    return emulate(FAMILY, problem, config, shape, inputs, options)


def _check(case: Case, seed: int) -> None:
    switches, window, head_dim, dtype, schedule, shape = case
    problem = _problem(switches, head_dim, dtype)
    config = _config(problem, schedule)
    inputs = _inputs(problem, shape, window, seed)
    outputs, _ = _launch(problem, config, shape, inputs)
    values = {k: v for k, v in inputs.scalars.items() if k != "softmax_scale"}
    where = f"{problem.key()} {config.key()} {shape.key()} {values} seed={seed}"
    verdict = FAMILY.compare(problem, shape, outputs, FAMILY.reference(problem, inputs))
    assert verdict.ok, f"{where}: {verdict.message}"
    assert_matches64(problem, inputs, outputs, where)


def assert_matches64(problem: Problem, inputs: Inputs, outputs: dict[str, torch.Tensor],
                     where: str) -> None:
    """O and the LSE of ``outputs`` written everywhere and within a few units of the output
    dtype's rounding of ``_reference64`` (flash-attn's order of tolerance)."""
    o64, lse64 = _reference64(problem, inputs)
    o, lse = outputs["o"], outputs["lse"]
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), f"{where}: unwritten"
    tol = 4e-2 if problem.dtype == DType.BF16 else 5e-3
    err = float((o.double() - o64).abs().max()) if o.numel() else 0.0
    assert err <= tol, f"{where}: max |O - O64| = {err:.3g} > {tol}"
    finite = torch.isfinite(lse64)
    assert torch.equal(torch.isfinite(lse), finite), f"{where}: LSE +inf rows differ"
    lse_err = float((lse.double()[finite] - lse64[finite]).abs().max()) if finite.any() else 0.0
    assert lse_err <= 1e-2, f"{where}: max |LSE - LSE64| = {lse_err:.3g}"


def _grid() -> list[Case]:
    """Every feature set, head dim, dtype, schedule and shape."""
    return [(switches, window, head_dim, dtype, schedule, shape)
            for (switches, window), head_dim, dtype, schedule, shape in itertools.product(
                FEATURES, space.WS_HEAD_DIMS, DType, ("default", "plain"), SHAPES)]


def _sample() -> list[Case]:
    """Five feature sets drawn from the seed (always one varlen and one window set), at head
    dims 64 and 128 (the emulation of 256 is slow: in the sweep), dtype, schedule and shape
    drawn too."""
    rng = random.Random(f"{SEED}fwd90aws-features")
    varlen = [f for f in FEATURES if "varlen" in f[0]]
    windows = [f for f in FEATURES if "window" in f[0] and "varlen" not in f[0]]
    others = [f for f in FEATURES if f not in varlen and f not in windows]
    picks = [rng.choice(varlen), rng.choice(windows), *rng.sample(others, 3)]
    return [(switches, window, rng.choice((64, 128)), rng.choice(list(DType)),
             rng.choice(("default", "plain")), rng.choice(SHAPES))
            for switches, window in picks]


def _id(case: Case) -> str:
    switches, window, head_dim, dtype, schedule, shape = case
    names = "-".join(sorted(switches)) + (f"{window[0]}_{window[1]}" if window else "")
    return f"{names}-d{head_dim}-{dtype.value}-{schedule}-{shape.key()}"


def test_declares_every_feature() -> None:
    assert FAMILY.features == frozenset({"window", "softcap", "alibi", "varlen", "sinks",
                                         "dropout"})


@pytest.mark.parametrize("name", ["window", "softcap", "alibi", "varlen", "sinks", "dropout"])
def test_cc90_serves_every_feature_on_fwd90aws(name: str) -> None:
    featured = Problem(128, DType.BF16, **{name: True})  # type: ignore[arg-type]
    served = families.served_problem(featured, SM90A)
    assert served == dataclasses.replace(featured, op=FAMILY.op)


def test_plain_sources_have_no_feature_arguments() -> None:
    """A plain problem's kernel is rendered as before features existed."""
    rendered = families.render(_problem({}, 128, DType.FP16),
                               FAMILY.default_config(_problem({}, 128, DType.FP16), SM90A))
    assert "VariantArgs" not in rendered.code and "window_left" not in rendered.code


@pytest.mark.parametrize("head_dim", seeded_part(space.HEAD_DIMS, 1, "ws-features-nvrtc"))
def test_nvrtc_compiles_every_feature_for_sm90a_without_spills(head_dim: int) -> None:
    """Both feature sets at a seeded head dim (every head dim under ``-m sweep``)."""
    dtype = random.Random(f"{SEED}nvrtc-ws-features{head_dim}").choice(list(DType))
    for switches in ({"window": True, "softcap": True, "alibi": True, "varlen": True,
                      "sinks": True}, {"causal": True, "softcap": True, "alibi": True}):
        problem = _problem(switches, head_dim, dtype)
        kernel = compile_source(families.render(problem, FAMILY.default_config(problem, SM90A)),
                                "sm_90")
        assert kernel.arch == "sm_90a" and kernel.resources.spill_bytes == 0, kernel.resources


#: The seeded sample, then the grid behind ``-m sweep``.
CASES = [*_sample(), *(pytest.param(case, marks=pytest.mark.sweep, id=f"grid-{_id(case)}")
                       for case in _grid())]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_features_match_float64(case: Case) -> None:
    _check(case, random.Random(f"{SEED}-{_id(case)}").randrange(2**31))


def test_a_narrow_window_loads_fewer_key_tiles() -> None:
    """K and V by cp.async (the emulator counts those bytes): a window of 16 keys over 512
    keys loads at most the two tiles it touches per query tile, against all four without a
    bound, with the same output as the reference (skipping disabled fails this)."""
    problem = _problem({"window": True}, 64, DType.FP16)
    config = FAMILY.config({**FAMILY.point(FAMILY.default_config(problem, SM90A)),
                            "loadk": space.CP_ASYNC, "loadv": space.CP_ASYNC})
    shape = Shape(1, 1, 1, 128, 512)
    loaded = {}
    for window in ((16, 0), (-1, -1)):
        inputs = _inputs(problem, shape, window, SEED)
        outputs, counters = _launch(problem, config, shape, inputs,
                                    LaunchOptions(counters=True))
        verdict = FAMILY.compare(problem, shape, outputs, FAMILY.reference(problem, inputs))
        assert verdict.ok, f"window {window}: {verdict.message}"
        assert counters is not None
        loaded[window] = counters.cp_async_bytes  # type: ignore[attr-defined]
    tile = config.block_n * problem.head_dim * 2 * 2  # K and V of one key tile
    assert loaded[(-1, -1)] == 4 * tile, loaded
    # Rows 384..511 of the 512 keys see keys 368..511: tiles 2 and 3 only.
    assert loaded[(16, 0)] == 2 * tile, loaded


@pytest.mark.usefixtures("dispatcher")
def test_attention_varlen_on_a_virtual_sm90a_runs_fwd90aws(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch API on the emulator's virtual sm_90a: a packed GQA batch (a zero-length
    sequence, Nq != Nk) with a window, softcap and sinks runs on ``fwd90aws`` after its
    first-use check and matches float64."""
    with on_virtual_sm90a(monkeypatch):
        problem = _problem({"varlen": True, "window": True, "softcap": True, "sinks": True},
                           64, DType.BF16)
        inputs = _packed(problem, Shape(3, 4, 2, 70, 90), ([70, 0, 45], [33, 9, 90]), SEED)
        t = inputs.tensors
        out, lse = flashtune.attention_varlen(
            t["q"][0], t["k"][0], t["v"][0], t["cu_seqlens_q"], t["cu_seqlens_k"], 70, 90,
            window_size=(20, 4), softcap=30.0, sinks=t["sinks"], return_lse=True)
        assert first_use.refused("virtual-sm_90a") is None
        assert forward_ops() == {FAMILY.op}, forward_ops()
        scalars = {**inputs.scalars, "window_left": 20, "window_right": 4, "softcap": 30.0}
        o64, lse64 = _reference64(problem, Inputs(t, scalars))
        assert float((out.double() - o64[0]).abs().max()) <= 4e-2
        finite = torch.isfinite(lse64[0])
        assert torch.equal(torch.isfinite(lse), finite)
        assert float((lse.double()[finite] - lse64[0][finite]).abs().max()) <= 1e-2


@pytest.mark.usefixtures("dispatcher")
def test_dropout_on_a_virtual_sm90a_trains_with_the_tests_mask(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``flashtune.attention(dropout_p=)`` on the emulator's virtual sm_90a: the forward runs
    on ``fwd90aws``, the backward on the mma.sync ``bwd``, which draws the same mask again;
    output and gradients follow flash-attn's rule against plain PyTorch with the mask drawn
    by the tests' own Philox (causal, GQA 2:1, odd lengths)."""
    shape, p = (1, 77, 90, 2, 1), 0.17
    seed = random.Random(f"{SEED}-dropout").randrange(2**31)
    inputs, dout = make_inputs(shape, 64, torch.bfloat16, seed)
    torch.manual_seed(seed)
    high, low = torch.randint(2**32, (2,), dtype=torch.int64).tolist()
    kept = mask(int(high) << 32 | int(low), 0, p, range(1), 2, 77, 90)

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(seed)
        out = flashtune.attention(q, k, v, causal=True, dropout_p=p)
        assert isinstance(out, torch.Tensor)
        return out

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores, visible, v = feature_scores(q, k, v, True, (-1, -1), None, None)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        probs = probs * kept.to(probs.dtype) * (1.0 / (1.0 - float32(p)))
        return torch.einsum("bhqk,bkhd->bqhd", probs, v)

    with on_virtual_sm90a(monkeypatch):
        got = gradients(ours, inputs, dout)
        assert first_use.refused("virtual-sm_90a") is None
        assert forward_ops() == {FAMILY.op}, forward_ops()
        assert forward_ops("bwd") == {"bwd"}, forward_ops("bwd")
    low = gradients(plain, inputs, dout)
    exact = gradients(plain, tuple(t.double() for t in inputs), dout)
    within_rule(got, low, exact, f"seed={seed}")
