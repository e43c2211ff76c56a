"""Progress of a tuning run on the terminal (rich): live per-bucket counts and final tables,
and the live table of a replayed run (``--replay``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from types import TracebackType

from rich.console import Console
from rich.live import Live
from rich.table import Table

from flashtune.db.records import TrialStatus
from flashtune.tuner.measure.evaluate import TrialResult
from flashtune.tuner.options import STATIC_REJECTIONS, BucketSummary
from flashtune.tuner.replay import ReplayObserver, ReplaySummary, TracePoint

_FAILURES = ("invalid", "compile_failed", "runtime_failed", "wrong_result")


def _failures(statuses: Counter[str]) -> str:
    parts = [f"{name.replace('invalid (static)', 'static')} {statuses[name]}"
             for name in (*_FAILURES, STATIC_REJECTIONS) if statuses.get(name)]
    return ", ".join(parts) or "-"


def live_table(rows: Sequence[BucketSummary], budget: int | None) -> Table:
    table = Table(title="flashtune tune", expand=False)
    table.add_column("bucket", no_wrap=True)
    for column in ("candidates", "done", "ok", "failures", "best so far"):
        table.add_column(column)
    for s in rows:
        ok = s.statuses.get(TrialStatus.OK.value, 0) + s.statuses.get(
            TrialStatus.VERIFIED_UNTIMED.value, 0)
        done = f"{s.measured}/{min(budget, s.candidates) if budget else s.candidates}"
        best = (f"{s.best_tflops:.1f} TFLOP/s ({s.best_config.key()})"
                if s.best_tflops is not None and s.best_config is not None else "-")
        table.add_row(s.bucket.key(), str(s.candidates), done, str(ok),
                      _failures(s.statuses), best)
    return table


def final_table(rows: Sequence[BucketSummary]) -> Table:
    """Per bucket: the winner, its TFLOP/s, the default's and the speed-up (timed runs), or
    what was verified (dry runs)."""
    if rows and not rows[0].timed:
        table = Table(title="dry run (untimed: compiled and verified only)")
        table.add_column("bucket", no_wrap=True)
        for column in ("verified", "failures", "default"):
            table.add_column(column)
        for s in rows:
            table.add_row(s.bucket.key(), str(s.statuses.get("verified_untimed", 0)),
                          _failures(s.statuses), s.default.key() if s.default else "-")
        return table
    table = Table(title="tuned winners")
    table.add_column("bucket", no_wrap=True)
    for column in ("winner", "TFLOP/s", "default", "default TFLOP/s", "speed-up"):
        table.add_column(column)
    for s in rows:
        table.add_row(
            s.bucket.key(), s.winner.key() if s.winner else "none (nothing timed)",
            f"{s.winner_tflops:.1f}" if s.winner_tflops else "-",
            s.default.key() if s.default else "-",
            f"{s.default_tflops:.1f}" if s.default_tflops else "-",
            f"{s.speedup:.2f}x" if s.speedup else "-")
    return table


class RichProgress:
    """An Observer (api.Observer) that keeps a live table up to date."""

    def __init__(self, budget: int | None, console: Console | None = None) -> None:
        self.console = console or Console()
        self.budget = budget
        self.rows: list[BucketSummary] = []
        self._live = Live(live_table(self.rows, budget), console=self.console,
                          refresh_per_second=4, transient=False)

    def __enter__(self) -> RichProgress:
        self._live.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._refresh()
        self._live.__exit__(exc_type, exc, tb)

    def _refresh(self) -> None:
        self._live.update(live_table(self.rows, self.budget))

    def bucket_started(self, summary: BucketSummary) -> None:
        self.rows.append(summary)
        self._refresh()

    def trial_done(self, summary: BucketSummary, result: TrialResult) -> None:
        self._refresh()

    def bucket_finished(self, summary: BucketSummary) -> None:
        self._refresh()


def predicted_tables(rows: Sequence[BucketSummary]) -> list[Table]:
    """Per bucket with predictions: the configs that passed, ranked by PREDICTED time.

    The title says plainly that these are the cost model's predictions, not measurements.
    """
    tables = []
    for s in rows:
        if not s.predicted or s.cost_model is None:
            continue
        table = Table(title=f"{s.bucket.key()}: PREDICTED ranking ({s.cost_model}; "
                            "not a measurement)", expand=False)
        for column in ("#", "config", "predicted ms", "predicted TFLOP/s", "bound"):
            table.add_column(column)
        ranked = sorted({p.config: p for p in s.predicted}.values(), key=lambda p: p.time_ms)
        for i, p in enumerate(ranked, 1):
            table.add_row(str(i), p.config.key(), f"{p.time_ms:.4g}", f"{p.tflops:.1f}",
                          p.bound)
        tables.append(table)
    return tables


def replay_table(summary: ReplaySummary) -> Table:
    """A replayed run so far: simulated time against the budget, evaluations, failures,
    the best found and how close it is to the landscape's optimum."""
    land = summary.landscape
    table = Table(title=f"replay of {land.path.name} (recorded {land.device} times, "
                        "simulated clock)", expand=False)
    for column in ("sampler", "simulated", "budget", "evaluated", "failed", "best",
                   "of optimum"):
        table.add_column(column)
    budget = "-"
    if summary.budget_s is not None:
        budget = (f"{_duration(summary.budget_s)} "
                  f"({100 * summary.budget_s / land.brute_force_s:.3g}%)")
    evaluations = str(len(summary.trace))
    if summary.trials is not None:
        evaluations += f"/{summary.trials}"
    best = summary.best
    table.add_row(summary.sampler, _duration(summary.clock_s), budget, evaluations,
                  str(summary.failures), "-" if best is None else f"{best:.4g}",
                  "-" if best is None else f"{land.quality(best):.3f}")
    return table


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


class ReplayProgress(ReplayObserver):
    """A ReplayObserver that keeps a live table of a replayed run up to date."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self._live: Live | None = None
        self._summary: ReplaySummary | None = None

    def started(self, summary: ReplaySummary) -> None:
        self._summary = summary
        self._live = Live(replay_table(summary), console=self.console, refresh_per_second=4,
                          transient=False)
        self._live.__enter__()

    def evaluated(self, summary: ReplaySummary, point: TracePoint) -> None:
        if self._live is not None:
            self._live.update(replay_table(summary))

    def close(self) -> None:
        if self._live is not None and self._summary is not None:
            self._live.update(replay_table(self._summary))
            self._live.__exit__(None, None, None)
            self._live = None
