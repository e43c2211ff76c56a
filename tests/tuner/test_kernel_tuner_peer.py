"""Kernel Tuner's strategies replayed on a landscape (benchmarks/_kernel_tuner.py): the
conversion to its cache format and a short seeded run on flashtune's clock."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from test_tuner_replay import BENCHMARKS, write_landscape

from flashtune.tuner.landscape import Landscape

pytest.importorskip("kernel_tuner", reason="kernel_tuner is not installed (the optional "
                    "extra search-bench: pip install 'flashtune[search-bench]')")


def _module() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import _kernel_tuner
    finally:
        sys.path.remove(str(BENCHMARKS))
    return _kernel_tuner


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Landscape, list[dict[str, Any]]]:
    path = write_landscape(tmp_path_factory.mktemp("kt") / "bowl_GPUA.json.gz", seed=3)
    with gzip.open(path, "rt") as f:
        raw = json.load(f)["results"]
    return Landscape.load(path), raw


def test_the_cache_holds_every_recorded_config_as_kernel_tuner_reads_it(
        tiny: tuple[Landscape, list[dict[str, Any]]], tmp_path: Path) -> None:
    from kernel_tuner.util import read_cache

    kt = _module()
    landscape, raw = tiny
    data = read_cache(str(kt.write_cache(landscape, tmp_path / "c.json")), open_cache=False)
    cache = data["cache"]
    assert data["tune_params_keys"] == ["x", "y", "z", "fixed"]
    assert len(cache) == len(raw)
    for r in raw:
        c = r["configuration"]
        entry = cache[f"{c['x']},{c['y']},{c['z']},{c['fixed']}"]
        cost_ms = r["times"]["compilation"] + r["times"]["framework"] \
            + sum(r["times"].get("runtimes", []))
        assert entry["compile_time"] == pytest.approx(cost_ms * kt.SCALE)
        if r["invalidity"] == "correct":
            assert entry["time"] == pytest.approx(r["measurements"][0]["value"])
            assert "__error__" not in entry
        else:  # Kernel Tuner marks a failure when it reads the cache back
            assert type(entry["__error__"]).__name__ == {
                "compile": "CompilationFailedConfig", "runtime": "RuntimeFailedConfig"
            }[r["invalidity"]]


@pytest.mark.parametrize("seed", [5])
def test_a_seeded_run_is_replayed_on_the_recorded_clock(
        tiny: tuple[Landscape, list[dict[str, Any]]], tmp_path: Path, seed: int) -> None:
    kt = _module()
    landscape, raw = tiny
    cost = {(r["configuration"]["x"], r["configuration"]["y"], r["configuration"]["z"]):
            (r["times"]["compilation"] + r["times"]["framework"]
             + sum(r["times"].get("runtimes", []))) / 1e3 for r in raw}
    value = {(r["configuration"]["x"], r["configuration"]["y"], r["configuration"]["z"]):
             r["measurements"][0]["value"] for r in raw if r["invalidity"] == "correct"}
    cache = kt.write_cache(landscape, tmp_path / "c.json")
    budget = 0.2 * landscape.brute_force_s
    runs = [kt.run(landscape, cache, "random_sample", seed, budget) for _ in range(2)]
    trace = runs[0].trace
    assert [p.config for p in trace] == [p.config for p in runs[1].trace]  # seeded
    configs = [p.config[:3] for p in trace]
    assert len(set(configs)) == len(configs) and set(configs) <= set(cost)
    clock = 0.0
    best = None
    for point, config in zip(trace, configs, strict=True):
        clock += cost[config]
        if config in value:
            best = value[config] if best is None else min(best, value[config])
        assert point.clock_s == pytest.approx(clock) and point.best == best
    # it ran until the budget was spent (each config costs about 1 s of 88 recorded)
    assert trace[-1].clock_s >= budget - 2.0 and len(trace) < len(cost)
    assert best is not None
    assert runs[0].quality_at(budget + 2.0) == pytest.approx(min(value.values()) / best)
    short = kt.run(landscape, cache, "genetic_algorithm", seed, budget, max_fevals=6)
    assert 1 <= len(short.trace) <= 6
