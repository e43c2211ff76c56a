"""benchmarks/host.py: rows, failure isolation, output; the measurements themselves."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import host
import pytest
from _common import Stats

T = TypeVar("T")


def test_row_validation() -> None:
    with pytest.raises(ValueError, match="required exactly when status is ok"):
        host.HostRow("x", "ok")
    with pytest.raises(ValueError, match="required exactly when status is ok"):
        host.HostRow("x", "error", 1.0, 3)
    with pytest.raises(ValueError, match="status"):
        host.HostRow("x", "fine")
    with pytest.raises(ValueError, match="must be > 0"):
        host.HostRow("x", "ok", 0.0, 1)
    with pytest.raises(ValueError, match="repeats"):
        host.Settings(repeats=0, short=True)


def test_a_failing_row_does_not_stop_the_others(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    def broken(settings: host.Settings) -> list[host.HostRow]:
        raise RuntimeError("compiler exploded\nsecond line")

    def missing(settings: host.Settings) -> list[host.HostRow]:
        raise ImportError("benchmarks/compile_time.py has no function measure()")

    def fine(settings: host.Settings) -> list[host.HostRow]:
        return [host.HostRow.of("fine", Stats.of([2.0, 1.0, 3.0][: settings.repeats]))]

    monkeypatch.setattr(host, "ROWS", {"broken": broken, "missing": missing, "fine": fine})
    out = tmp_path / "h.json"
    assert host.main(["--repeats", "3", "--json", str(out)]) == 1  # an error row fails
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["broken"]["status"] == "error"
    assert rows["broken"]["note"] == "RuntimeError: compiler exploded"
    assert rows["missing"]["status"] == "unavailable"
    assert rows["fine"]["median_s"] == 2.0 and rows["fine"]["repeats"] == 3
    assert host.main(["--rows", "fine,missing"]) == 0  # unavailable is not an error...
    assert host.main(["--rows", "fine,missing", "--strict"]) == 1  # ...unless --strict


def test_bad_arguments_exit_2() -> None:
    for argv in (["--rows", "nope"], ["--repeats", "0"]):
        with pytest.raises(SystemExit) as exc:
            host.parse_args(argv)
        assert exc.value.code == 2


def test_dispatch_rows_measure_the_warm_call() -> None:
    rows = host.dispatch_rows(host.Settings(repeats=2, short=True))
    assert len(rows) >= 2 and all(r.status == "ok" and r.repeats == 2 for r in rows)
    whole, parts = rows[0], rows[1:]
    assert "flashtune.attention" in whole.name and whole.rate.endswith("calls/s")
    # The warm call does every part (validation, lookup, ...) and more.
    assert {"validation", "plan lookup (dispatch)", "argument packing"} <= {
        r.name.strip() for r in parts}
    # Timings are reported, not compared: one stall on a shared machine reorders them.
    assert all(r.median_s is not None and r.median_s > 0 for r in rows)
    assert whole.median_s is not None
    assert whole.rate == f"{1 / whole.median_s:,.0f} calls/s"


def test_compile_rows_measure_a_compile_a_disk_load_and_a_memo_hit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row does what its name says, counted rather than timed (one stall on a shared
    machine reorders timings). Regression: with the kernel already in this process's memo,
    the warm cache stayed empty and the first "cached load" was a cold compile."""
    from flashtune.toolchain import compiler
    from flashtune.toolchain.cache import ArtifactCache

    counts = {"nvrtc": 0, "load": 0}

    def counted(name: str, fn: Callable[..., T]) -> Callable[..., T]:
        def wrapper(*args: object, **kwargs: object) -> T:
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(compiler, "_run_nvrtc", counted("nvrtc", compiler._run_nvrtc))
    monkeypatch.setattr(ArtifactCache, "load_bytes",
                        counted("load", ArtifactCache.load_bytes))
    repeats = 2
    rows = host.compile_rows(host.Settings(repeats=repeats, short=True))
    assert [r.status for r in rows] == ["ok"] * 3
    assert all(r.median_s is not None and r.median_s > 0 for r in rows)
    # The warm entry and each cold repeat compile (a miss, then the read-back); each cached
    # repeat is one disk read; the memo hits touch neither.
    assert counts == {"nvrtc": 1 + repeats, "load": 2 * (1 + repeats) + repeats}
    assert [r.repeats for r in rows] == [repeats, repeats, 100]


@pytest.mark.emulator
def test_emulator_row_reports_throughput() -> None:
    (row,) = host.emulator_rows(host.Settings(repeats=2, short=True))
    assert row.status == "ok" and row.repeats == 2 and row.median_s is not None
    tokens_per_s = float(row.rate.split()[0].replace(",", ""))
    assert tokens_per_s == pytest.approx(host.EMU_SEQLEN / row.median_s, abs=0.51)
    assert "build excluded" in row.note
