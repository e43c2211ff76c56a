"""Sampling the sm_90a spaces for the emulator tests, and the wgmma shapes of their SASS."""

from __future__ import annotations

import collections
import dataclasses
import re

from flashtune.codegen.spec import KernelConfig
from flashtune.families.hopper.space import LOAD_KNOBS
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
