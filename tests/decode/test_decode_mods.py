"""Decoding with a traced score / mask modification (``attention_with_kvcache``'s
``score_mod`` and ``mask_mod``) on the emulator.

The reference applies the same Python functions to each sequence's dense float64 scores
(b the sequence, h the query head, q_idx = i + total - Nq the new row's absolute position,
kv_idx = j the key's), independently of the tracer and the kernel. Mods from
``flashtune.api.flex_mods``: ALiBi, softcap, a T5 bias with a captured tensor, document and
prefix-LM masks, a causal sliding window; paged (page sizes 1, 16) and unpaged caches, GQA
groups 1 and 4, 1 and 3 query rows, appended rows or not, 1 and 3 splits. The kernel's
partial outputs are poisoned with NaN before each launch. A seeded sample runs by default
(one case per mod), the grid under the sweep marker; one check against torch's
``flex_attention`` on the CPU.
"""

from __future__ import annotations

import itertools
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import pytest
import torch
from decode_cases import call_api

from flashtune import families
from flashtune.api import flex_mods
from flashtune.api.flex import traced_feature
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.codegen.trace import UnsupportedModification, trace
from flashtune.errors import BackwardNotAvailable, InvalidInput
from flashtune.families.base import Inputs, close_enough
from flashtune.families.checks import LSE_TOLERANCE, O_TOLERANCE
from flashtune.families.decode import DECODE, DecodeCase
from flashtune.families.decode.splits import split_range
from flashtune.runtime.backends.emulator import EmulatorBackend
from flashtune.runtime.launch import PreparedLaunch, prepare

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
CONFIG = KernelConfig(64, 64, 4, 2)
CAPACITY = 160
BATCH = 2
DIM = 64

Fn = Callable[..., Any]
#: (score_mod, mask_mod) of a mod, made from a generator, the query heads and the batch.
Maker = Callable[[torch.Generator, int], tuple[Fn | None, Fn | None]]


def _alibi(gen: torch.Generator, heads_q: int) -> tuple[Fn | None, Fn | None]:
    return flex_mods.alibi(torch.rand(heads_q, generator=gen) * 0.5), None


def _softcap(gen: torch.Generator, heads_q: int) -> tuple[Fn | None, Fn | None]:
    return flex_mods.softcap(1.5), None


def _t5(gen: torch.Generator, heads_q: int) -> tuple[Fn | None, Fn | None]:
    bias = torch.randn(heads_q, 32, generator=gen)
    return flex_mods.t5_relative_bias(bias, CAPACITY, max_distance=64), None


def _document(gen: torch.Generator, heads_q: int) -> tuple[Fn | None, Fn | None]:
    # Documents of random lengths over the positions (a few per sequence).
    doc_ids = torch.randint(0, 5, (CAPACITY,), generator=gen).sort().values
    return None, flex_mods.document(doc_ids)


def _prefix(gen: torch.Generator, heads_q: int) -> tuple[Fn | None, Fn | None]:
    return None, flex_mods.prefix_lm(torch.randint(0, CAPACITY, (BATCH,), generator=gen))


def _window(gen: torch.Generator, heads_q: int) -> tuple[Fn | None, Fn | None]:
    return None, flex_mods.sliding_window_causal(int(torch.randint(1, 40, (1,),
                                                                   generator=gen)))


def _t5_window(gen: torch.Generator, heads_q: int) -> tuple[Fn | None, Fn | None]:
    score_mod, _ = _t5(gen, heads_q)
    _, mask_mod = _window(gen, heads_q)
    return score_mod, mask_mod


MODS: dict[str, Maker] = {"alibi": _alibi, "softcap": _softcap, "t5": _t5,
                          "document": _document, "prefix": _prefix, "window": _window,
                          "t5_window": _t5_window}
PAGE_SIZES: tuple[int | None, ...] = (None, 1, 16)
HEADS = ((2, 2), (8, 2))  # GQA groups 1 and 4
SEQLEN_Q = (1, 3)
SPLITS = (1, 3)


@dataclass(frozen=True)
class ModCase:
    mod: str
    page_size: int | None
    heads: tuple[int, int]
    seqlen_q: int
    append: bool
    num_splits: int
    seed: int

    @property
    def key(self) -> str:
        paged = "unpaged" if self.page_size is None else f"page{self.page_size}"
        return (f"{self.mod}-{paged}-h{self.heads[0]}x{self.heads[1]}-q{self.seqlen_q}-"
                f"{'append' if self.append else 'noappend'}-s{self.num_splits}")

    def shape(self) -> Shape:
        return Shape(BATCH, self.heads[0], self.heads[1], self.seqlen_q, CAPACITY)

    def mods(self) -> tuple[Fn | None, Fn | None]:
        gen = torch.Generator().manual_seed(self.full_seed)
        return MODS[self.mod](gen, self.heads[0])

    @property
    def full_seed(self) -> int:
        return SEED * 100003 + self.seed


GRID = tuple(ModCase(mod, page, heads, nq, append, splits, seed=i)
             for i, (mod, page, heads, nq, append, splits) in enumerate(itertools.product(
                 MODS, PAGE_SIZES, HEADS, SEQLEN_Q, (False, True), SPLITS)))


def sample(seed: int) -> list[ModCase]:
    """One case of every mod, page sizes cycling, the rest drawn."""
    rng = random.Random(seed)
    return [rng.choice([c for c in GRID if c.mod == mod
                        and c.page_size == PAGE_SIZES[i % len(PAGE_SIZES)]])
            for i, mod in enumerate(MODS)]


def sequence_kv(inputs: Inputs, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's keys and values (total, heads_kv, dim) in float64, gathered from the
    caches as drawn and the appended rows."""
    t = inputs.tensors
    length = int(t["cache_seqlens"][b])
    pos = torch.arange(length)
    table = t.get("block_table")
    if table is None:
        pages, rows = torch.full_like(pos, b), pos
    else:
        page_size = t["k_cache"].shape[1]
        pages, rows = table[b, pos // page_size].long(), pos % page_size
    out = []
    for name in ("k", "v"):
        rows_of = t[f"{name}_cache_before"][pages, rows].double()
        if f"{name}_new" in t:
            rows_of = torch.cat([rows_of, t[f"{name}_new"][b].double()])
        out.append(rows_of)
    return out[0], out[1]


def dense_scores(inputs: Inputs, b: int, score_mod: Fn | None, mask_mod: Fn | None
                 ) -> torch.Tensor:
    """(heads_q, Nq, total) float64 scores of sequence b with the Python mods applied on
    broadcast index tensors, -inf where the mask hides a key."""
    q = inputs.tensors["q"][b].double()  # (Nq, Hq, D)
    keys, _ = sequence_kv(inputs, b)
    seqlen_q, heads_q, _ = q.shape
    total = keys.shape[0]
    group = heads_q // keys.shape[1]
    scale = float(inputs.scalars["softmax_scale"])
    s = torch.einsum("qhd,khd->hqk", q, keys.repeat_interleave(group, dim=1)) * scale
    bi = torch.tensor(b)
    h = torch.arange(heads_q).view(-1, 1, 1)
    qi = (torch.arange(seqlen_q) + total - seqlen_q).view(1, -1, 1)
    kv = torch.arange(total).view(1, 1, -1)
    if score_mod is not None:
        s = score_mod(s, bi, h, qi, kv).double()
    if mask_mod is not None:
        s = s.masked_fill(~torch.as_tensor(mask_mod(bi, h, qi, kv)).expand_as(s), -math.inf)
    return s


def attend(inputs: Inputs, b: int, s: torch.Tensor, begin: int, end: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """O (Nq, Hq, D) and LSE (Hq, Nq) over keys [begin, end): O = 0, LSE = -inf where a row
    sees none of them."""
    _, values = sequence_kv(inputs, b)
    heads_q = s.shape[0]
    part = s[..., begin:end]
    lse = (torch.logsumexp(part, dim=-1) if end > begin
           else torch.full(part.shape[:2], -math.inf, dtype=torch.float64))
    empty = torch.isneginf(lse)
    p = torch.exp(part - lse.masked_fill(empty, 0.0)[..., None])
    v = values[begin:end].repeat_interleave(heads_q // values.shape[1], dim=1)
    return torch.einsum("hqk,khd->qhd", p, v), lse


def inputs_of(case: ModCase, problem: Problem, values: dict[str, object]) -> Inputs:
    """Drawn inputs (lengths: one sequence at the full room, one drawn) with the traced
    mod's own captured tensors."""
    shape = case.shape()
    new = case.seqlen_q if case.append else 0
    probe = DecodeCase(case.page_size, (0,) * BATCH, 0, case.num_splits)
    room = probe.capacity(shape) - new
    lengths = (room, random.Random(case.seed).randrange(0, room))
    print(f"seed={case.full_seed} (FLASHTUNE_TEST_SEED={SEED}) {case.key}")
    drawn = DECODE.random_inputs(problem, shape, "cpu", seed=case.full_seed,
                                 case=DecodeCase(case.page_size, lengths, new,
                                                 case.num_splits))
    tensors = {**drawn.tensors, **{k: v for k, v in values.items()
                                   if isinstance(v, torch.Tensor)}}
    # the traced values are its captured tensors and their sizes (ints)
    scalars = {**drawn.scalars, **{k: cast(int, v) for k, v in values.items()
                                   if not isinstance(v, torch.Tensor)}}
    return Inputs(tensors, scalars)


def _launch(case: ModCase, score_mod: Fn | None, mask_mod: Fn | None,
            **switches: bool) -> PreparedLaunch:
    """The decode kernel with the traced mods (and the built-in ``switches``) run on the
    case's inputs, outputs poisoned with NaN; its verdict (caches appended, no NaN left,
    the family's float64 reference) asserted."""
    traced = trace(score_mod, mask_mod)
    problem = Problem(DIM, DType.FP16, op="decode", features=(traced_feature(traced),),
                      **cast(dict[str, Any], switches))
    inputs = inputs_of(case, problem, traced.values(torch.device("cpu")))
    launch = prepare(EmulatorBackend().load(families.render(problem, CONFIG)), case.shape(),
                     "cpu", inputs=inputs, poison=True)
    launch.run()
    verdict = launch.verdict()
    assert verdict.ok, f"{case.key} {switches} (seed {case.full_seed}): {verdict.message}"
    return launch


def _check(case: ModCase) -> None:
    score_mod, mask_mod = case.mods()
    launch = _launch(case, score_mod, mask_mod)
    inputs = launch.inputs
    # The independent reference: the Python mods on each sequence's dense scores, per split.
    splits = int(inputs.scalars["num_splits"])
    for b in range(BATCH):
        s = dense_scores(inputs, b, score_mod, mask_mod)
        for split in range(splits):
            begin, end = split_range(s.shape[-1], splits, split)
            want_o, want_lse = attend(inputs, b, s, begin, end)
            got_o = launch.outputs["o_part"][split, b].permute(1, 0, 2)
            got_lse = launch.outputs["lse_part"][split, b]
            for name, got, want, tol in (("O", got_o, want_o, O_TOLERANCE[DType.FP16]),
                                         ("LSE", got_lse, want_lse, LSE_TOLERANCE)):
                _, _, wrong = close_enough(f"{name} of sequence {b}, split {split}", got,
                                           want, tol)
                assert not wrong, f"{case.key} (seed {case.full_seed}): {wrong}"


#: The default run's sample, then the whole grid behind the sweep marker.
CASES = [pytest.param(c, id=f"sample-{c.key}") for c in sample(SEED)] + [
    pytest.param(c, id=c.key, marks=pytest.mark.sweep) for c in GRID]


@pytest.mark.emulator
@pytest.mark.parametrize("case", CASES)
def test_decode_mods_match_float64(case: ModCase) -> None:
    _check(case)


def test_the_reference_sees_the_mods() -> None:
    """Each mod changes the reference's scores (a test that cannot fail is no test), and
    the causal mask_mod is decoding's causal mask (bottom-right aligned)."""
    case = ModCase("alibi", None, (8, 2), 3, True, 1, seed=3)
    problem = Problem(DIM, DType.FP16, op="decode")
    inputs = inputs_of(case, problem, {})
    plain = dense_scores(inputs, 0, None, None)
    for mod in MODS:
        score_mod, mask_mod = ModCase(mod, None, (8, 2), 3, True, 1, seed=3).mods()
        assert not torch.equal(dense_scores(inputs, 0, score_mod, mask_mod), plain), mod
    causal = dense_scores(inputs, 0, None, flex_mods.causal)
    total = plain.shape[-1]
    i = torch.arange(3).view(-1, 1)
    hidden = torch.arange(total).view(1, -1) > i + total - 3
    assert torch.equal(torch.isneginf(causal[0]), hidden)


def _api_inputs(case: ModCase) -> Inputs:
    return inputs_of(case, Problem(DIM, DType.FP16, op="decode"), {})


@pytest.mark.emulator
def test_attention_with_kvcache_takes_mods() -> None:
    """The API with a score_mod and a mask_mod (paged, GQA, appended rows, 3 splits)
    against the Python mods on float64 scores; and
    mask_mod ``causal`` gives the call's causal=True result."""
    case = ModCase("t5_window", 16, (8, 2), 3, True, 3, seed=5)
    inputs = _api_inputs(case)
    score_mod, mask_mod = case.mods()
    kv = {n: inputs.tensors[n].clone() for n in ("k_cache", "v_cache")}
    out, lse = call_api(inputs, score_mod=score_mod, mask_mod=mask_mod, num_splits=3,
                        return_lse=True, backend="emulator")
    for b in range(BATCH):
        want_o, want_lse = attend(inputs, b, dense_scores(inputs, b, score_mod, mask_mod), 0,
                                  10**9)
        want_lse = want_lse.masked_fill(torch.isneginf(want_lse), math.inf)
        for name, got, want, tol in (("O", out[b], want_o, O_TOLERANCE[DType.FP16]),
                                     ("LSE", lse[b], want_lse, LSE_TOLERANCE)):
            _, _, wrong = close_enough(f"{name} of sequence {b}", got, want, tol)
            assert not wrong, wrong
    # The same call with the mask as causal=True: the rows were appended once already, so
    # restore the caches as drawn and append again.
    for n, t in kv.items():
        inputs.tensors[n].copy_(t)
    masked = call_api(inputs, mask_mod=flex_mods.causal, num_splits=2, backend="emulator")
    for n, t in kv.items():
        inputs.tensors[n].copy_(t)
    causal = call_api(inputs, causal=True, num_splits=2, backend="emulator")
    torch.testing.assert_close(masked, causal, atol=2e-3, rtol=0)


@pytest.mark.emulator
def test_decode_mods_match_torch_flex_attention() -> None:
    """An unpaged call of equal lengths against torch's flex_attention on the CPU with the
    same T5 bias and window mask, its q_idx shifted to the rows' absolute positions."""
    from torch.nn.attention.flex_attention import flex_attention

    case = ModCase("t5_window", None, (8, 2), 3, False, 2, seed=7)
    gen = torch.Generator().manual_seed(case.full_seed)
    length, seqlen_q = 100, case.seqlen_q
    q = torch.randn(BATCH, seqlen_q, 8, DIM, generator=gen).half()
    k_cache = torch.randn(BATCH, CAPACITY, 2, DIM, generator=gen).half()
    v_cache = torch.randn(BATCH, CAPACITY, 2, DIM, generator=gen).half()
    lengths = torch.full((BATCH,), length, dtype=torch.int32)
    score_mod, mask_mod = case.mods()
    assert score_mod is not None and mask_mod is not None
    out = __import__("flashtune").attention_with_kvcache(
        q, k_cache, v_cache, lengths, score_mod=score_mod, mask_mod=mask_mod, num_splits=2,
        backend="emulator")
    shift = length - seqlen_q

    def flex_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        s = score_mod(score, b, h, q_idx + shift, kv_idx)
        return torch.where(mask_mod(b, h, q_idx + shift, kv_idx), s, -math.inf)

    want = flex_attention(q.double().transpose(1, 2),
                          k_cache[:, :length].double().transpose(1, 2),
                          v_cache[:, :length].double().transpose(1, 2),
                          score_mod=flex_mod, enable_gqa=True).transpose(1, 2)
    _, _, wrong = close_enough("O", out, want, O_TOLERANCE[DType.FP16])
    assert not wrong, wrong


def test_bad_mods_are_refused() -> None:
    """A mod that is not a function, a mask that is no comparison and a captured tensor
    that requires grad are refused, naming what was wrong."""
    case = ModCase("alibi", None, (2, 2), 1, False, 1, seed=2)
    inputs = _api_inputs(case)
    with pytest.raises(InvalidInput, match="score_mod=3 is not callable"):
        call_api(inputs, score_mod=3, backend="emulator")
    with pytest.raises(UnsupportedModification, match="mask_mod returned"):
        call_api(inputs, mask_mod=lambda b, h, q_idx, kv_idx: q_idx + kv_idx,
                 backend="emulator")
    bias = torch.zeros(2, requires_grad=True)
    with pytest.raises(BackwardNotAvailable, match="attention_with_kvcache"):
        call_api(inputs, score_mod=lambda s, b, h, q_idx, kv_idx: s + bias[h],
                 backend="emulator")


#: (arch, mod, head dim, the spill bytes allowed): none, a captured tensor's pointers
#: included (the forward's head-dim-64 default spills 108 bytes with the same T5 bias).
NVRTC_CASES = (("sm_90", "window", 64, 0), ("sm_80", "t5_window", 128, 0),
               pytest.param("sm_80", "window", 128, 0, marks=pytest.mark.sweep),
               pytest.param("sm_90", "t5_window", 128, 0, marks=pytest.mark.sweep))


@pytest.mark.parametrize("arch, mod, dim, spill", NVRTC_CASES)
def test_modified_defaults_compile_with_nvrtc(arch: str, mod: str, dim: int,
                                              spill: int) -> None:
    """The default decode config with a modification compiles for the GPU within its
    spill allowance."""
    from flashtune.codegen.arch import get_arch
    from flashtune.toolchain.compiler import compile_source

    score_mod, mask_mod = ModCase(mod, None, (8, 2), 1, False, 1, seed=0).mods()
    problem = Problem(dim, DType.BF16, op="decode",
                      features=(traced_feature(trace(score_mod, mask_mod)),))
    config = DECODE.default_config(problem, get_arch(arch))
    kernel = compile_source(families.render(problem, config), arch)
    assert kernel.resources.spill_bytes <= spill and kernel.resources.registers > 0


def test_a_block_mask_is_served_by_the_decode_family() -> None:
    """A modification traced with a block mask's tile ranges is a decode problem (its
    numerics and tile skipping: test_decode_block_mask)."""
    ranged = trace(None, flex_mods.causal, tiles=True)
    problem = Problem(DIM, DType.FP16, op="decode", features=(traced_feature(ranged),))
    DECODE.check_problem(problem)


@pytest.mark.emulator
@pytest.mark.parametrize("causal", [pytest.param(False, id="window"),
                                    pytest.param(True, id="causal",
                                                 marks=pytest.mark.sweep)])
def test_mods_compose_with_the_built_in_features(causal: bool) -> None:
    """A T5 bias and a document mask after the built-in softcap and ALiBi (and a window or
    the causal mask), paged, GQA, appended rows, 2 splits, poisoned: the family's float64
    reference (the declared modification after softcap and ALiBi, then the masks)."""
    case = ModCase("t5", 16, (8, 2), 3, True, 2, seed=11)
    score_mod, _ = case.mods()
    _, mask_mod = ModCase("document", 16, (8, 2), 3, True, 2, seed=11).mods()
    launch = _launch(case, score_mod, mask_mod, causal=causal, window=not causal,
                     softcap=True, alibi=True)
    inputs = launch.inputs
    plain = Problem(DIM, DType.FP16, op="decode", causal=causal, window=not causal,
                    softcap=True, alibi=True)
    # The modification changes the result (the check above could not pass without it).
    assert not torch.allclose(DECODE.reference(plain, inputs)["o_part"].float(),
                              launch.outputs["o_part"].nan_to_num(), atol=1e-2)
