"""Sampling the sm_90a spaces for the emulator tests, the wgmma shapes of their SASS, and
one emulator launch of a family's kernel."""

from __future__ import annotations

import collections
import dataclasses
import re

import torch

from flashtune import families
from flashtune.codegen.dtypes import DType, Fp8Type
from flashtune.codegen.spec import KernelConfig, Problem, Shape
from flashtune.families.base import Inputs, KernelFamily
from flashtune.families.hopper.space import LOAD_KNOBS
from flashtune.runtime import plans
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions
from flashtune.toolchain.cuda import find_toolchain
from flashtune.toolchain.disasm import disassemble


def tma_loads(config: KernelConfig) -> KernelConfig:
    """``config`` with every operand loaded by TMA (the load knobs at their default): the
    group a sample draws one member of, so the cp.async variants do not multiply it."""
    return dataclasses.replace(config, extras=tuple(
        (name, value) for name, value in config.extras if name not in LOAD_KNOBS))


def hgmma_shapes(cubin: bytes) -> collections.Counter[str] | None:
    """How many HGMMA.64xNx16 (f32 accumulators) instructions of each N the SASS of
    ``cubin`` holds, by N; None when the toolchain has no nvdisasm."""
    if find_toolchain().nvdisasm is None:
        return None
    return collections.Counter(re.findall(r"\bHGMMA\.64x(\d+)x16\.F32(?:\.BF16)?\b",
                                          disassemble(cubin)))


def emulate(family: KernelFamily, problem: Problem, config: KernelConfig, shape: Shape,
            inputs: Inputs, options: LaunchOptions | None = None
            ) -> tuple[dict[str, torch.Tensor], object]:
    """``family``'s kernel of ``config`` run once in the emulator on ``inputs``: its
    NaN-poisoned outputs and the launch's counters (None unless ``options`` asks)."""
    kernel = EmulatorBackend(options=options or LaunchOptions()).load(
        families.render(problem, config))
    outputs = family.empty_outputs(problem, shape, inputs, poison=True)
    plan = family.launch_plan(problem, config, shape, inputs, outputs)
    kernel.launch(plan.grid, plan.args)
    return outputs, getattr(kernel, "last_counters", None)


def forward_ops(op: str = "fwd") -> set[str]:
    """The ops of the families the cached plans of ``op`` (``fwd``, ``bwd``, ...) run."""
    return {p.decision.problem.op for key, p in plans.cached().items() if key[-1] == op}


def param_id(value: object) -> str:
    """A readable test id part: a config's key, a shape's sizes, a type's word."""
    if isinstance(value, KernelConfig):
        return value.key()
    if isinstance(value, Shape):
        return (f"b{value.batch}h{value.heads_q}kv{value.heads_kv}q{value.seqlen_q}"
                f"k{value.seqlen_k}")
    if isinstance(value, (DType, Fp8Type)):
        return str(value.value)
    return str(value)
