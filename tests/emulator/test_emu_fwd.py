"""The generated forward kernel in the emulator, launched through EmulatorBackend with the
packed argument list of kernel_args: numerics against a float64 reference in both schedules,
and the time it takes (the emulator must stay usable for the CI tier)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from emu_helpers import attention_reference

from flashtune.codegen.spec import DType, KernelConfig, Problem
from flashtune.families import render
from flashtune.families.fwd.args import pack_args
from flashtune.families.launch_args import grid
from flashtune.runtime.backends.base import Backend, LoadedKernel
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions, Schedule

pytestmark = pytest.mark.emulator

TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: Output tolerance relative to max |V|: P and O are rounded to the 16-bit type.
TOLERANCE = {"fp16": 2e-3, "bf16": 1.6e-2}


def run_forward(kernel: LoadedKernel, problem: Problem, batch: int, seqlen_q: int,
                seqlen_k: int, heads_q: int, heads_kv: int) -> float:
    """Launch on fresh random inputs with poisoned outputs; check; return the launch time."""
    dtype = TORCH_DTYPE[problem.dtype.value]
    q = torch.randn(batch, seqlen_q, heads_q, problem.head_dim).to(dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, problem.head_dim).to(dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, problem.head_dim).to(dtype)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((batch, heads_q, seqlen_q), float("nan"))
    scale = problem.head_dim ** -0.5
    args = pack_args(q, k, v, o, lse, scale)
    start = time.perf_counter()
    kernel.launch(grid(seqlen_q, heads_q, batch, kernel.source.config.block_m), args)
    elapsed = time.perf_counter() - start
    ref_o, ref_lse = attention_reference(q.float().numpy(), k.float().numpy(),
                                         v.float().numpy(), problem.causal, scale)
    tol = TOLERANCE[problem.dtype.value] * float(v.abs().max())
    np.testing.assert_allclose(o.float().numpy(), ref_o, rtol=0, atol=tol)
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=0, atol=1e-4)
    return elapsed


def test_backend_protocol() -> None:
    backend = EmulatorBackend()
    assert isinstance(backend, Backend)
    assert backend.name == "emulator"


@pytest.mark.parametrize("schedule", [Schedule.FORWARD, Schedule.REVERSE])
def test_forward_512_tokens_head_dim_128(schedule: Schedule) -> None:
    problem = Problem(128, DType.BF16)
    source = render(problem, KernelConfig(128, 64, 4, 2))
    start = time.perf_counter()
    kernel = EmulatorBackend(options=LaunchOptions(schedule=schedule)).load(source)
    built = time.perf_counter() - start
    assert isinstance(kernel, LoadedKernel)
    ran = run_forward(kernel, problem, 1, 512, 512, 2, 2)
    # Timing is reported, not asserted (a shared machine is noisy); benchmarks/host.py
    # measures emulator throughput.
    print(f"\nforward b1 h2 s512 d128 bf16 ({schedule.value}): build {built:.2f} s, "
          f"run {ran:.2f} s, total {built + ran:.2f} s")


@pytest.mark.parametrize(
    ("problem", "config", "shape"),
    [
        (Problem(64, DType.FP16, causal=True), KernelConfig(64, 32, 4, 3), (2, 77, 130, 4, 2)),
        (Problem(96, DType.BF16), KernelConfig(64, 64, 4, 1), (1, 130, 77, 3, 1)),
    ],
    ids=["fp16-causal-d64-gqa", "bf16-d96-single-stage"],
)
def test_forward_ragged_shapes(problem: Problem, config: KernelConfig,
                               shape: tuple[int, int, int, int, int]) -> None:
    kernel = EmulatorBackend().load(render(problem, config))
    for schedule in Schedule:
        kernel.options = LaunchOptions(schedule=schedule)
        run_forward(kernel, problem, *shape)
