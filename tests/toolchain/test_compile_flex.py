"""Traced modifications compile through NVRTC for the GPU (the emulator tests run the same
source on the CPU): a T5 bias over a document mask with a block mask's tile ranges on sm_80,
and every ready modification on sm_80 and sm_90, forward and backward (``bwd``, ``bwddet``:
the modification, its slope and the block mask's column ranges), under -m sweep; the
default run compiles one backward (the emulator runs the same source on the CPU)."""

from __future__ import annotations

import pytest
import torch

from flashtune.api import flex_mods
from flashtune.api.flex import traced_feature
from flashtune.codegen.arch import ARCHS
from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.codegen.trace import trace
from flashtune.families import get, render
from flashtune.toolchain.cache import ArtifactCache
from flashtune.toolchain.compiler import compile_source

_N = 300
_MODS = {
    "t5-document-tiles": (flex_mods.t5_relative_bias(torch.randn(4, 32), _N),
                          flex_mods.document(torch.arange(_N) // 70), True),
    "alibi-sliding": (flex_mods.alibi(torch.rand(4)), flex_mods.sliding_window_causal(64),
                      True),
    "softcap-prefix": (flex_mods.softcap(30.0), flex_mods.prefix_lm(torch.tensor([9, 40])),
                       False),
    "global": (None, flex_mods.global_tokens(4, 32), True),
    "dilated": (None, flex_mods.dilated_window(8, 4), True),
}


def _compile(name: str, arch: str, cache: ArtifactCache, op: str = "fwd") -> None:
    score_mod, mask_mod, tiles = _MODS[name]
    traced = trace(score_mod, mask_mod, tiles=tiles)
    problem = Problem(64, DType.FP16, op=op, features=[traced_feature(traced)])
    config = (KernelConfig(128, 64, 4, 2) if op == "fwd"
              else get(op).default_config(problem, ARCHS[arch]))
    source = render(problem, config)
    assert traced.cuda in source.code
    if op != "fwd":
        assert traced.grad_cuda() in source.code
    # Compiled and its resources read back (spilling is the tuner's to weigh: with 128 x 64
    # tiles, softcap's tanh over a prefix-LM mask spills on both arches).
    resources = compile_source(source, arch, cache=cache).resources
    assert 0 < resources.registers <= 255, f"{name} on {arch}: {resources}"


@pytest.mark.sweep  # flex_ops.cuh itself is in every forward kernel the default run compiles
def test_a_traced_kernel_compiles_for_sm80(cache: ArtifactCache) -> None:
    _compile("t5-document-tiles", "sm_80", cache)


@pytest.mark.sweep
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", sorted(_MODS))
def test_every_ready_modification_compiles(name: str, arch: str, cache: ArtifactCache) -> None:
    _compile(name, arch, cache)


def test_a_traced_backward_compiles_for_sm80(cache: ArtifactCache) -> None:
    _compile("t5-document-tiles", "sm_80", cache, "bwddet")


@pytest.mark.sweep
@pytest.mark.parametrize("op", ["bwd", "bwddet"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", sorted(_MODS))
def test_every_ready_modification_compiles_in_the_backward(name: str, arch: str, op: str,
                                                           cache: ArtifactCache) -> None:
    _compile(name, arch, cache, op)
