"""Q/K head dims 512 and 576 in the mma.sync backward (``bwd``, ``bwddet``): output column
chunks (``WithBwdColumnChunks``, the ``chunks`` knob), V's head dim up to Q/K's (Gemma 4's
512 / 512, DeepSeek's absorbed MLA 576 / 512, 512 / 256).

Numerics: the CPU emulator against the float64 reference (``BackwardFamily.reference``,
flash-attn's rule as the bound in ``compare``), dK and dV poisoned with NaN before each
launch (the dQ accumulator zeroed as the kernel's contract requires), fresh inputs from a
printed seed, odd lengths; causal and not, GQA; the forward's features the same template
gives (window, softcap, ALiBi, varlen, dropout); ``bwddet`` bitwise equal over shuffled
block orders; ``flashtune.attention`` training against float64 autograd. Also: the
defaults compile without spills (NVRTC 13), and what stays unserved is refused by name.
The default run takes a seeded sample (the seed in each id replays it); ``-m sweep`` the
grid. The wide kernels are slow in the emulator: the sequences stay short (33-70).
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch
from feature_inputs import backward_inputs
from split_dims import case_id, run_split

import flashtune
from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.errors import FeatureNotSupported
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions
from flashtune.toolchain.compiler import compile_source

_SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
#: (Q/K's head dim, V's head dim).
PAIRS = ((512, 512), (576, 512), (512, 256), (576, 576), (576, 128))
SHAPES = (Shape(1, 2, 1, 40, 50), Shape(2, 2, 2, 61, 37), Shape(1, 4, 1, 33, 70))


def _configs(mode: str) -> tuple[KernelConfig, ...]:
    return tuple(KernelConfig(m, n, w, s, extras=(("dqmode", mode), ("chunks", c)))
                 for m, n, w, s, c in ((32, 16, 2, 1, 4), (32, 16, 2, 1, 2),
                                       (64, 16, 4, 1, 1), (32, 32, 2, 2, 4),
                                       (64, 16, 4, 2, 2)))


CONFIGS = {"bwd": _configs("atomic"), "bwddet": _configs("split")}
#: The emulator's limits are sm_90's (227 KB of shared memory per block).
_ARCH = get_arch("sm_90")


def _problem(op: str, pair: tuple[int, int], dtype: DType, causal: bool,
             features: frozenset[str] = frozenset()) -> Problem:
    return Problem(pair[0], dtype, causal=causal, op=op, head_dim_v=pair[1],
                   features=features)


def _grid() -> list[tuple[str, tuple[int, int], DType, bool, KernelConfig, Shape]]:
    return [(op, pair, dtype, causal, c, s) for op in CONFIGS
            for pair, dtype, causal, c, s in itertools.product(
                PAIRS, (DType.FP16, DType.BF16), (False, True), CONFIGS[op], SHAPES)
            if families.get(op).static_check(_problem(op, pair, dtype, causal), c,
                                             _ARCH) is None]


_GRID = _grid()
#: The default run: Gemma 4's and DeepSeek's pairs, each on a row drawn from the seed; the
#: grid (with the session's seed) under ``-m sweep``.
CASES = [*((*random.Random(_SEED + 60 + i).choice([r for r in _GRID if r[1] == pair]),
            _SEED + 60 + i) for i, pair in enumerate(PAIRS[:2])),
         *(pytest.param(*row, _SEED, marks=pytest.mark.sweep) for row in _GRID)]


@pytest.mark.emulator
@pytest.mark.parametrize("op, pair, dtype, causal, config, shape, seed", CASES, ids=case_id)
def test_wide_head_dim_gradients_match_float64(op: str, pair: tuple[int, int], dtype: DType,
                                               causal: bool, config: KernelConfig,
                                               shape: Shape, seed: int) -> None:
    _case(_problem(op, pair, dtype, causal), config, shape, seed)


def _case(problem: Problem, config: KernelConfig, shape: Shape, seed: int) -> None:
    """One emulator launch against float64 (``run_split``) of a config the emulator's
    limits (sm_90's) allow."""
    print(f"seed={seed}")
    assert families.of(problem).static_check(problem, config, _ARCH) is None
    run_split(problem, config, shape, seed, "dv")


FEATURE_SETS = (frozenset({"window"}), frozenset({"softcap", "alibi"}),
                frozenset({"varlen"}), frozenset({"dropout"}))
_FEATURE_GRID = [(op, pair, dtype, causal, f, c, s)
                 for op, pair, dtype, causal, f, c, s in itertools.product(
                     CONFIGS, PAIRS[:3], (DType.FP16, DType.BF16), (False, True),
                     FEATURE_SETS, (0, 1), SHAPES)
                 if not (causal and "window" in f)]
#: The default run: one feature set drawn from the seed; every set under ``-m sweep``.
FEATURE_CASES = [(*random.Random(_SEED + 70).choice(_FEATURE_GRID), _SEED + 70),
                 *(pytest.param(*row, _SEED, marks=pytest.mark.sweep)
                   for row in _FEATURE_GRID)]


@pytest.mark.emulator
@pytest.mark.parametrize("op, pair, dtype, causal, features, which, shape, seed",
                         FEATURE_CASES, ids=case_id)
def test_wide_head_dim_gradients_with_features_match_float64(
        op: str, pair: tuple[int, int], dtype: DType, causal: bool, features: frozenset[str],
        which: int, shape: Shape, seed: int) -> None:
    """The forward's features from the same template (CONFIGS[op][which]: 4 or 2 chunks)."""
    _case(_problem(op, pair, dtype, causal, features), CONFIGS[op][which], shape, seed)


def _launch(problem: Problem, config: KernelConfig, shape: Shape, inputs: object,
            order: int | None) -> dict[str, torch.Tensor]:
    family = families.of(problem)
    kernel = EmulatorBackend(options=LaunchOptions(block_order_seed=order)).load(
        families.render(problem, config))
    outputs = family.empty_outputs(problem, shape, inputs, poison=True)  # type: ignore[arg-type]
    plan = family.launch_plan(problem, config, shape, inputs, outputs)  # type: ignore[arg-type]
    kernel.launch(plan.grid, plan.args)
    return outputs


@pytest.mark.emulator
def test_bwddet_is_bitwise_equal_over_block_orders_with_features() -> None:
    """576 / 512 in two chunks with a window, softcap and ALiBi, GQA: 5 key tiles in 4 dQ
    slices (the emulator's 4 SMs), so one block adds two key tiles into its slice; the
    chunks' blocks add disjoint columns. Every order gives the same bits, within the
    float64 reference's bound."""
    problem = _problem("bwddet", (576, 512), DType.BF16, False,
                       frozenset({"window", "softcap", "alibi"}))
    config = CONFIGS["bwddet"][1]
    shape = Shape(1, 2, 1, 45, 70)
    inputs = backward_inputs(families.of(problem), problem, shape, _SEED, (30, 6))
    runs = [_launch(problem, config, shape, inputs, order) for order in (None, 1)]
    assert runs[0]["dq_accum"].shape[0] == 4
    family = families.of(problem)
    verdict = family.compare(problem, shape, runs[0], family.reference(problem, inputs))
    assert verdict.ok, f"seed={_SEED}: {verdict.message}"
    for name in ("dk", "dv", "dq_accum"):
        assert torch.equal(runs[1][name], runs[0][name]), name


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                 ) -> torch.Tensor:
    """Attention (B, Nq, Hq, Dv) by its definition in the inputs' type (float64 for the
    reference, bf16 for PyTorch's own low-precision error), K and V repeated over GQA."""
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * q.shape[3] ** -0.5
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        keep = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv)


@pytest.mark.emulator
@pytest.mark.parametrize("deterministic", [False, pytest.param(True, marks=pytest.mark.sweep)])
def test_attention_trains_with_a_wide_head_dim(deterministic: bool) -> None:
    """``flashtune.attention`` with DeepSeek's 576 / 512 (V's forward in two column chunks,
    the backward's defaults), GQA 2:1, causal with Nq < Nk: ``loss.backward()`` gives dQ,
    dK and dV within flash-attn's rule of float64 autograd's: at most twice PyTorch's own
    bf16 error (plus 1e-3)."""
    gen = torch.Generator().manual_seed(_SEED)
    q, k, v = (torch.randn(1, n, h, d, generator=gen).to(torch.bfloat16).requires_grad_()
               for n, h, d in ((37, 2, 576), (50, 1, 576), (50, 1, 512)))
    grad = torch.randn(1, 37, 2, 512, generator=gen).to(torch.bfloat16)
    out = flashtune.attention(q, k, v, causal=True, backend="emulator",
                              deterministic=deterministic)
    assert isinstance(out, torch.Tensor)
    out.backward(grad)  # type: ignore[no-untyped-call]  # unannotated in torch
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    rq, rk, rv = ref
    _attention(rq, rk, rv, True).backward(grad.double())  # type: ignore[no-untyped-call]  # unannotated in torch
    # PyTorch's own attention in bf16 (every product and the softmax rounded): its error
    # against float64 is the scale of flash-attn's rule.
    low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    lq, lk, lv = low
    _attention(lq, lk, lv, True).backward(grad)  # type: ignore[no-untyped-call]  # unannotated in torch
    for name, got, want, base in zip("qkv", (q.grad, k.grad, v.grad),
                                     (r.grad for r in ref), (t.grad for t in low),
                                     strict=True):
        assert got is not None and want is not None and base is not None
        assert got.shape == want.shape
        err = float((got.double() - want).abs().max())
        floor = float((base.double() - want).abs().max())
        assert err <= 2 * floor + 1e-3, f"d{name}: {err} vs PyTorch bf16 {floor}, seed={_SEED}"


_DEFAULT_CASES = list(itertools.product(("sm_80", "sm_86", "sm_90"), ("bwd", "bwddet"),
                                        ((576, 512), (512, 512), (512, 256), (576, 256),
                                         (576, 576))))


def _served(arch: str, pair: tuple[int, int]) -> bool:
    return not (arch == "sm_86" and pair[1] > 256)


@pytest.mark.parametrize("arch, op, pair", [
    pytest.param(*c, marks=() if c[0] == "sm_80" and c[2] == (576, 512) and c[1] == "bwd"
                 else pytest.mark.sweep) for c in _DEFAULT_CASES if _served(c[0], c[2])],
    ids=case_id)
def test_the_wide_defaults_compile_without_spills(arch: str, op: str,
                                                  pair: tuple[int, int]) -> None:
    for dtype, causal in ((DType.BF16, False), (DType.FP16, True)):
        problem = _problem(op, pair, dtype, causal)
        config = families.get(op).default_config(problem, get_arch(arch))
        kernel = compile_source(families.render(problem, config), arch)
        print(problem.key(), arch, config.key(), kernel.resources)
        assert kernel.resources.spill_stores == 0 and kernel.resources.spill_loads == 0


def test_what_stays_unserved_is_refused_by_name() -> None:
    problem = _problem("bwd", (576, 512), DType.BF16, True)
    with pytest.raises(FeatureNotSupported, match=r"needs at least \d+ B of shared memory"
                       ".* sm_86 per-block limit 101376 B"):
        families.get("bwd").default_config(problem, get_arch("sm_86"))
    four = KernelConfig(32, 16, 2, 1, extras=(("dqmode", "atomic"), ("chunks", 4)))
    why = families.get("bwd").static_check(_problem("bwd", (512, 200), DType.BF16, False),
                                           four, _ARCH)
    assert why is not None and "V head dim (200) to be a multiple of 64" in why
    why = families.get("bwd").static_check(_problem("bwd", (256, 256), DType.BF16, False),
                                           four, _ARCH)
    assert why is not None and "['chunks'] are not knobs" in why  # a narrow head dim's space
    with pytest.raises(FeatureNotSupported, match="takes Q/K head dims up to 256"):
        families.get("bwd8").check_problem(Problem(512, DType.BF16, op="bwd8",
                                                   head_dim_v=256))


def test_cc90_runs_wide_head_dims_on_the_mma_sync_backward() -> None:
    """The sm_90a backward (``bwd90a``, which serves ``bwd`` and ``bwddet`` on cc 9.0) takes
    head dims up to 256: wide problems stay on the mma.sync family there, including those
    whose V is too wide to be a problem of the sm_90a op at all."""
    for op, pair in itertools.product(CONFIGS, ((512, 512), (576, 512), (512, 256))):
        problem = _problem(op, pair, DType.BF16, True)
        assert families.served_problem(problem, get_arch("sm_90a")) == problem
