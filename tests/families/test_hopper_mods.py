"""The sm_90a kernels with traced score and mask modifications. The serving forward
(``fwd90aws``): each tile's scores go through the declared functor (softmax.cuh's
ScoreTransform, a mask as -inf), in the default schedule (ping-pong and overlap) and the
plain one. The backward (``bwd90a``, ``bwd90adet``): P from the modified scores, dS times
their slope, and the gradient by the modified score into dscore (captured tensors'
gradients are reduced from it), bitwise equal over block orders in the deterministic family.

The family's kernel runs in the emulator as a virtual sm_90a on fresh inputs (captured
tensors drawn at random by the family) with NaN-poisoned outputs against its float64
reference; through ``flashtune.attention(score_mod=, mask_mod=)`` on a virtual sm_90a the
call is served by ``fwd90aws`` and matches the same Python functions applied to the dense
float64 score matrix. A block mask's tile ranges narrow each block's key range (empty
tiles never loaded, counted by the emulator). A seeded sample by default
(``FLASHTUNE_TEST_SEED`` replays it), every case under ``-m sweep``."""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Callable

import pytest
import torch
from flex_fixtures import (
    Fn,
    dense,
    docs_of,
    four_documents,
    grid,
    with_ranges,
)
from hopper_sample import emulate, forward_ops
from sampling import seeded_part
from serving_fixtures import (  # noqa: F401  (fixtures, by name)
    dispatcher,
    on_virtual_sm90a,
    source,
)

import flashtune
from flashtune.api import flex_mods
from flashtune.api.block_mask import create_block_mask
from flashtune.api.flex import traced_feature
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.codegen.trace import trace
from flashtune.errors import FeatureNotSupported
from flashtune.families.bwd90a import HOPPER_BACKWARD, HOPPER_BACKWARD_DETERMINISTIC
from flashtune.families.hopper import space
from flashtune.families.hopper.ws import HOPPER_WS_FORWARD
from flashtune.runtime import first_use
from flashtune.runtime.backends.emulator import LaunchOptions

pytestmark = pytest.mark.emulator

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
SM90A = get_arch("sm_90a")
FAMILY = HOPPER_WS_FORWARD
#: (score_mod, mask_mod) made from (heads, length, generator).
Mods = Callable[[int, int, torch.Generator], tuple[Fn, Fn]]
MODS: dict[str, Mods] = {
    "t5-causal": lambda h, n, g: (flex_mods.t5_relative_bias(torch.randn(h, 32, generator=g),
                                                             n, 64), flex_mods.causal),
    "softcap-document": lambda h, n, g: (flex_mods.softcap(2.0),
                                         flex_mods.document(docs_of(n, g))),
    "alibi-sliding-window": lambda h, n, g: (flex_mods.alibi(torch.rand(h, generator=g)),
                                             flex_mods.sliding_window_causal(40)),
}
SHAPES = (Shape(1, 4, 2, 70, 150), Shape(2, 2, 1, 130, 130))
SCHEDULES = ("default", "plain")
GRID = list(itertools.product(MODS, (64, 128), DType, SHAPES, SCHEDULES))


def _config(problem: Problem, schedule: str) -> KernelConfig:
    default = FAMILY.default_config(problem, SM90A)
    if schedule == "default":
        return default
    return FAMILY.config({**FAMILY.point(default), space.PINGPONG: 0, space.OVERLAP: 0})


def _check(name: str, head_dim: int, dtype: DType, shape: Shape, schedule: str) -> None:
    gen = torch.Generator().manual_seed(SEED)
    score_mod, mask_mod = MODS[name](shape.heads_q, max(shape.seqlen_q, shape.seqlen_k), gen)
    problem = Problem(head_dim, dtype, features=[traced_feature(trace(score_mod, mask_mod))],
                      op=FAMILY.op)
    config = _config(problem, schedule)
    assert FAMILY.static_check(problem, config, SM90A) is None, config.key()
    inputs = FAMILY.random_inputs(problem, shape, "cpu", SEED)
    outputs, _ = emulate(FAMILY, problem, config, shape, inputs)
    verdict = FAMILY.compare(problem, shape, outputs, FAMILY.reference(problem, inputs))
    assert verdict.ok, f"seed {SEED} {name} {config.key()}: {verdict.message}"


def _sample(seed: int) -> list[tuple[str, int, DType, Shape, str]]:
    """One case per modification, drawn with ``seed``."""
    rng = random.Random(seed)
    return [rng.choice([c for c in GRID if c[0] == name]) for name in MODS]


def _id(case: object) -> str:
    if isinstance(case, Shape):
        return case.key()
    return case.value if isinstance(case, DType) else str(case)


@pytest.mark.parametrize("name, head_dim, dtype, shape, schedule", _sample(SEED), ids=_id)
def test_modified_sm90a_forward_matches_float64(name: str, head_dim: int, dtype: DType,
                                                 shape: Shape, schedule: str) -> None:
    print(f"FLASHTUNE_TEST_SEED={SEED}")
    _check(name, head_dim, dtype, shape, schedule)


@pytest.mark.sweep
@pytest.mark.parametrize("name, head_dim, dtype, shape, schedule", GRID, ids=_id)
def test_modified_sm90a_forward_whole_grid(name: str, head_dim: int, dtype: DType,
                                           shape: Shape, schedule: str) -> None:
    _check(name, head_dim, dtype, shape, schedule)


def test_a_block_mask_skips_empty_tiles_on_the_sm90a_forward() -> None:
    _forward_skip_case(random.Random(f"{SEED}-skip").random() < 0.5)


@pytest.mark.sweep
@pytest.mark.parametrize("flash", [False, True], ids=["document-ids", "flashmask"])
def test_block_masks_skip_empty_tiles_on_the_sm90a_forward_in_both_forms(flash: bool) -> None:
    _forward_skip_case(flash)


def _forward_skip_case(flash: bool) -> None:
    """Causal document masking over 4 documents (as document ids or in FlashMask's column
    form) with K and V loaded by cp.async (the emulator counts those bytes): each query
    block loads exactly the key tiles holding a key one of its rows sees (counted from the
    dense mask), the outputs match the float64 reference of the dense mask; with every tile
    walked the same outputs cost more bytes (skipping disabled fails this), and marking
    every tile full changes the result (the mask is evaluated on the partial tiles)."""
    n, dim = 512, 64
    cuts, _, mask_mod = four_documents(n, SEED, flash)
    traced = trace(None, mask_mod, tiles=True)
    problem = Problem(dim, DType.BF16, features=[traced_feature(traced)], op=FAMILY.op)
    config = FAMILY.config({**FAMILY.point(FAMILY.default_config(problem, SM90A)),
                            "block_n": 64, "loadk": space.CP_ASYNC, "loadv": space.CP_ASYNC})
    assert FAMILY.static_check(problem, config, SM90A) is None, config.key()
    shape = Shape(1, 1, 1, n, n)
    drawn = FAMILY.random_inputs(problem, shape, "cpu", SEED)
    block_mask = create_block_mask(mask_mod, 1, 1, n, n)
    ranges = block_mask.tiles(config.block_m, config.block_n, torch.device("cpu"))
    assert int((ranges[..., 3] - ranges[..., 2]).sum()) > 0, f"cuts={cuts}: no full tiles"

    def launch(tiles: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
        inputs = with_ranges(problem, traced, tiles, drawn)
        outputs, counters = emulate(FAMILY, problem, config, shape, inputs,
                                    LaunchOptions(counters=True))
        verdict = FAMILY.compare(problem, shape, outputs, FAMILY.reference(problem, inputs))
        return outputs["o"], counters.cp_async_bytes, verdict.ok  # type: ignore[attr-defined]

    out, loaded, ok = launch(ranges)
    assert ok, f"seed {SEED} cuts={cuts}"
    q, k, v = (drawn.tensors[x].transpose(1, 2) for x in "qkv")
    ref, _ = dense(q, k, v, float(drawn.scalars["softmax_scale"]), None, mask_mod,
                   torch.float64)
    assert (out.transpose(1, 2).double() - ref).abs().max() < 2e-2, f"cuts={cuts}"
    visible = mask_mod(*grid(1, 1, n, n))[0, 0]
    tile_bytes = config.block_n * dim * 2 * 2  # K and V of one key tile
    seen = visible.view(n // config.block_m, config.block_m, n // config.block_n,
                        config.block_n).any(-1).any(1)
    assert loaded == int(seen.sum()) * tile_bytes, f"cuts={cuts}"
    every = torch.tensor([0, n // config.block_n, 0, 0], dtype=torch.int32)
    walked_out, walked, ok = launch(every.expand(1, 1, n // config.block_m, 4).contiguous())
    assert ok and walked == seen.numel() * tile_bytes > loaded, f"cuts={cuts}"
    torch.testing.assert_close(walked_out, out, atol=0, rtol=0)
    all_full = ranges.clone()
    all_full[..., 2], all_full[..., 3] = ranges[..., 0], ranges[..., 1]
    assert not launch(all_full)[2], f"cuts={cuts}: the mask was applied on full tiles"


@pytest.mark.usefixtures("dispatcher")
def test_attention_with_mods_on_a_virtual_sm90a_runs_fwd90aws(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``flashtune.attention(score_mod=, mask_mod=)`` on the emulator's virtual sm_90a runs
    on ``fwd90aws`` after its first-use check and matches the functions applied to the
    dense float64 scores (GQA 4:2, a T5 bias captured from the caller, causal)."""
    with on_virtual_sm90a(monkeypatch):
        gen = torch.Generator().manual_seed(SEED)
        n, dim = 90, 64
        score_mod, mask_mod = MODS["t5-causal"](4, n, gen)
        q = torch.randn(1, n, 4, dim, generator=gen).to(torch.bfloat16)
        k, v = (torch.randn(1, n, 2, dim, generator=gen).to(torch.bfloat16) for _ in "kv")
        out = flashtune.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
        assert isinstance(out, torch.Tensor)
        assert first_use.refused("virtual-sm_90a") is None
        assert forward_ops() == {FAMILY.op}, forward_ops()
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        ref, _ = dense(qt, kt, vt, dim ** -0.5, score_mod, mask_mod, torch.float64)
        err = float((out.transpose(1, 2).double() - ref).abs().max())
        assert err <= 4e-2, f"seed {SEED}: {err}"


@pytest.mark.usefixtures("dispatcher")
def test_flex_attention_with_a_block_mask_on_a_virtual_sm90a_runs_both_sm90a_kernels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``flashtune.flex_attention(block_mask=)`` on the emulator's virtual sm_90a runs its
    forward on ``fwd90aws`` and its backward on ``bwd90a`` (the tile ranges built for each
    served tile) and matches the mask applied to the dense float64 scores, output and
    gradients (GQA 4:2, causal document masking)."""
    with on_virtual_sm90a(monkeypatch):
        gen = torch.Generator().manual_seed(SEED)
        n, dim = 300, 64
        _, _, mask_mod = four_documents(n, SEED)
        q = torch.randn(1, 4, n, dim, generator=gen).to(torch.bfloat16).requires_grad_()
        k, v = (torch.randn(1, 2, n, dim, generator=gen).to(torch.bfloat16).requires_grad_()
                for _ in "kv")
        block_mask = create_block_mask(mask_mod, None, None, n, n)
        out = flashtune.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        assert isinstance(out, torch.Tensor)
        g = torch.randn(out.shape, generator=gen)
        (out.float() * g).sum().backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        assert forward_ops() == {FAMILY.op}, forward_ops()
        assert forward_ops("bwd") == {HOPPER_BACKWARD.op}, forward_ops("bwd")
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        lq, lk, lv = leaves
        ref, _ = dense(lq, lk, lv, dim ** -0.5, None, mask_mod, torch.float64)
        (ref * g.double()).sum().backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        err = float((out.detach().double() - ref.detach()).abs().max())
        assert err <= 4e-2, f"seed {SEED}: {err}"
        for name, got, want in zip("qkv", (q, k, v), leaves, strict=True):
            assert got.grad is not None and want.grad is not None
            scale = float(want.grad.abs().max())
            err = float((got.grad.double() - want.grad).abs().max())
            assert err <= 3e-2 * scale, f"seed {SEED} d{name}: {err} (max {scale})"


@pytest.mark.parametrize("op, head_dim", [
    *seeded_part([("fwd90aws", 128), ("fwd90aws", 256)], 1, "mods-nvrtc-fwd", several=True),
    *seeded_part([("bwd90a", 64), ("bwd90a", 128)], 1, "mods-nvrtc-bwd", several=True),
    ("bwd90adet", 128)])
def test_a_captured_bias_compiles_without_spills(op: str, head_dim: int) -> None:
    """NVRTC sm_90a: the defaults with a T5 bias (a captured tensor loaded per score) and a
    causal mask_mod (the forward's with a block mask's tile ranges) keep every value in
    registers. Each family at a seeded one of its head dims (all under ``-m sweep``)."""
    from flashtune import families
    from flashtune.toolchain.compiler import compile_source

    score_mod, mask_mod = MODS["t5-causal"](4, 512, torch.Generator().manual_seed(SEED))
    problem = Problem(head_dim, DType.BF16, op=op, features=[traced_feature(
        trace(score_mod, mask_mod, tiles=op == "fwd90aws"))])
    family = families.get(op)
    kernel = compile_source(families.render(problem, family.default_config(problem, SM90A)),
                            "sm_90a")
    print(op, head_dim, kernel.resources)
    assert kernel.resources.spill_stores == 0 and kernel.resources.spill_loads == 0


# ------------------------------------------------------------------ the backward

BWD_GRID = list(itertools.product(MODS, (64, 128), DType, SHAPES, ("atomic", "deterministic")))


def _backward(name: str, head_dim: int, dtype: DType, shape: Shape, mode: str,
              order_seed: int | None = None) -> dict[str, torch.Tensor]:
    """The NaN-poisoned outputs of the sm_90a backward of ``name`` (the deterministic family
    for ``mode`` "deterministic"), asserted within its float64 reference (dK, dV, dQ and the
    gradient by the modified score)."""
    family = HOPPER_BACKWARD_DETERMINISTIC if mode == "deterministic" else HOPPER_BACKWARD
    gen = torch.Generator().manual_seed(SEED)
    score_mod, mask_mod = MODS[name](shape.heads_q, max(shape.seqlen_q, shape.seqlen_k), gen)
    problem = Problem(head_dim, dtype, features=[traced_feature(trace(score_mod, mask_mod))],
                      op=family.op)
    config = family.default_config(problem, SM90A)
    inputs = family.random_inputs(problem, shape, "cpu", SEED)
    outputs, _ = emulate(family, problem, config, shape, inputs,
                         LaunchOptions(block_order_seed=order_seed))
    verdict = family.compare(problem, shape, outputs, family.reference(problem, inputs))
    assert verdict.ok, f"seed {SEED} {name} {config.key()} order {order_seed}: {verdict.message}"
    assert "dscore" in outputs
    return outputs


@pytest.mark.parametrize("name, head_dim, dtype, shape, mode",
                         [random.Random(SEED + 1).choice([c for c in BWD_GRID if c[0] == n])
                          for n in MODS], ids=_id)
def test_modified_sm90a_backward_matches_float64(name: str, head_dim: int, dtype: DType,
                                                  shape: Shape, mode: str) -> None:
    print(f"FLASHTUNE_TEST_SEED={SEED}")
    _backward(name, head_dim, dtype, shape, mode)


@pytest.mark.sweep
@pytest.mark.parametrize("name, head_dim, dtype, shape, mode", BWD_GRID, ids=_id)
def test_modified_sm90a_backward_whole_grid(name: str, head_dim: int, dtype: DType,
                                            shape: Shape, mode: str) -> None:
    _backward(name, head_dim, dtype, shape, mode)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_deterministic_backward_is_bitwise_equal_over_block_orders(head_dim: int) -> None:
    """A T5 bias (a captured tensor) with a causal mask: dK, dV, the dQ slices and the
    gradient by the modified score are the same bits in three block orders (at 128 two
    warpgroups share each 64 keys)."""
    runs = [_backward("t5-causal", head_dim, DType.BF16, Shape(1, 2, 1, 130, 300),
                      "deterministic", order) for order in (None, 1, 2)]
    for other in runs[1:]:
        for key in ("dk", "dv", "dq_accum", "dscore"):
            assert torch.equal(other[key], runs[0][key]), key


def test_a_block_mask_skips_empty_query_tiles_in_the_sm90a_backward() -> None:
    _backward_skip_case(random.Random(f"{SEED}-bwd").choice(["atomic", "deterministic"]))


@pytest.mark.sweep
@pytest.mark.parametrize("mode", ["atomic", "deterministic"])
def test_block_masks_skip_empty_query_tiles_in_both_sm90a_backwards(mode: str) -> None:
    _backward_skip_case(mode)


def _backward_skip_case(mode: str) -> None:
    """Causal document masking over 4 documents, GQA 2:1, the block mask in its column
    form: each key tile loads Q and dO of exactly the query tiles holding a row that sees
    one of its keys (counted from the dense mask; cp.async bytes), dK, dV, dQ and the
    gradient by the modified score match the float64 reference; walking every query tile
    gives the same gradients for more bytes (skipping disabled fails this), and marking
    every tile full changes them (the mask is evaluated on partial tiles only)."""
    family = HOPPER_BACKWARD_DETERMINISTIC if mode == "deterministic" else HOPPER_BACKWARD
    n, dim, group = 384, 64, 2
    cuts, _, mask_mod = four_documents(n, SEED)
    traced = trace(None, mask_mod, tiles=True)
    problem = Problem(dim, DType.FP16, features=[traced_feature(traced)], op=family.op)
    config = family.default_config(problem, SM90A)
    shape = Shape(1, group, 1, n, n)
    drawn = family.random_inputs(problem, shape, "cpu", SEED)
    block_mask = create_block_mask(mask_mod, 1, 1, n, n)
    ranges = block_mask.tiles(config.block_m, config.block_n, torch.device("cpu"),
                              columns=True)

    def launch(tiles: torch.Tensor) -> tuple[dict[str, torch.Tensor], int, bool]:
        inputs = with_ranges(problem, traced, tiles, drawn)
        outputs, counters = emulate(family, problem, config, shape, inputs,
                                    LaunchOptions(counters=True))
        verdict = family.compare(problem, shape, outputs, family.reference(problem, inputs))
        return outputs, counters.cp_async_bytes, verdict.ok  # type: ignore[attr-defined]

    out, loaded, ok = launch(ranges)
    assert ok, f"seed {SEED} cuts={cuts}"
    visible = mask_mod(*grid(1, 1, n, n))[0, 0]
    m_tiles, n_tiles = n // config.block_m, n // config.block_n
    seen = visible.view(m_tiles, config.block_m, n_tiles, config.block_n).any(-1).any(1)
    row_bytes = dim * 2
    kv = n_tiles * 2 * config.block_n * row_bytes  # K and V of every key tile
    per_step = 2 * config.block_m * row_bytes       # Q and dO of one query tile
    assert loaded == kv + group * int(seen.sum()) * per_step, f"cuts={cuts}"
    every = torch.tensor([0, m_tiles, 0, 0], dtype=torch.int32)
    walked_out, walked, ok = launch(every.expand(1, 1, n_tiles, 4).contiguous())
    assert ok and walked == kv + group * seen.numel() * per_step > loaded, f"cuts={cuts}"
    for key in ("dk", "dv"):
        torch.testing.assert_close(walked_out[key], out[key], atol=0, rtol=0)
    all_full = ranges.clone()
    all_full[..., 2], all_full[..., 3] = ranges[..., 0], ranges[..., 1]
    assert not launch(all_full)[2], f"cuts={cuts}: the mask was applied on full tiles"


def test_the_backward_refuses_wide_heads_naming_the_fallback() -> None:
    """Modifications above head dim 128 (where the functor would spill) stay on the mma.sync
    backward."""
    wide = Problem(256, DType.BF16, op=HOPPER_BACKWARD.op,
                   features=[traced_feature(trace(flex_mods.softcap(2.0)))])
    with pytest.raises(FeatureNotSupported, match=r"up to head dim 128: at 256 .* \('bwd'\)"):
        HOPPER_BACKWARD.check_problem(wide)
