"""The warp-specialised sm_90a forward (``fwd90aws``) with V's head dim other than Q/K's and
with Q/K head dims 512 and 576 beside V's of at most 256 (what each column-chunk launch of
``flashtune.attention`` asks for a wider V).

Rules: the wide heads' own space (narrow key tiles, few stages: Q's rows and each K stage
fill shared memory) and its measured register budgets, refusals naming the limit, a default
per head dim. NVRTC 13 for sm_90a: the defaults compile without spills (registers and shared
memory printed), and their SASS keeps HGMMA for both GEMMs (m64 n block_n over Q/K's head
dim, m64 n V's head dim over the key tile). Emulator as a virtual sm_90a against float64
(fresh seeded inputs, NaN-poisoned outputs, odd lengths, GQA): the features window, softcap,
ALiBi, varlen, sinks, dropout and a block mask on a seeded sample (``FLASHTUNE_TEST_SEED``
replays it; ``-m sweep`` runs the grid), split head dims of whole panels, and the torch API
with 512-wide heads served by ``fwd90aws``.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import random
import re
from typing import Any, cast

import pytest
import torch
from flex_fixtures import (
    dense,
    four_documents,
    with_ranges,
)
from hopper_sample import emulate, forward_ops
from sampling import seeded_part
from serving_fixtures import (  # noqa: F401  (fixtures, by name)
    dispatcher,
    on_virtual_sm90a,
    source,
)
from test_hopper_ws import _loads_sample
from test_hopper_ws_features import _inputs, assert_matches64

import flashtune
from flashtune import families
from flashtune.api import flex_mods
from flashtune.api.block_mask import create_block_mask
from flashtune.api.flex import traced_feature
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.codegen.trace import trace
from flashtune.errors import FeatureNotSupported, InvalidProblem
from flashtune.families.hopper import space
from flashtune.families.hopper.ws import HOPPER_WS_FORWARD
from flashtune.runtime import first_use
from flashtune.toolchain.compiler import compile_source
from flashtune.toolchain.cuda import find_toolchain
from flashtune.toolchain.disasm import disassemble

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
SM90A = get_arch("sm_90a")
FAMILY = HOPPER_WS_FORWARD
#: The per-block shared memory of sm_90 (227 KiB).
SMEM_LIMIT = 232448


def _problem(head_dim: int, head_dim_v: int, dtype: DType = DType.BF16,
             **switches: bool) -> Problem:
    return Problem(head_dim, dtype, op=FAMILY.op, head_dim_v=head_dim_v,
                   **cast(dict[str, Any], switches))


# ------------------------------------------------------------------ space and rules


def test_wide_heads_have_their_own_space_and_a_default_per_head_dim() -> None:
    assert FAMILY.split_head_dims and FAMILY.max_head_dim == 576
    assert FAMILY.space(_problem(128, 128)) is space.WS_SPACE
    expected = {512: "m128_n32_w8_s2_overlap-1_pingpong-1", 576: "m64_n32_w4_s2_overlap-1"}
    for (dq, key), dv, causal in itertools.product(expected.items(), (64, 128, 256),
                                                   (False, True)):
        problem = _problem(dq, dv, causal=causal)
        assert FAMILY.space(problem) is space.WIDE_WS_SPACE
        default = FAMILY.default_config(problem, SM90A)
        assert default.key() == key, problem.key()
        assert FAMILY.static_check(problem, default, SM90A) is None
        assert "Q/K head dim above 256" in FAMILY.default_reason(problem, SM90A)
        candidates = FAMILY.candidates(problem, SM90A)
        assert default in candidates
        assert all(FAMILY.smem_bytes(problem, c) <= SMEM_LIMIT for c in candidates)
        assert {c.block_n for c in candidates} <= set(space.WIDE_BLOCK_N)


def test_shared_memory_follows_the_split_layout() -> None:
    """Q and K stages take Q/K's rows, V stages V's; barriers and alignment slack after."""
    problem = _problem(512, 256)
    config = KernelConfig(128, 32, 8, 2)
    q_and_k = 512 * 2 * (128 + 2 * 32)
    v = 256 * 2 * 2 * 32
    assert FAMILY.smem_bytes(problem, config) == q_and_k + v + 16 * 2 + 8 + 1024 == 230440
    assert space.accumulator_registers(problem, config) == 32 // 2 + 256 // 2 + 32 // 4
    split = _problem(128, 64)
    assert FAMILY.smem_bytes(split, KernelConfig(128, 128, 8, 2)) == (
        128 * 2 * (128 + 2 * 128) + 64 * 2 * 2 * 128 + 16 * 2 + 8 + 1024)


def test_what_does_not_fit_is_refused_naming_the_limit() -> None:
    p512, p576 = _problem(512, 256), _problem(576, 256)
    why = FAMILY.static_check(p512, FAMILY.config({"block_m": 64, "block_n": 64,
                                                   "num_stages": 2}), SM90A)
    assert why is not None and "shared memory 263208 B exceeds" in why and "232448" in why
    why = FAMILY.static_check(p576, FAMILY.config({"block_m": 128, "block_n": 32,
                                                   "num_stages": 2}), SM90A)
    assert why is not None and "shared memory 255016 B exceeds" in why, why
    # One stage spills at V's head dim 256 (measured: 628 bytes at 512).
    why = FAMILY.static_check(p512, FAMILY.config({"block_m": 64, "block_n": 32,
                                                   "num_stages": 1}), SM90A)
    assert why is not None and "accumulators need 152 registers" in why, why
    assert "over the 112 that compile without spills" in why and "one stage" in why
    why = FAMILY.static_check(p512, FAMILY.config({"block_m": 64, "block_n": 128,
                                                   "num_stages": 1}), SM90A)
    assert why is not None and "block_n in (32, 48, 64)" in why, why
    with pytest.raises(FeatureNotSupported, match="takes Q/K head dims up to 256, got 512"):
        families.get("fwd90a").check_problem(Problem(512, DType.BF16, op="fwd90a",
                                                     head_dim_v=256))
    with pytest.raises(InvalidProblem, match=r"head_dim_v=96: the sm_90a forward takes V "
                                             r"head dims \(64, 128, 192, 256\)"):
        FAMILY.check_problem(_problem(512, 96))
    with pytest.raises(InvalidProblem, match=r"head_dim=96: the sm_90a forward takes head "
                                             r"dims \(64, 128, 192, 256, 512, 576\)"):
        FAMILY.check_problem(_problem(96, 128))
    # The cp.async family keeps head dims 64, 128 and 256.
    with pytest.raises(InvalidProblem, match=r"head_dim=192: the sm_90a forward takes head "
                                             r"dims \(64, 128, 256\)"):
        families.get("fwd90a").check_problem(Problem(192, DType.BF16, op="fwd90a"))


# ------------------------------------------------------------------ NVRTC for sm_90a


def _compiled(problem: Problem, config: KernelConfig) -> None:
    """No spills; with nvdisasm, one TMA box per operand and HGMMA for both GEMMs."""
    assert FAMILY.static_check(problem, config, SM90A) is None, config.key()
    rendered = families.render(problem, config)
    kernel = compile_source(rendered, "sm_90")
    res = kernel.resources
    print(problem.key(), config.key(), f"registers={res.registers}",
          f"smem={res.dynamic_smem}", f"spills={res.spill_bytes}")
    assert kernel.arch == "sm_90a" and res.spill_bytes == 0, res
    assert res.dynamic_smem == rendered.smem_bytes <= SMEM_LIMIT
    if find_toolchain().nvdisasm is None:
        return
    sass = disassemble(kernel.cubin)
    hgmma = collections.Counter(re.findall(r"\bHGMMA\.64x(\d+)x16\.F32(?:\.BF16)?\b", sass))
    assert hgmma[str(config.block_n)] >= problem.head_dim // 16, hgmma  # Q K^T
    assert hgmma[str(problem.v_head_dim)] >= config.block_n // 16, hgmma  # P V
    by_tma = sum(space.knob(config, name) == space.TMA for name in space.LOAD_KNOBS)
    assert len(re.findall(r"\bUTMALDG\.5D\b", sass)) == by_tma


WIDE_DIMS = [(512, 256), (576, 256), (512, 128), (576, 64)]


@pytest.mark.parametrize(("dims", "causal"), [
    (d, c) if i == 0 else pytest.param(d, c, marks=pytest.mark.sweep)
    for i, (d, c) in enumerate(itertools.product(WIDE_DIMS[:2], (True, False)))
    ] + [pytest.param(d, c, marks=pytest.mark.sweep)
         for d, c in itertools.product(WIDE_DIMS[2:], (False, True))], ids=str)
def test_wide_defaults_compile_without_spills(dims: tuple[int, int], causal: bool) -> None:
    dtype = random.Random(f"{SEED}wide-nvrtc{dims}{causal}").choice(list(DType))
    problem = _problem(*dims, dtype, causal=causal)
    _compiled(problem, FAMILY.default_config(problem, SM90A))


@pytest.mark.parametrize("dims", [
    (192, 192), *seeded_part([(192, 128), (128, 64)], 1, "ws-split-nvrtc")], ids=str)
def test_split_defaults_compile_without_spills(dims: tuple[int, int]) -> None:
    """Equal head dims off the plain ones, and a seeded one of the pairs with V narrower
    (both under ``-m sweep``)."""
    problem = _problem(*dims, causal=True)
    _compiled(problem, FAMILY.default_config(problem, SM90A))


@pytest.mark.sweep
@pytest.mark.parametrize("dims", [(512, 256), (576, 256)], ids=str)
def test_every_passing_wide_config_compiles_without_spills(dims: tuple[int, int]) -> None:
    """Every candidate by TMA and by cp.async of all three operands (the budgets' measure),
    and per config of the other knobs one drawn mixed load."""
    problem = _problem(*dims, causal=True)
    rng = random.Random(f"{SEED}wide-nvrtc-sweep{dims}")
    for config in _loads_sample(FAMILY.candidates(problem, SM90A), rng):
        _compiled(problem, config)


# ------------------------------------------------------------------ emulator vs float64

#: (switches, window or None for a drawn one).
FEATURES: list[tuple[dict[str, bool], tuple[int, int] | None]] = [
    ({}, None), ({"causal": True}, None), ({"window": True}, (16, 0)),
    ({"window": True}, (3, 40)), ({"softcap": True, "causal": True}, None),
    ({"alibi": True}, None), ({"sinks": True, "causal": True}, None),
    ({"window": True, "softcap": True, "alibi": True, "sinks": True}, (40, 8)),
    ({"varlen": True, "causal": True}, None),
    ({"varlen": True, "window": True, "softcap": True, "sinks": True}, (20, 5)),
    ({"dropout": True, "causal": True}, None),
    ({"dropout": True, "alibi": True, "window": True}, (30, 10))]
#: GQA 2:1 with odd lengths over several 32-key tiles, Nq > Nk (rows that see no key),
#: Nq < Nk; small, as the emulation of 512-wide rows is slow.
SHAPES = [Shape(1, 4, 2, 45, 70), Shape(2, 2, 1, 65, 33), Shape(1, 2, 2, 17, 90)]

Case = tuple[dict[str, bool], tuple[int, int] | None, int, int, DType, str, Shape]


def _config(problem: Problem, schedule: str) -> KernelConfig:
    """The default, or the plain schedule (no ping-pong, no overlap), or one consumer
    warpgroup with 48-key tiles (512) or the cp.async producer (576)."""
    config = FAMILY.default_config(problem, SM90A)
    point = FAMILY.point(config)
    if schedule == "plain":
        point.update({space.PINGPONG: 0, space.OVERLAP: 0})
    elif schedule == "other":
        point.update({"block_m": 64, "block_n": 48, space.PINGPONG: 0}
                     if problem.head_dim == 512 and problem.v_head_dim <= 256 else
                     {"loadq": space.CP_ASYNC, "loadk": space.CP_ASYNC,
                      "loadv": space.CP_ASYNC})
    return FAMILY.config(point)


def _check(case: Case, seed: int) -> None:
    switches, window, dq, dv, dtype, schedule, shape = case
    problem = _problem(dq, dv, dtype, **switches)
    config = _config(problem, schedule)
    assert FAMILY.static_check(problem, config, SM90A) is None, config.key()
    inputs = _inputs(problem, shape, window, seed)
    outputs, _ = emulate(FAMILY, problem, config, shape, inputs)
    values = {k: v for k, v in inputs.scalars.items() if k != "softmax_scale"}
    where = f"{problem.key()} {config.key()} {shape.key()} {values} seed={seed}"
    # The family's float64 reference (dropout: the kept mask of the kernels' Philox).
    verdict = FAMILY.compare(problem, shape, outputs, FAMILY.reference(problem, inputs))
    assert verdict.ok, f"{where}: {verdict.message}"
    if problem.dropout:
        assert not torch.isnan(outputs["o"]).any(), f"{where}: unwritten"
        assert not torch.isnan(outputs["lse"]).any(), f"{where}: unwritten"
    else:
        assert_matches64(problem, inputs, outputs, where)  # from the definitions


def _grid() -> list[Case]:
    """Every feature set, pair of head dims, schedule and shape; the dtype drawn per case."""
    rng = random.Random(f"{SEED}fwd90aws-wide-grid")
    return [(switches, window, dq, dv, rng.choice(list(DType)), schedule, shape)
            for (switches, window), (dq, dv), schedule, shape in itertools.product(
                FEATURES, WIDE_DIMS, ("default", "plain", "other"), SHAPES)]


def _sample() -> list[Case]:
    """Three feature sets drawn from the seed (one varlen, one window and one dropout set;
    the others are the sweep's), each at a drawn pair of head dims, dtype, schedule and
    shape."""
    rng = random.Random(f"{SEED}fwd90aws-wide")
    varlen = [f for f in FEATURES if "varlen" in f[0]]
    windows = [f for f in FEATURES if "window" in f[0] and f not in varlen]
    dropout = [f for f in FEATURES if "dropout" in f[0]]
    picks = [rng.choice(varlen), rng.choice(windows), rng.choice(dropout)]
    return [(switches, window, *rng.choice(WIDE_DIMS), rng.choice(list(DType)),
             rng.choice(("default", "plain", "other")), rng.choice(SHAPES))
            for switches, window in picks]


def _id(case: Case) -> str:
    switches, window, dq, dv, dtype, schedule, shape = case
    names = "-".join(sorted(switches)) or "plain"
    names += f"{window[0]}_{window[1]}" if window else ""
    return f"{names}-d{dq}v{dv}-{dtype.value}-{schedule}-{shape.key()}"


CASES = [*_sample(), *(pytest.param(case, marks=pytest.mark.sweep, id=f"grid-{_id(case)}")
                       for case in _grid())]


@pytest.mark.emulator
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_wide_heads_match_float64(case: Case) -> None:
    _check(case, random.Random(f"{SEED}-{_id(case)}").randrange(2**31))


#: Head dims of whole panels up to 256: split (V narrower and wider than Q/K; DeepSeek's
#: 192 / 128) and 192 alone.
SPLIT_DIMS = [(192, 128), (128, 64), (64, 128), (256, 192), (128, 256), (192, 192)]


def _split_sample() -> list[Case]:
    """DeepSeek's 192 / 128 and one pair drawn from the others, features drawn."""
    rng = random.Random(f"{SEED}fwd90aws-split")
    return [(*rng.choice(FEATURES), *dims, rng.choice(list(DType)),
             rng.choice(("default", "plain")), rng.choice(SHAPES))
            for dims in (SPLIT_DIMS[0], rng.choice(SPLIT_DIMS[1:]))]


SPLIT_CASES = [*_split_sample(), *(
    pytest.param(case, marks=pytest.mark.sweep, id=f"grid-{_id(case)}")
    for case in ((switches, window, dq, dv, dtype, schedule, shape)
                 for ((switches, window), (dq, dv), schedule, shape), dtype in zip(
                     itertools.product(FEATURES, SPLIT_DIMS, ("default", "plain"), SHAPES[:2]),
                     itertools.cycle(DType))))]


@pytest.mark.emulator
@pytest.mark.parametrize("case", SPLIT_CASES, ids=_id)
def test_split_head_dims_match_float64(case: Case) -> None:
    _check(case, random.Random(f"{SEED}-{_id(case)}").randrange(2**31))


@pytest.mark.emulator
def test_a_block_mask_at_a_wide_head_matches_float64() -> None:
    """Causal document masking over 4 documents (the block mask's tile ranges narrow each
    query block's key range, its mask evaluated on the partial tiles) at a drawn wide head
    dim, against the dense float64 mask."""
    rng = random.Random(f"{SEED}fwd90aws-wide-block-mask")
    dq, dv = rng.choice(WIDE_DIMS)
    n = 160
    cuts, _, mask_mod = four_documents(n, SEED)
    traced = trace(None, mask_mod, tiles=True)
    problem = Problem(dq, DType.BF16, features=[traced_feature(traced)], op=FAMILY.op,
                      head_dim_v=dv)
    config = FAMILY.default_config(problem, SM90A)
    shape = Shape(1, 1, 1, n, n)
    drawn = FAMILY.random_inputs(problem, shape, "cpu", SEED)
    ranges = create_block_mask(mask_mod, 1, 1, n, n).tiles(config.block_m, config.block_n,
                                                            torch.device("cpu"))
    inputs = with_ranges(problem, traced, ranges, drawn)
    outputs, _ = emulate(FAMILY, problem, config, shape, inputs)
    where = f"{problem.key()} {config.key()} cuts={cuts} seed={SEED}"
    assert not torch.isnan(outputs["o"]).any(), f"{where}: unwritten"
    verdict = FAMILY.compare(problem, shape, outputs, FAMILY.reference(problem, inputs))
    assert verdict.ok, f"{where}: {verdict.message}"
    q, k, v = (drawn.tensors[x].transpose(1, 2) for x in "qkv")
    ref, _ = dense(q, k, v, float(drawn.scalars["softmax_scale"]), None, mask_mod,
                   torch.float64)
    err = float((outputs["o"].transpose(1, 2).double() - ref).abs().max())
    assert err < 2e-2, f"{where}: max |O - O64| = {err:.3g}"


def _attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                 ) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v in float64, GQA, the causal diagonal bottom-right."""
    nq, nk = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    kk, vv = (t.double().repeat_interleave(group, 2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * q.shape[3] ** -0.5
    if causal:
        i = torch.arange(nq)[:, None]
        j = torch.arange(nk)[None, :]
        s = s.masked_fill(j > i + nk - nq, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), vv)


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher")
@pytest.mark.parametrize("dims", [(512, 512), pytest.param((576, 512), marks=pytest.mark.sweep),
                                  pytest.param((512, 256), marks=pytest.mark.sweep)], ids=str)
def test_attention_with_wide_heads_on_a_virtual_sm90a_runs_fwd90aws(
        monkeypatch: pytest.MonkeyPatch, dims: tuple[int, int]) -> None:
    """``flashtune.attention`` on the emulator's virtual sm_90a: Q/K of 512 (V of 512 in two
    column chunks of 256) runs on ``fwd90aws`` after its first-use check, GQA 2:1, causal,
    Nq < Nk, and matches float64."""
    gen = torch.Generator().manual_seed(SEED)
    dq, dv = dims
    q = torch.randn(1, 40, 2, dq, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 57, 1, dq, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 57, 1, dv, generator=gen).to(torch.bfloat16)
    with on_virtual_sm90a(monkeypatch):
        out = flashtune.attention(q, k, v, causal=True)
        assert isinstance(out, torch.Tensor) and out.shape == (1, 40, 2, dv)
        assert first_use.refused("virtual-sm_90a") is None
        assert forward_ops() == {FAMILY.op}, forward_ops()
    err = float((out.double() - _attention64(q, k, v, True)).abs().max())
    assert err <= 2e-2, f"seed {SEED}: max |O - O64| = {err}"



@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["default", "plain", "other"])
@pytest.mark.parametrize("case", [(512, 256, DType.BF16, True, Shape(2, 8, 2, 1000, 1000)),
                                  (576, 128, DType.FP16, False, Shape(1, 4, 4, 333, 777)),
                                  (128, 64, DType.BF16, True, Shape(1, 4, 2, 300, 500))],
                         ids=lambda c: f"d{c[0]}v{c[1]}-{c[2].value}-{c[3]}-{c[4].key()}")
def test_matches_float64_on_a_gpu(case: tuple[int, int, DType, bool, Shape],
                                  schedule: str) -> None:
    """Driver-encoded tensor maps of 8 or 9 panels, real TMA, setmaxnreg and wgmma on a cc
    9.0 device."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm_90a kernels run on compute capability 9.0 only")
    from flashtune.runtime.backends.cuda import CudaBackend
    from flashtune.runtime.launch import verify

    dq, dv, dtype, causal, shape = case
    problem = _problem(dq, dv, dtype, causal=causal)
    config = _config(problem, schedule)
    verdict = verify(CudaBackend().load(families.render(problem, config)), shape, "cuda",
                     seed=SEED)
    assert verdict.ok, f"{config.key()}: {verdict.message}"


@pytest.mark.emulator
@pytest.mark.usefixtures("dispatcher")
def test_modifications_and_packed_sequences_at_wide_heads_run_fwd90aws(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the virtual sm_90a, a traced score_mod and mask_mod at 512 / 256 through
    ``attention`` and a packed call through ``attention_varlen`` run on ``fwd90aws`` and
    match float64 (softcap and a causal sliding window as Python functions; the packed
    sequences' outputs one by one)."""
    gen = torch.Generator().manual_seed(SEED)
    q = torch.randn(1, 45, 2, 512, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(1, 45, 1, d, generator=gen).to(torch.bfloat16) for d in (512, 256))
    lens = [19, 26]
    cu = torch.tensor([0, 19, 45], dtype=torch.int32)
    with on_virtual_sm90a(monkeypatch):
        modified = flashtune.attention(q, k, v, score_mod=flex_mods.softcap(3.0),
                                       mask_mod=flex_mods.sliding_window_causal(16))
        packed = flashtune.attention_varlen(q[0], k[0], v[0], cu, cu, 26, 26, causal=True)
        assert forward_ops() == {FAMILY.op}, forward_ops()
    assert isinstance(modified, torch.Tensor) and isinstance(packed, torch.Tensor)
    kk, vv = (t.double().repeat_interleave(2, 2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) / math.sqrt(512)
    i, j = torch.arange(45)[:, None], torch.arange(45)[None]
    scores = (3.0 * torch.tanh(scores / 3.0)).masked_fill((j > i) | (j <= i - 16), -math.inf)
    want = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), vv)
    err = float((modified.double() - want).abs().max())
    assert err <= 2e-2, f"seed {SEED}: modified: max |O - O64| = {err}"
    for start, n in zip((0, 19), lens, strict=True):
        rows = slice(start, start + n)
        want = _attention64(q[:, rows], k[:, rows], v[:, rows], True)[0]
        err = float((packed[rows].double() - want).abs().max())
        assert err <= 2e-2, f"seed {SEED}: sequence at {start}: max |O - O64| = {err}"
