"""Shared test configuration: tiers and isolation of on-disk state."""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sampling import SWEEP_VARIABLE

#: One seed per test run for the sampled parts of the suite: fresh each run, printed in the
#: report header, and replayable by setting the variable.
SEED_VARIABLE = "FLASHTUNE_TEST_SEED"
os.environ.setdefault(SEED_VARIABLE, str(int.from_bytes(os.urandom(4), "little")))


def pytest_report_header(config: pytest.Config) -> str:
    seed = os.environ[SEED_VARIABLE]
    return f"test run seed: {SEED_VARIABLE}={seed} (set it to replay the sampled tests)"


def _has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


#: How benchmarks/gpu_check.sh finds the files that hold GPU tests (it collects only those).
GPU_MARK_TEXT = "pytest.mark.gpu"


def _check_gpu_marks_are_written(items: list[pytest.Item]) -> None:
    """Fail the collection where a gpu-marked test's file does not write GPU_MARK_TEXT (a
    mark applied another way): the GPU check would never run that test."""
    files = {item.path for item in items if item.get_closest_marker("gpu") is not None}
    hidden = sorted(str(f) for f in files if GPU_MARK_TEXT not in f.read_text())
    if hidden:
        raise pytest.UsageError(f"{hidden} hold gpu-marked tests without the text "
                                f"{GPU_MARK_TEXT!r}; benchmarks/gpu_check.sh finds GPU tests "
                                "by it: write the mark as pytest.mark.gpu in the file")


#: Opt-in markers: their tests run only when -m names them (``sweep``: the full matrices;
#: ``slow``: whole checks over 10 s of a core each, sampled or left out of the default run,
#: run by .ci/run after it).
OPT_IN_MARKERS = ("sweep", "slow")


def _named(config: pytest.Config, marker: str) -> bool:
    return marker in (config.getoption("markexpr", "") or "")


def _sweep_selected(config: pytest.Config) -> bool:
    """Whether this run may select sweep tests: the full config sweep is opt-in, it runs
    only when -m names it."""
    return _named(config, "sweep")


def pytest_configure(config: pytest.Config) -> None:
    # Read by tests/sampling.when_swept as test modules are imported, in every worker.
    os.environ[SWEEP_VARIABLE] = "1" if _sweep_selected(config) else "0"


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object
                              ) -> list[pytest.Item] | None:
    """A sweep-marked test function or class makes no items in a run that does not select
    sweep tests. They would be deselected anyway, and making their grids' items (about
    27,000) cost about 10 s of each worker's collection. Cases marked sweep one by one
    (``tests/sampling.seeded_part``) are deselected below."""
    if _sweep_selected(collector.config) or not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return None
    marks = getattr(obj, "pytestmark", [])
    if any(mark.name == "sweep" for mark in (marks if isinstance(marks, list) else [marks])):
        return []
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for marker in OPT_IN_MARKERS:
        if not _named(config, marker):
            opted = [item for item in items if marker in item.keywords]
            if opted:
                config.hook.pytest_deselected(items=opted)
                items[:] = [item for item in items if marker not in item.keywords]
    _check_gpu_marks_are_written(items)
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_db(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
                 ) -> Iterator[None]:
    """Never touch the user's tuning database from tests."""
    if "FLASHTUNE_DB" not in os.environ:
        db = Path(tmp_path_factory.mktemp("db")) / "tuning.db"
        monkeypatch.setenv("FLASHTUNE_DB", f"sqlite:///{db}")
    yield


@pytest.fixture(autouse=True)
def _forget_traced_features() -> Iterator[None]:
    """A traced modification registers a feature for the process: forget the ones a test
    registered, so no later test sees them among the features (whatever the order)."""
    from flashtune.codegen.features import registered, unregister_feature

    before = {f.name for f in registered()}
    yield
    for feature in registered():
        if feature.name not in before:
            unregister_feature(feature.name)


@pytest.fixture(scope="session", autouse=True)
def _session_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One kernel cache per test run (shared by tests, never the user's). Under xdist the
    workers share it too (their base temp dirs have one parent): a kernel or emulator build
    one worker made is not made again by the other (the cache's writes are atomic and
    locked)."""
    if "FLASHTUNE_CACHE_DIR" not in os.environ:
        base = tmp_path_factory.getbasetemp()
        cache = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "kernel-cache"
        cache.mkdir(exist_ok=True)
        os.environ["FLASHTUNE_CACHE_DIR"] = str(cache)
    yield
