"""The forward kernel's structure knobs on a GPU: a few configs that together set every knob
value run through the cuda backend and the family's launch plan (a persistent kernel gets its
SM-sized grid) against the float64 reference, NaN-poisoned outputs, on causal, GQA and
off-tile shapes. Skipped without a GPU; a config the device's arch rules out is skipped with
the rule's reason."""

from __future__ import annotations

import os

import pytest
import torch

from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families import render
from flashtune.families.fwd import FORWARD
from flashtune.runtime.backends import cuda
from flashtune.runtime.launch import verify

pytestmark = pytest.mark.gpu
SEED = int(os.environ["FLASHTUNE_TEST_SEED"])

#: (problem, config): every knob value appears at least once.
CASES: tuple[tuple[Problem, KernelConfig], ...] = (
    (Problem(128, DType.BF16, causal=True),
     KernelConfig(128, 32, 4, 2, extras={"swizzle": 1, "pipeline": 1, "order": "longest",
                                         "persistent": 1})),
    (Problem(128, DType.FP16), KernelConfig(64, 48, 4, 1, extras={"qregs": 1,
                                                                 "minblocks": 3})),
    (Problem(64, DType.BF16, causal=True),
     KernelConfig(128, 80, 8, 2, extras={"order": "headsinner", "minblocks": 2})),
    (Problem(64, DType.FP16), KernelConfig(64, 32, 4, 1, extras={"minblocks": 4,
                                                                "persistent": 1})),
    (Problem(64, DType.FP16, causal=True), KernelConfig(256, 32, 16, 2,
                                                        extras={"persistent": 1})),
    (Problem(64, DType.BF16, causal=True), KernelConfig(192, 48, 4, 1, extras={"swizzle": 1})),
)
#: GQA 4:1 with more (head, batch) pairs than a persistent grid has slots per query block,
#: so its blocks loop; off the tile grid; Nq < Nk and Nq > Nk (causal rows with no key).
SHAPES = (Shape(8, 16, 4, 1000, 1000), Shape(2, 6, 3, 333, 777), Shape(1, 4, 1, 517, 129))


@pytest.mark.parametrize(("problem", "config"), CASES,
                         ids=[f"{p.key()}-{c.key()}" for p, c in CASES])
def test_knob_configs_match_float64_reference(problem: Problem, config: KernelConfig) -> None:
    major, minor = torch.cuda.get_device_capability()
    arch = get_arch(f"sm_{major}{minor}")
    reason = FORWARD.static_check(problem, config, arch)
    if reason is not None:
        pytest.skip(f"{config.key()} is ruled out on {arch.name}: {reason}")
    kernel = cuda.CudaBackend().load(render(problem, config))
    for index, shape in enumerate(SHAPES):
        verdict = verify(kernel, shape, "cuda", seed=SEED + index)
        assert verdict.ok, f"{shape.key()} (seed {SEED + index}): {verdict.message}"
