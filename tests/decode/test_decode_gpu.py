# mypy: disable-error-code="no-untyped-call"
"""Decoding on a GPU: each kernel against float64 through its family, the API over a
sample of the grid, bad inputs reported with FLASHTUNE_CHECK_INPUTS=1 (after a
synchronisation) and by a trap otherwise (at the next synchronisation, in a child process:
a trap leaves the CUDA context unusable), and CUDA graph capture with device-side lengths.
Skipped without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from decode_cases import GridCase, call_api, inputs_of, problem_of, sample

import flashtune
from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, Problem, Shape
from flashtune.errors import InvalidInput
from flashtune.families.base import close_enough
from flashtune.families.checks import LSE_TOLERANCE, O_TOLERANCE
from flashtune.families.combine import COMBINE
from flashtune.families.decode.reference import attention_with_kvcache_reference
from flashtune.runtime.launch import prepare

pytestmark = pytest.mark.gpu
SEED = int(os.environ["FLASHTUNE_TEST_SEED"])


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


@pytest.mark.parametrize("case", sample(SEED + 2, 12), ids=lambda c: c.key)
def test_decode_kernel_matches_float64_on_the_gpu(case: GridCase) -> None:
    from flashtune.runtime.backends.cuda import CudaBackend

    problem = problem_of(case, 128, DType.BF16)
    config = families.of(problem).default_config(problem, get_arch(_arch()))
    kernel = CudaBackend().load(families.render(problem, config))
    launch = prepare(kernel, case.shape, "cuda", inputs=inputs_of(case, problem, "cuda"),
                     poison=True)
    launch.run()
    torch.cuda.synchronize()
    verdict = launch.verdict()
    assert verdict.ok, verdict.message


@pytest.mark.parametrize("splits", [1, 7, 128])
def test_combine_kernel_matches_float64_on_the_gpu(splits: int) -> None:
    from flashtune.runtime.backends.cuda import CudaBackend

    problem = Problem(128, DType.FP16, op="combine")
    shape = Shape(4, 8, 8, 3, 3)
    kernel = CudaBackend().load(families.render(
        problem, COMBINE.default_config(problem, get_arch(_arch()))))
    inputs = COMBINE.random_inputs(problem, shape, "cuda", seed=SEED, num_splits=splits)
    launch = prepare(kernel, shape, "cuda", inputs=inputs, poison=True)
    launch.run()
    torch.cuda.synchronize()
    assert launch.verdict().ok, launch.verdict().message


@pytest.mark.parametrize("case", sample(SEED + 3, 12), ids=lambda c: c.key)
def test_attention_with_kvcache_matches_float64_on_the_gpu(case: GridCase) -> None:
    inputs = inputs_of(case, problem_of(case, 128, DType.BF16), "cuda")
    out, lse = call_api(inputs, causal=case.causal, return_lse=True,
                        num_splits=None if case.num_splits == 1 else case.num_splits)
    ref_o, ref_lse = attention_with_kvcache_reference(inputs, case.causal)
    for name, got, want, tol in (("O", out, ref_o, O_TOLERANCE[DType.BF16]),
                                 ("LSE", lse, ref_lse, LSE_TOLERANCE)):
        assert not close_enough(name, got, want, tol)[2]


def test_bad_page_raises_with_the_check_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHTUNE_CHECK_INPUTS", "1")
    case = GridCase(16, 2, (8, 2), True, True, 4, seed=SEED)
    inputs = inputs_of(case, problem_of(case, 128, DType.BF16), "cuda")
    t = dict(inputs.tensors)
    table = t["block_table"].clone()
    table[1, 3] = 10**6
    with pytest.raises(InvalidInput, match=r"block_table\[1, 3\] = 1000000 is not a page"):
        flashtune.attention_with_kvcache(t["q"], t["k_cache"], t["v_cache"],
                                         t["cache_seqlens"], block_table=table,
                                         k=t["k_new"], v=t["v_new"])
    torch.cuda.synchronize()  # the context is still usable


def test_bad_length_traps_and_surfaces_at_the_next_synchronisation() -> None:
    script = textwrap.dedent("""
        import torch, flashtune
        q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
        cache = torch.randn(2, 256, 2, 128, device="cuda", dtype=torch.bfloat16)
        lengths = torch.tensor([10, 300], dtype=torch.int32, device="cuda")
        flashtune.attention_with_kvcache(q, cache, cache.clone(), lengths)
        print("launched", flush=True)
        torch.cuda.synchronize()
        print("synchronised")
    """)
    env = {k: v for k, v in os.environ.items() if k != "FLASHTUNE_CHECK_INPUTS"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)
    # A launch may already report the trap (the next launch of the call, the combine, can
    # see it); the next synchronisation at the latest must.
    assert "synchronised" not in done.stdout and done.returncode != 0
    assert "CUDA" in done.stderr or "illegal" in done.stderr, done.stderr[-2000:]


def test_cuda_graph_replays_with_new_lengths_on_the_device() -> None:
    case = GridCase(16, 1, (8, 2), False, False, 1, seed=SEED)
    inputs = inputs_of(case, problem_of(case, 128, DType.BF16), "cuda")
    t = inputs.tensors
    lengths = t["cache_seqlens"].clone()

    def step() -> torch.Tensor:
        return flashtune.attention_with_kvcache(t["q"], t["k_cache"], t["v_cache"], lengths,
                                                block_table=t["block_table"])

    step()  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    shorter = torch.minimum(t["cache_seqlens"], torch.full_like(lengths, 37))
    lengths.copy_(shorter)
    graph.replay()
    torch.cuda.synchronize()
    fresh = flashtune.attention_with_kvcache(t["q"], t["k_cache"], t["v_cache"], shorter,
                                             block_table=t["block_table"])
    assert torch.equal(captured, fresh)
