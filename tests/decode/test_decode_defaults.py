"""The decode kernel's default configs (``families.decode.space.DEFAULTS``) compile through
NVRTC without spilling registers and within the arch's shared memory, for the kernels a
default serves: plain, causal, with window + softcap + ALiBi, and with a block mask's tile
ranges (the mask evaluated on partial tiles).

The default run compiles, on sm_80, head dim 128's default with a block mask (the kernel
whose 64-key tiles spilled there) and head dims 64, 96 and 256 with a variant drawn by
FLASHTUNE_TEST_SEED, each in a seeded dtype (printed); ``-m sweep`` compiles every head
dim, dtype and variant on sm_80, sm_86 and sm_90.
"""

from __future__ import annotations

import itertools
import os
import random
from typing import Any, cast

import pytest

from flashtune import families
from flashtune.api.flex import traced_feature
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, Problem
from flashtune.codegen.trace import trace
from flashtune.families.decode import DECODE
from flashtune.toolchain.compiler import compile_pairs

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
HEAD_DIMS = (64, 96, 128, 256)
VARIANTS = ("plain", "causal", "window-softcap-alibi", "block-mask")
ARCHS = ("sm_80", "sm_86", "sm_90")


def _sliding(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """A causal sliding window whose width grows with the head (a per-head mask)."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 24 + 8 * h)


def _problem(head_dim: int, dtype: DType, variant: str) -> Problem:
    if variant == "block-mask":
        traced = trace(None, _sliding, tiles=True)
        return Problem(head_dim, dtype, op="decode", features=[traced_feature(traced)])
    switches = {"plain": {}, "causal": {"causal": True},
                "window-softcap-alibi": {"window": True, "softcap": True, "alibi": True}}
    return Problem(head_dim, dtype, op="decode", **cast(dict[str, Any], switches[variant]))


def _check(cases: list[tuple[int, DType, str, str]]) -> None:
    """Compile the default of each (head dim, dtype, variant, arch); fail naming every
    default that spills, fails to compile or exceeds the arch's shared memory."""
    jobs, names = [], []
    for head_dim, dtype, variant, arch in cases:
        problem = _problem(head_dim, dtype, variant)
        config = DECODE.default_config(problem, get_arch(arch))
        jobs.append((families.render(problem, config), arch))
        names.append(f"d{head_dim} {dtype.name} {variant} {config.key()} on {arch}")
    problems = []
    for name, result in zip(names, compile_pairs(jobs), strict=True):
        if result.failure is not None:
            problems.append(f"{name}: {result.failure.message}")
            continue
        res = result.unwrap().resources
        if res.spill_bytes or res.registers <= 0:
            problems.append(f"{name}: {res.spill_stores} B spill stores, {res.spill_loads} B "
                            f"spill loads, {res.registers} registers")
        if res.smem_bytes > get_arch(result.arch).max_smem_per_block:
            problems.append(f"{name}: {res.smem_bytes} B shared memory")
    assert not problems, ("decode defaults spill (pick a smaller tile in "
                          "families/decode/space.DEFAULTS):\n" + "\n".join(problems))


def _sample() -> list[tuple[int, DType, str, str]]:
    rng = random.Random(SEED)
    cases = []
    for head_dim in HEAD_DIMS:
        variant = "block-mask" if head_dim == 128 else rng.choice(VARIANTS)
        cases.append((head_dim, rng.choice(list(DType)), variant, "sm_80"))
    return cases


def test_decode_defaults_compile_without_spills_on_sm80() -> None:
    print(f"FLASHTUNE_TEST_SEED={SEED}: {_sample()}")
    _check(_sample())


@pytest.mark.sweep
def test_decode_defaults_compile_without_spills_on_every_arch() -> None:
    _check(list(itertools.product(HEAD_DIMS, DType, VARIANTS, ARCHS)))
