"""Q/K head dims above 256 in the mma.sync forward (``spec.WIDE_HEAD_DIMS``): Gemma 4's 512
and DeepSeek's absorbed MLA prefill (576 = 512 latent + 64 RoPE), beside V's head dim of at
most 256 in one kernel (``fwd_d576v256_bf16_causal``); ``flashtune.attention`` runs a wider
V (512 / 512, 576 / 512) in column chunks of 256, each its own launch.

Numerics: the CPU emulator against the float64 reference, outputs poisoned with NaN before
each launch (``split_dims.run_split``), inputs fresh seeded normals; through the API against
float64 attention written here (GQA, causal with Nq != Nk, softcap and a window). Also: the
defaults compile without spills (NVRTC 13, sm_80 / sm_86 / sm_90), and what is not served is
refused by name (other families, other wide dims; the backward is
test_bwd_wide_heads.py's); score and mask modifications run at these head dims too. The
default run takes a seeded sample (the seed in the id replays it); ``-m sweep`` the grid.
"""

from __future__ import annotations

import itertools
import math
import os
import random

import pytest
import torch
from sampling import seeded_part
from split_dims import case_id, run_split

import flashtune
from flashtune import families
from flashtune.api import flex_mods
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.errors import (
    FeatureNotSupported,
    InvalidProblem,
)
from flashtune.families.fwd import FORWARD
from flashtune.toolchain.compiler import compile_source

pytestmark = pytest.mark.emulator

_SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
#: (Q/K's head dim, V's head dim) of one kernel.
PAIRS = ((576, 256), (512, 256), (576, 128), (512, 64))
SHAPES = (Shape(1, 2, 1, 70, 90), Shape(2, 1, 1, 33, 20))
CONFIGS = (KernelConfig(64, 32, 4, 1), KernelConfig(32, 32, 2, 1))
GRID = list(itertools.product(PAIRS, (DType.FP16, DType.BF16), (False, True), CONFIGS, SHAPES))


def _sample() -> list[tuple[object, ...]]:
    """576 / 256 or 512 / 256 on the small shape (the emulation of the wide kernels is
    slow: the other shapes are in the sweep), the rest drawn."""
    rng = random.Random(f"{_SEED}-wide")
    pair = rng.choice(PAIRS[:2])
    return [(*rng.choice([c for c in GRID if c[0] == pair and c[4] == SHAPES[1]]), _SEED)]


def _run(pair: tuple[int, int], dtype: DType, causal: bool, config: KernelConfig,
         shape: Shape, seed: int) -> None:
    problem = Problem(pair[0], dtype, causal=causal, head_dim_v=pair[1])
    assert FORWARD.static_check(problem, config, get_arch("sm_80")) is None
    run_split(problem, config, shape, seed, "o")


@pytest.mark.parametrize("pair, dtype, causal, config, shape, seed", _sample(), ids=case_id)
def test_a_wide_qk_kernel_matches_float64(pair: tuple[int, int], dtype: DType, causal: bool,
                                          config: KernelConfig, shape: Shape,
                                          seed: int) -> None:
    _run(pair, dtype, causal, config, shape, seed)


@pytest.mark.sweep
@pytest.mark.parametrize("pair, dtype, causal, config, shape", GRID, ids=case_id)
def test_wide_qk_kernels_grid(pair: tuple[int, int], dtype: DType, causal: bool,
                              config: KernelConfig, shape: Shape) -> None:
    _run(pair, dtype, causal, config, shape, _SEED)


def _attention64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 window: tuple[int, int] = (-1, -1), softcap: float | None = None
                 ) -> torch.Tensor:
    """float64 attention of (B, N, H, D) tensors, flash-attn's definitions."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    nq, nk = s.shape[-2:]
    i, j = torch.arange(nq)[:, None] + nk - nq, torch.arange(nk)[None]
    hidden = torch.zeros(nq, nk, dtype=torch.bool)
    right = 0 if causal else window[1]
    if causal or right >= 0:
        hidden |= j > i + right
    if window[0] >= 0:
        hidden |= j < i - window[0]
    s = s.masked_fill(hidden, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


API_CASES = [((512, 512), True, (-1, -1), None), ((576, 512), False, (24, 8), 30.0)]
API_IDS = ["d512-causal", "d576v512-window-softcap"]


def test_attention_runs_a_wide_v_in_column_chunks() -> None:
    _api_case(*random.Random(f"{_SEED}-wide-api").choice(API_CASES))


@pytest.mark.sweep
@pytest.mark.parametrize("dims, causal, window, softcap", API_CASES, ids=API_IDS)
def test_attention_runs_both_wide_cases(dims: tuple[int, int], causal: bool,
                                        window: tuple[int, int], softcap: float | None) -> None:
    _api_case(dims, causal, window, softcap)


def _api_case(dims: tuple[int, int], causal: bool,
                                                  window: tuple[int, int],
                                                  softcap: float | None) -> None:
    """Gemma 4's 512 / 512 and DeepSeek's absorbed 576 / 512 through flashtune.attention on
    the emulator (V in two chunks of 256), GQA 2:1, Nq < Nk, against float64."""
    gen = torch.Generator().manual_seed(_SEED)
    dq, dv = dims
    q = torch.randn(1, 40, 2, dq, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 57, 1, dq, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 57, 1, dv, generator=gen).to(torch.bfloat16)
    out, lse = flashtune.attention(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                   backend="emulator", return_lse=True)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 40, 2, dv)
    ref = _attention64(q, k, v, causal, window, softcap)
    err = float((out.double() - ref).abs().max())
    assert err <= 2e-2, f"seed {_SEED}: max |O - O64| = {err}"
    assert torch.isfinite(lse).all()


#: sm_80's defaults of both wide pairs, causal and not: by default one pair (drawn from the
#: seed) per mask; sm_86's and sm_90's under ``-m sweep``.
_WIDE_DEFAULTS = [
    *(case for causal in (False, True) for case in seeded_part(
        [("sm_80", dims, causal) for dims in ((576, 256), (512, 256))], 1,
        f"wide-fwd-nvrtc-{causal}", several=True)),
    *(pytest.param(arch, dims, causal, marks=pytest.mark.sweep)
      for arch in ("sm_86", "sm_90")
      for dims, causal in itertools.product(((576, 256), (512, 256)), (False, True)))]


@pytest.mark.parametrize("arch, dims, causal", _WIDE_DEFAULTS, ids=str)
def test_the_wide_defaults_compile_without_spills(arch: str, dims: tuple[int, int],
                                                  causal: bool) -> None:
    dq, dv = dims
    problem = Problem(dq, DType.BF16, causal=causal, head_dim_v=dv)
    config = FORWARD.default_config(problem, get_arch(arch))
    kernel = compile_source(families.render(problem, config), arch)
    print(problem.key(), arch, config.key(), kernel.resources)
    assert kernel.resources.spill_stores == 0 and kernel.resources.spill_loads == 0


def test_what_is_not_served_is_refused_by_name() -> None:
    q, k, v = (torch.randn(1, 8, 1, 512, dtype=torch.bfloat16) for _ in "qkv")
    with pytest.raises(InvalidProblem, match="needs V's head dim of at most 256"):
        Problem(512, DType.BF16)
    with pytest.raises(InvalidProblem, match="head_dim=384 is not supported"):
        Problem(384, DType.BF16, head_dim_v=128)
    with pytest.raises(FeatureNotSupported, match="takes Q/K head dims up to 256, got 576"):
        families.get("bwd8").check_problem(Problem(576, DType.BF16, op="bwd8", head_dim_v=256))


def test_modifications_at_a_wide_head_dim_match_float64() -> None:
    """A traced score_mod and mask_mod at 512 / 512 (V in two column chunks, each launch
    applying them): softcap and a causal sliding window as Python functions, against
    float64 attention with the same softcap and window."""
    gen = torch.Generator().manual_seed(_SEED)
    q = torch.randn(1, 45, 2, 512, generator=gen).to(torch.float16)
    k, v = (torch.randn(1, 45, 1, 512, generator=gen).to(torch.float16) for _ in "kv")
    out = flashtune.attention(q, k, v, score_mod=flex_mods.softcap(3.0),
                              mask_mod=flex_mods.sliding_window_causal(16), backend="emulator")
    assert isinstance(out, torch.Tensor)
    ref = _attention64(q, k, v, False, (15, 0), 3.0)
    err = float((out.double() - ref).abs().max())
    assert err <= 4e-3, f"seed {_SEED}: max |O - O64| = {err}"
