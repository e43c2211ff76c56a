"""The forward's default config for a score modification that loads captured tensors: the
table's key tile narrowed to ``CAPTURED_MOD_BLOCK_N`` so the kernel keeps its registers
(d64's m128_n128 spills with a T5 bias), checked with NVRTC for sm_80 and sm_90; a
modification without captured tensors keeps the table's tile."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from flashtune import families
from flashtune.api import flex_mods
from flashtune.api.flex import traced_feature
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, Problem
from flashtune.codegen.trace import trace
from flashtune.families.fwd.defaults import CAPTURED_MOD_BLOCK_N, default_entry
from flashtune.toolchain.compiler import compile_source


def _problem(score_mod: Callable[..., Any], causal: bool) -> Problem:
    name = traced_feature(trace(score_mod, None))
    return Problem(64, DType.BF16, causal=causal, features=(name,))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_captured_tensor_narrows_the_default_tile_and_it_does_not_spill(
        arch: str, causal: bool) -> None:
    problem = _problem(flex_mods.t5_relative_bias(torch.randn(4, 32), 512, 64), causal)
    family = families.of(problem)
    config = family.default_config(problem, get_arch(arch))
    table = default_entry(problem, get_arch(arch)).config
    assert table.block_n > CAPTURED_MOD_BLOCK_N  # the case the rule exists for
    assert config.block_n == CAPTURED_MOD_BLOCK_N and config.block_m == table.block_m
    assert "captured tensors" in family.default_reason(problem, get_arch(arch))
    resources = compile_source(families.render(problem, config), arch).resources
    assert resources.spill_stores == 0 and resources.spill_loads == 0, resources


def test_a_modification_without_captured_tensors_keeps_the_table_tile() -> None:
    problem = _problem(flex_mods.softcap(5.0), False)
    arch = get_arch("sm_90")
    assert families.of(problem).default_config(problem, arch) == default_entry(
        problem, arch).config
