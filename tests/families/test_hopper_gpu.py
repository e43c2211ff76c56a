"""The sm_90a families on a compute capability 9.0 GPU: each family's default config and a
seeded sample of its space against float64, with driver-encoded tensor maps, real TMA,
wgmma and setmaxnreg (the emulator checks every config of the space; this checks that the
hardware agrees). Skipped without a GPU, and on GPUs of another compute capability."""

from __future__ import annotations

import os
import random

import pytest
import torch

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.families.base import KernelFamily
from flashtune.families.hopper.ws import HopperWsForwardFamily
from flashtune.runtime.launch import verify

pytestmark = pytest.mark.gpu

SEED = int(os.environ["FLASHTUNE_TEST_SEED"])
SM90A = get_arch("sm_90a")
#: Every registered family built for sm_90a, so a family that lands is covered here, but the
#: warp-specialised ones: test_hopper_ws.py runs their chosen variants (ping-pong, the widest
#: tiles) on the GPU, and the GPU check's time cap for its tests is short.
HOPPER_FAMILIES = [f for f in families.all_families() if f.target_arch == SM90A.name
                   and not isinstance(f, HopperWsForwardFamily)]
#: Configs of the space per family and case besides the default (seeded, a new draw per run;
#: few, as each is a cold compile inside the GPU check's time cap for its tests).
SAMPLED = 1
#: head dim, dtype, causal, shape (batch, heads, heads_kv, seqlen_q, seqlen_k): GQA, odd
#: lengths, Nq != Nk (bottom-right causal), every head dim of the families.
CASES = [(128, DType.BF16, True, Shape(2, 8, 2, 1000, 1000)),
         (64, DType.FP16, False, Shape(1, 4, 4, 333, 777)),
         (256, DType.BF16, True, Shape(1, 2, 1, 200, 130))]


def _configs(family: KernelFamily, problem: Problem) -> list[KernelConfig]:
    default = family.default_config(problem, SM90A)
    rng = random.Random(f"{SEED}-{problem.key()}")
    others = [c for c in family.candidates(problem, SM90A) if c != default]
    return [default, *rng.sample(others, min(SAMPLED, len(others)))]


@pytest.mark.parametrize("family", HOPPER_FAMILIES, ids=lambda f: f.op)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-{c[1].value}-{c[2]}-"
                                                      f"{c[3].key()}")
def test_sm90a_configs_match_float64_on_a_gpu(case: tuple[int, DType, bool, Shape],
                                              family: KernelFamily) -> None:
    if torch.cuda.get_device_capability() != SM90A.compute_capability:
        pytest.skip("the sm_90a kernels run on compute capability 9.0 only")
    from flashtune.runtime.backends.cuda import CudaBackend

    head_dim, dtype, causal, shape = case
    problem = Problem(head_dim, dtype, causal=causal, op=family.op)
    backend = CudaBackend()
    failures = []
    for config in _configs(family, problem):
        source = families.render(problem, config)
        verdict = verify(backend.load(source), shape, "cuda", seed=SEED)
        if not verdict.ok:
            failures.append(f"{config.key()}: {verdict.message}")
    assert not failures, f"seed {SEED}: " + "; ".join(failures)
