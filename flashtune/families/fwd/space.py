"""The search space of the forward kernel: legal values and static constraints.

``SPACE`` declares the tunables: the four base fields and the structure knobs of
``knobs.py``; ``static_check`` says, for one arch, why a config can never work (or None).
Every rule that removes a config returns a reason a person can read.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.params import Param, ParamSpace, Value
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.errors import InvalidConfig
from flashtune.families.base import resource_reason
from flashtune.families.fwd import knobs
from flashtune.families.fwd.knobs import knob
from flashtune.families.registers import (
    MAX_ACCUMULATOR_REGISTERS,
    accumulator_registers,
    mma_head_dim,
)

BLOCK_M = (64, 128, 192, 256)
#: Every multiple of 16 from 16 to 256 (a P V step takes 16 keys).
BLOCK_N = tuple(range(16, 257, 16))
NUM_WARPS = (2, 4, 8, 16)
NUM_STAGES = (1, 2, 3)

SPACE = ParamSpace((Param("block_m", BLOCK_M), Param("block_n", BLOCK_N),
                    Param("num_warps", NUM_WARPS), Param("num_stages", NUM_STAGES),
                    *knobs.KNOB_PARAMS))

#: Shared-memory rows are padded by this many 16-bit elements (16 bytes), which makes the
#: eight 16-byte row addresses of an ldmatrix phase fall in distinct banks (a swizzled
#: layout needs no padding).
SMEM_ROW_PAD = 8

#: Registers are allocated to a thread in multiples of this many.
_REG_GRANULE = 8


@functools.cache
def legal_configs() -> tuple[KernelConfig, ...]:
    """Every structurally legal config of SPACE in its order (the last parameter varies
    fastest), knobs at their defaults left out. The same for every problem; computed once
    (about 10^5 configs)."""
    base = ParamSpace(SPACE.params[:4])
    knob_space = ParamSpace(knobs.KNOB_PARAMS)
    settings = [tuple(knobs.without_defaults(p).items()) for p in knob_space.points()]
    out: list[KernelConfig] = []
    for point in base.points():
        try:
            tile = KernelConfig.from_dict(point)
        except InvalidConfig:
            continue
        out += [dataclasses.replace(tile, extras=extras) for extras in settings]
    return tuple(out)


def smem_bytes(problem: Problem, config: KernelConfig) -> int:
    """Dynamic shared memory of one block: the Q tile plus num_stages K and V tiles, rows of
    the padded head dim plus one 16-byte chunk unless the layout is swizzled (it must equal
    FwdTraits::kSmemBytes, which the template asserts). With V's head dim split from
    Q/K's, V's rows are of V's padded head dim, and the whole is at least block_m of them
    (O is staged there when V's rows are the wider: WithHeadDimV)."""
    pad = 0 if knob(config, knobs.SWIZZLE) else SMEM_ROW_PAD
    e = problem.dtype.itemsize
    row = (problem.padded_head_dim + pad) * e
    if not problem.split_head_dims:
        return row * (config.block_m + 2 * config.num_stages * config.block_n)
    v_row = (problem.padded_v_head_dim + pad) * e
    layout = (row * (config.block_m + config.num_stages * config.block_n)
              + v_row * config.num_stages * config.block_n)
    return max(layout, v_row * config.block_m)


def held_registers(problem: Problem, config: KernelConfig,
                   values: Mapping[str, Value] | None = None) -> int:
    """32-bit registers per thread held across the main loop: the accumulators, Q's
    fragments with ``qregs`` (rows x head dim / 64) and the next tile's scores with
    ``pipeline`` (rows x block_n / 32). ``values``: the config's knob values, if known."""
    values = values or knobs.knob_values(config)
    rows = config.rows_per_warp
    held = accumulator_registers(problem, config)
    if values[knobs.QREGS]:
        held += rows * mma_head_dim(problem) // 64
    if values[knobs.PIPELINE]:
        held += rows * config.block_n // 32
    return held


def register_cap(config: KernelConfig, arch: ArchSpec, min_blocks: int) -> int:
    """Registers per thread ptxas may use: the arch's limit, or the register file shared by
    ``min_blocks`` (at least one) blocks of the config's threads."""
    share = arch.regs_per_sm // (config.threads * max(min_blocks, 1))
    return min(arch.max_regs_per_thread, share // _REG_GRANULE * _REG_GRANULE)


def register_budget(config: KernelConfig, arch: ArchSpec, min_blocks: int) -> int:
    """Registers per thread the held fragments may take under ``register_cap``: the same
    share of the cap as MAX_ACCUMULATOR_REGISTERS (families.registers) is of 255."""
    return register_cap(config, arch, min_blocks) * MAX_ACCUMULATOR_REGISTERS // 255


def _knob_reason(problem: Problem, config: KernelConfig,
                 values: Mapping[str, Value]) -> str | None:
    """The arch-independent rules of the knobs (``values``: the config's knob values)."""
    why = knobs.value_reason(values)
    if why is not None:
        return why
    if values[knobs.PIPELINE] and config.num_stages < 2:
        return ("pipeline=1 issues Q K^T of the next tile before this one's softmax, so its "
                "K must be copied a stage ahead: it needs num_stages >= 2")
    order = values[knobs.ORDER]
    if values[knobs.PERSISTENT] and order == knobs.ORDER_HEADS_INNER:
        return ("a persistent block walks the query blocks of one head: order "
                f"{knobs.ORDER_HEADS_INNER!r} does not apply (use plain or longest)")
    if order == knobs.ORDER_LONGEST and not problem.causal:
        return ("order='longest' starts the query blocks that see the most keys first; "
                "without a causal mask every block sees every key (use plain)")
    return None


def _min_blocks_reason(problem: Problem, config: KernelConfig, arch: ArchSpec,
                       blocks: int) -> str | None:
    """Why ``minblocks=blocks`` is pointless or unreachable for ``config`` on ``arch``."""
    if not blocks:
        return None
    if register_cap(config, arch, blocks) == register_cap(config, arch, 0):
        return (f"minblocks={blocks} leaves {config.threads} threads "
                f"{register_cap(config, arch, 0)} registers each on {arch.name}, as without "
                "it: the same kernel as minblocks=0")
    smem = smem_bytes(problem, config) + arch.smem_reserved_per_block
    fit = min(arch.smem_per_sm // smem, arch.max_threads_per_sm // config.threads,
              arch.max_blocks_per_sm)
    if blocks > fit:
        return (f"minblocks={blocks} caps registers for {blocks} resident blocks, but "
                f"{arch.name} holds only {fit} of {smem} B shared memory and "
                f"{config.threads} threads (use minblocks <= {fit} or 0)")
    return None


def static_check(problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
    """Why ``config`` cannot run ``problem`` on ``arch``, or None when it may."""
    values = knobs.knob_values(config)
    why = _knob_reason(problem, config, values)
    if why is not None:
        return why
    blocks = int(values[knobs.MINBLOCKS])
    budget = register_budget(config, arch, blocks)
    why = resource_reason(smem_bytes(problem, config), 0, arch, budget)
    if why is not None:
        return why
    held = held_registers(problem, config, values)
    if held > budget:
        cap = register_cap(config, arch, blocks)
        return (f"held fragments need {held} registers per thread (accumulators "
                f"{accumulator_registers(problem, config)}, plus Q with qregs and a second "
                f"S tile with pipeline), over the {budget} that leave room below the cap of "
                f"{cap} ({config.threads} threads)")
    return _min_blocks_reason(problem, config, arch, blocks)
