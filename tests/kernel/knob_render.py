"""The forward family's structure knobs in tests: settings by name, tiles that cover every
knob value, and a run in the emulator against the family's float64 reference
(runtime.launch: NaN-poisoned outputs, the family's launch plan, so a persistent kernel gets
its smaller grid and walks several query blocks per block).
"""

from __future__ import annotations

from collections.abc import Mapping

from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import KernelConfig, Problem, Shape
from flashtune.families import render
from flashtune.families.fwd import FORWARD, knobs
from flashtune.runtime.backends.emulator import EmulatorBackend, LaunchOptions, Schedule
from flashtune.runtime.launch import prepare

Knobs = Mapping[str, int | str]
ARCHS = tuple(get_arch(name) for name in ("sm_80", "sm_90"))

#: Every knob's declared values; the first is the default (the kernel without the knob).
KNOBS: dict[str, tuple[int | str, ...]] = {
    p.name: tuple(int(v) if isinstance(v, bool) else v for v in p.values)
    for p in knobs.KNOB_PARAMS}

#: Off the tile grid in both lengths, GQA, batch 2; Nq > Nk (causal rows that see no key)
#: and Nq < Nk. With the emulator's assumed SM count a persistent grid is narrower than the
#: query blocks on the first and last shape, so its blocks walk several.
SHAPES = [Shape(2, 2, 1, 150, 200), Shape(1, 3, 1, 77, 300), Shape(1, 2, 2, 300, 77)]


def with_knobs(config: KernelConfig, settings: Knobs) -> KernelConfig:
    """``config`` with ``settings`` as its knobs, defaults left out (the family's config)."""
    return FORWARD.config({**FORWARD.point(config), **settings})


def knob_label(settings: Knobs) -> str:
    """An identifier-safe label of the knob settings."""
    return "_".join(f"{k}{v}" for k, v in sorted(settings.items())) or "default"


def legal(problem: Problem, config: KernelConfig) -> bool:
    """Whether the family's static rules admit ``config`` on sm_80 or sm_90."""
    return any(FORWARD.static_check(problem, config, arch) is None for arch in ARCHS)


def check_in_emulator(problem: Problem, config: KernelConfig, shapes: list[Shape], seed: int,
                      schedules: tuple[Schedule, ...] = tuple(Schedule)) -> None:
    """Run the kernel of ``problem`` x ``config`` in the emulator on each shape in each
    thread order, on fresh inputs (seed + index) with NaN-poisoned outputs, and compare with
    the float64 reference."""
    source = render(problem, config)
    for schedule in schedules:
        kernel = EmulatorBackend(options=LaunchOptions(schedule=schedule)).load(source)
        for index, shape in enumerate(shapes):
            launch = prepare(kernel, shape, "cpu", seed=seed + index, poison=True)
            launch.run()
            verdict = launch.verdict()
            assert verdict.ok, (f"{source.entry} ({schedule.value}, grid {launch.plan.grid}, "
                                f"seed {seed + index}): {verdict.message}")
