"""Kernel Tuner's search strategies replayed on a recorded landscape (optional peer).

Kernel Tuner (``pip install 'flashtune[search-bench]'``, which pins ``kernel_tuner==1.5.0``)
has a simulation mode: a strategy runs against a cache file of a brute-forced space instead
of a GPU. ``write_cache`` converts a landscape (T4) into that cache: each recorded
configuration under the key of its comma-joined values, with its objective as ``time``, or
``CompilationFailedConfig`` / ``RuntimeFailedConfig`` for a failure. The unrecorded
combinations of the parameters are excluded by a restriction, so the strategy's space is
exactly the recorded one, as in flashtune's replay.

Budget: Kernel Tuner's ``time_limit`` adds its own wall-clock time to the simulated time, so
a slow strategy would get less simulated budget than a fast one. The cache therefore stores
each configuration's cost scaled by ``SCALE`` (its wall time then weighs nothing against
the simulated clock), and ``run`` replays the order of the strategy's evaluations on
flashtune's clock: each distinct configuration costs its recorded seconds (compile +
framework + runs), a repeat costs nothing; the curve is read from that trace with the same
``quality_at`` as every other strategy. Seeds: Python's and NumPy's global generators,
which Kernel Tuner's strategies draw from, are seeded before each run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import random
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flashtune.db.records import TrialStatus
from flashtune.tuner.landscape import Landscape
from flashtune.tuner.measure.recorded import Config
from flashtune.tuner.replay import ReplaySummary, TracePoint

#: Kernel Tuner's strategies compared (its names); ``bayes_opt`` is its Bayesian optimisation.
STRATEGIES = ("genetic_algorithm", "simulated_annealing", "dual_annealing", "pso",
              "random_sample", "bayes_opt")
#: The prefix that marks a Kernel Tuner strategy in the benchmark's ``--strategies``.
PREFIX = "kt-"
#: Simulated milliseconds in the cache per recorded millisecond (see the module docstring).
SCALE = 1000.0
#: Wall seconds a run may take on top of its simulated budget before Kernel Tuner stops it.
WALL_SLACK_S = 3600.0
INSTALL_HINT = ("Kernel Tuner's strategies need kernel_tuner: pip install "
                "'flashtune[search-bench]' (or leave the kt-* strategies out of --strategies)")

_CACHES: dict[Path, Path] = {}
_FAILED = {TrialStatus.COMPILE_FAILED: "CompilationFailedConfig"}


def available() -> bool:
    """Whether kernel_tuner can be imported."""
    return importlib.util.find_spec("kernel_tuner") is not None


def _key(values: Sequence[object]) -> str:
    return ",".join(str(v) for v in values)


def write_cache(landscape: Landscape, path: Path) -> Path:
    """Write ``landscape`` as a Kernel Tuner cache file (module docstring) to ``path``."""
    names = landscape.space.names
    entries: dict[str, dict[str, Any]] = {}
    for config, record in landscape.records.items():
        entry: dict[str, Any] = dict(zip(names, config, strict=True))
        if record.objective is not None:
            entry["time"] = record.objective if landscape.minimize else -record.objective
        else:
            entry["time"] = _FAILED.get(record.status, "RuntimeFailedConfig")
        entry.update(compile_time=record.seconds * 1e3 * SCALE, verification_time=0.0,
                     benchmark_time=0.0, times=[], strategy_time=0.0, framework_time=0.0,
                     timestamp="")
        entries[_key(config)] = entry
    data = {"device_name": landscape.device, "kernel_name": landscape.kernel,
            "problem_size": [1], "tune_params_keys": list(names),
            "tune_params": {p.name: list(p.values) for p in landscape.space.params.params},
            "objective": "time", "cache": entries}
    path.write_text(json.dumps(data))
    return path


def cache_for(landscape: Landscape) -> Path:
    """The cache of ``landscape``, written once per process into a private folder."""
    if landscape.path not in _CACHES:
        folder = Path(tempfile.mkdtemp(prefix="flashtune-kt-"))
        _CACHES[landscape.path] = write_cache(landscape, folder / f"{landscape.kernel}.json")
    return _CACHES[landscape.path]


def run(landscape: Landscape, cache: Path, strategy: str, seed: int, budget_s: float,
        max_fevals: int | None = None) -> ReplaySummary:
    """One seeded run of Kernel Tuner's ``strategy`` on ``landscape`` (its cache written by
    ``write_cache``) up to ``budget_s`` simulated seconds (or ``max_fevals`` distinct
    configurations), as a replay trace on flashtune's clock."""
    from kernel_tuner import tune_kernel

    names = landscape.space.names
    recorded = {_key(c) for c in landscape.records}
    tune_params = {p.name: list(p.values) for p in landscape.space.params.params}
    # bayes_opt stops at 100 evaluations unless told otherwise: the budget is the limit
    options: dict[str, Any] = {"time_limit": budget_s * SCALE + WALL_SLACK_S,
                               "max_fevals": max_fevals or len(landscape.records)}

    def in_record(point: dict[str, Any]) -> bool:  # named: a lambda's source gets parsed
        return _key([point[n] for n in names]) in recorded

    random.seed(seed)
    np.random.seed(seed)
    logging.getLogger("kernel_tuner").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results, _ = tune_kernel(
            landscape.kernel, "", (1,), [], tune_params, lang="C", cache=str(cache),
            simulation_mode=True, strategy=strategy, strategy_options=options,
            restrictions=[in_record],
            quiet=True, verbose=False)
    summary = ReplaySummary(landscape, f"{PREFIX}{strategy}", budget_s, None)
    seen: set[Config] = set()
    clock = 0.0
    best: float | None = None
    for result in results:
        config = tuple(result[n] for n in names)
        record = landscape.records.get(config)
        if record is None or config in seen:  # restricted, or a repeat: costs nothing
            continue
        seen.add(config)
        clock += record.seconds
        if record.objective is not None and (
                best is None or (record.objective < best) == landscape.minimize):
            best = record.objective
        summary.trace.append(TracePoint(clock, config, record.status, record.objective, best))
    return summary
