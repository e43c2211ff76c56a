"""tests/conftest.py's collection rules: a gpu-marked test whose file does not write the
mark fails the collection; a sweep-marked test makes no items unless the run selects sweep
tests, and sweep or slow tests are deselected unless -m names them. And the default run's
xdist groups reach pytest-xdist's scheduler."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent


def _root_conftest() -> Any:
    """tests/conftest.py as a module of its own (several conftest modules share the name)."""
    spec = importlib.util.spec_from_file_location("root_conftest", TESTS / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class _Item:
    """What the gpu-mark check reads of a collected test: its file and its gpu mark."""

    path: Path
    gpu: bool

    def get_closest_marker(self, name: str) -> object | None:
        return object() if name == "gpu" and self.gpu else None


def test_gpu_tests_whose_file_does_not_write_the_mark_fail_the_collection(
        tmp_path: Path) -> None:
    """gpu_check.sh collects only the files that write the mark; a gpu-marked test in a file
    that applies it another way would never run there, so the collection fails naming it."""
    conftest = _root_conftest()
    written, hidden = tmp_path / "test_written.py", tmp_path / "test_hidden.py"
    written.write_text(f"@{conftest.GPU_MARK_TEXT}\ndef test_a(): pass\n")
    hidden.write_text('MARK = getattr(pytest.mark, "g" + "pu")\n')
    cpu_only = tmp_path / "test_cpu.py"
    cpu_only.write_text("def test_c(): pass\n")
    conftest._check_gpu_marks_are_written([_Item(written, True), _Item(cpu_only, False)])
    with pytest.raises(pytest.UsageError, match=r"test_hidden\.py'\] hold gpu-marked tests "
                                                r"without the text 'pytest\.mark\.gpu'"):
        conftest._check_gpu_marks_are_written([_Item(written, True), _Item(hidden, True)])


def _collector(markexpr: str) -> Any:
    """What the sweep hook reads of a collector: the run's -m expression."""
    return SimpleNamespace(config=SimpleNamespace(getoption=lambda name, default=None:
                                                  markexpr if name == "markexpr" else default))


@pytest.mark.sweep
def _swept_function() -> None:
    pass


@pytest.mark.sweep
class _SweptClass:
    pass


@pytest.mark.emulator
def _other_function() -> None:
    pass


def test_sweep_tests_make_no_items_unless_the_run_selects_them() -> None:
    hook = _root_conftest().pytest_pycollect_makeitem
    for markexpr in ("", "emulator", "not gpu"):
        collector = _collector(markexpr)
        for obj in (_swept_function, _SweptClass):
            assert hook(collector=collector, name="test_x", obj=obj) == [], (markexpr, obj)
        assert hook(collector=collector, name="test_x", obj=_other_function) is None
        assert hook(collector=collector, name="x", obj=42) is None  # not a test object
    for markexpr in ("sweep", "sweep and emulator", "not sweep"):
        for obj in (_swept_function, _SweptClass, _other_function):
            assert hook(collector=_collector(markexpr), name="test_x", obj=obj) is None


@pytest.mark.xdist_group("probe")
def test_xdist_groups_reach_the_scheduler(request: pytest.FixtureRequest) -> None:
    """Several tests share one worker through xdist_group (`--dist loadgroup`, the default
    run's) so that an expensive build is made once. pytest-xdist sends a group's tests to
    one worker by a suffix on their node ids; on pytest 9.2 the suffix no longer takes and
    the groups are silently spread (pytest-dev/pytest-xdist#1386), hence the dev extra's
    pytest<9.2. This fails where that happens again."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not an xdist worker of a --dist loadgroup run")
    assert request.node.nodeid.endswith("@probe"), (
        f"{request.node.nodeid}: xdist_group did not reach pytest-xdist's scheduler on "
        f"pytest {pytest.__version__}; install a pytest it supports (pytest<9.2)")


@dataclass
class _Marked:
    """What the opt-in rule reads of a collected test: its markers' names."""

    keywords: set[str]
    path: Path = TESTS / "test_conftest.py"

    def get_closest_marker(self, name: str) -> object | None:
        return None  # no gpu mark: the gpu checks leave these items alone


def test_opt_in_tests_are_deselected_unless_the_run_names_their_marker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``sweep`` and ``slow`` tests run only when -m names them; the rest always."""
    conftest = _root_conftest()
    monkeypatch.setattr(conftest, "_has_gpu", lambda: True)  # no gpu skips to add
    for markexpr, kept in (("", {"plain"}), ("slow", {"plain", "slow"}),
                           ("sweep", {"plain", "sweep"}),
                           ("slow or sweep", {"plain", "slow", "sweep"})):
        items = [_Marked({"plain"}), _Marked({"slow"}), _Marked({"sweep"})]
        deselected: list[_Marked] = []
        config = _collector(markexpr).config
        config.hook = SimpleNamespace(pytest_deselected=lambda items, out=deselected:
                                      out.extend(items))
        conftest.pytest_collection_modifyitems(config, items)
        assert {next(iter(i.keywords)) for i in items} == kept, markexpr
        assert len(items) + len(deselected) == 3, markexpr
