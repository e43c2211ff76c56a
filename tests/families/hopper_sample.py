"""Sampling the sm_90a spaces for the emulator tests."""

from __future__ import annotations

import dataclasses

from flashtune.codegen.spec import KernelConfig
from flashtune.families.hopper.space import LOAD_KNOBS


def tma_loads(config: KernelConfig) -> KernelConfig:
    """``config`` with every operand loaded by TMA (the load knobs at their default): the
    group a sample draws one member of, so the cp.async variants do not multiply it."""
    return dataclasses.replace(config, extras=tuple(
        (name, value) for name, value in config.extras if name not in LOAD_KNOBS))
