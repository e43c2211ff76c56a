"""The one factory of measurers (the tuner's measurers), by name.

``make_measurer(name, ...)`` is how ``flashtune tune``, ``flashtune db verify``, the tuner's
``tune()`` and its worker processes get a measurer:

- ``cuda`` (also ``gpu``): a CUDA device (``device_index``, default the current one):
  compile, verify and time;
- ``dry-run`` (also ``emulator``): NVRTC for ``arch`` plus verification in the CPU
  emulator, never timed.

A measurer defined outside flashtune (a test's synthetic device) is named by its factory,
``"module:function"``, called with ``options``. The replay of a recorded landscape measures
through ``measure.recorded.RecordedMeasurer`` instead: it answers a search's points, not
kernel configs, so it is not a measurer of this interface.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from flashtune.codegen.arch import get_arch
from flashtune.errors import TuningError
from flashtune.tuner.measure.base import Measurer


def _cuda(arch: str, device_index: int | None) -> Measurer:
    from flashtune.tuner.measure.cuda import CudaMeasurer  # imports torch: only when asked

    return CudaMeasurer(device_index)


def _dry_run(arch: str, device_index: int | None) -> Measurer:
    from flashtune.tuner.measure.dry import DryRunMeasurer

    return DryRunMeasurer(get_arch(arch).name)


#: Every measurer flashtune ships, by name: (arch, device_index) -> measurer.
MEASURERS: Mapping[str, Callable[[str, int | None], Measurer]] = {
    "cuda": _cuda,
    "dry-run": _dry_run,
}
#: Other names users type for them (``flashtune db verify --backend gpu|emulator``).
ALIASES: Mapping[str, str] = {"gpu": "cuda", "emulator": "dry-run"}
#: The default arch of a dry run.
DEFAULT_DRY_RUN_ARCH = "sm_90"


def measurer_names() -> tuple[str, ...]:
    """Every name ``make_measurer`` knows, aliases included."""
    return (*MEASURERS, *ALIASES)


def make_measurer(name: str, *, arch: str = DEFAULT_DRY_RUN_ARCH,
                  device_index: int | None = None,
                  options: Mapping[str, Any] | None = None) -> Measurer:
    """The measurer ``name`` (the module docstring). ``arch`` is a dry run's target,
    ``device_index`` the CUDA device; ``options`` are the keyword arguments of a
    ``"module:function"`` factory. TuningError for an unknown name, listing the known
    ones."""
    canonical = ALIASES.get(name, name)
    if canonical in MEASURERS:
        if options:
            raise TuningError(f"measurer {name!r} takes no options, got {sorted(options)}")
        return MEASURERS[canonical](arch, device_index)
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise TuningError(f"unknown measurer {name!r}; expected one of "
                          f"{', '.join(measurer_names())}, or 'module:function' for a "
                          "measurer defined elsewhere")
    try:
        factory: Callable[..., Measurer] = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise TuningError(f"measurer {name!r}: cannot import {attr} from {module_name} "
                          f"({exc}); expected one of {', '.join(measurer_names())}, or "
                          "'module:function' naming a factory") from exc
    return factory(**dict(options or {}))
