"""benchmarks/host.py: rows, failure isolation, output; the measurements themselves."""

from __future__ import annotations

import json
from pathlib import Path

import host
import pytest
from _common import Stats


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
    lookup = next(r for r in parts if "lookup" in r.name)
    assert whole.median_s is not None and lookup.median_s is not None
    assert whole.median_s > lookup.median_s > 0


def test_compile_rows_cold_is_slower_than_cached() -> None:
    rows = host.compile_rows(host.Settings(repeats=1, short=True))
    cold, cached, memo = (r.median_s for r in rows)
    assert all(r.status == "ok" for r in rows)
    assert cold is not None and cached is not None and memo is not None
    assert cold > cached > memo > 0


@pytest.mark.emulator
def test_emulator_row_reports_throughput() -> None:
    (row,) = host.emulator_rows(host.Settings(repeats=2, short=True))
    assert row.status == "ok" and row.repeats == 2 and row.median_s is not None
    tokens_per_s = float(row.rate.split()[0].replace(",", ""))
    assert tokens_per_s == pytest.approx(host.EMU_SEQLEN / row.median_s, abs=0.51)
    assert "build excluded" in row.note
