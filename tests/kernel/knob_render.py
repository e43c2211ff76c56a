"""Render the forward template with its structure knobs (the optional variables of
flash_fwd.cu.jinja: swizzle, qregs, pipeline, minblocks, order, persistent) and run it in
the emulator against the forward family's float64 reference (runtime.launch).

The knobs are not part of the forward family's config space yet, so they are passed to the
template here, beside the family's own parameters; the shared-memory size follows the
layout: rows of the padded head dim plus one 16-byte chunk of padding, or unpadded when
swizzled (knob_smem_bytes).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

from flashtune.codegen.render import environment, included_headers
from flashtune.codegen.spec import KernelConfig, KernelSource, Problem, Shape
from flashtune.families import render
from flashtune.families.fwd import FORWARD, space
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions, Schedule
from flashtune.runtime.launch import prepare

Knobs = Mapping[str, int | str]


def knob_smem_bytes(problem: Problem, config: KernelConfig, knobs: Knobs) -> int:
    """Dynamic shared memory of the kernel with ``knobs``: (block_m + 2 stages x block_n)
    rows of the padded head dim, plus one 16-byte chunk a row unless swizzled."""
    pad = 0 if knobs.get("swizzle", 0) else space.SMEM_ROW_PAD
    row_bytes = (problem.padded_head_dim + pad) * problem.dtype.itemsize
    return row_bytes * (config.block_m + 2 * config.num_stages * config.block_n)


def knob_label(knobs: Knobs) -> str:
    """An identifier-safe label of the knob settings."""
    return "_".join(f"{k}{v}" for k, v in sorted(knobs.items())) or "default"


def render_knobs(problem: Problem, config: KernelConfig, knobs: Knobs) -> KernelSource:
    """The kernel of ``problem`` x ``config`` with the template variables ``knobs``."""
    base = render(problem, config)
    smem = knob_smem_bytes(problem, config, knobs)
    entry = f"{base.entry}__{knob_label(knobs)}"
    body = environment().get_template(FORWARD.template).render(
        entry=entry, smem_bytes=smem, threads=config.threads,
        **FORWARD.template_params(problem, config), **knobs)
    headers = included_headers(body)
    digest = hashlib.sha256("\0".join([body, *headers.values()]).encode()).hexdigest()
    return dataclasses.replace(base, code=body, entry=entry, headers=headers, digest=digest,
                               smem_bytes=smem)


def check_in_emulator(source: KernelSource, shapes: list[Shape], seed: int,
                      schedules: tuple[Schedule, ...] = tuple(Schedule),
                      grid_blocks_per_x: int = 1) -> None:
    """Run ``source`` in the emulator on each shape in each thread order, on fresh inputs
    (seed + index) with NaN-poisoned outputs, and compare with the float64 reference.
    grid_blocks_per_x > 1 launches ceil(query blocks / grid_blocks_per_x) blocks in x (a
    persistent kernel's smaller grid)."""
    for schedule in schedules:
        kernel = EmulatorBackend(options=LaunchOptions(schedule=schedule)).load(source)
        for index, shape in enumerate(shapes):
            launch = prepare(kernel, shape, "cpu", seed=seed + index, poison=True)
            x, y, z = launch.plan.grid
            grid = (-(-x // grid_blocks_per_x), y, z)
            kernel.bind(grid, launch.plan.args)()
            verdict = launch.verdict()
            assert verdict.ok, (f"{source.entry} ({schedule.value}, grid {grid}, seed "
                                f"{seed + index}): {verdict.message}")
