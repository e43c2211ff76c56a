"""Progress of a tuning run on the terminal (rich): live per-bucket counts and final tables,
and the live table of a replayed run (``--replay``)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from types import TracebackType

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.spinner import Spinner
from rich.status import Status
from rich.table import Table

from flashtune.db.records import TrialStatus
from flashtune.tuner.measure.evaluate import TrialResult
from flashtune.tuner.options import STATIC_REJECTIONS, BucketSummary
from flashtune.tuner.replay import ReplayObserver, ReplaySummary, TracePoint

_FAILURES = ("invalid", "compile_failed", "runtime_failed", "wrong_result")
#: Columns holding a config key: never wrapped (a key cut in two reads as two configs).
_KEYS = ("config", "default", "winner")


def _columns(table: Table, *names: str) -> None:
    for name in names:
        table.add_column(name, no_wrap=name in _KEYS)


def _failures(statuses: Counter[str]) -> str:
    """Configs that were tried and failed; the statically pruned ones are not failures
    (``_pruned``)."""
    parts = [f"{name} {statuses[name]}" for name in _FAILURES if statuses.get(name)]
    return ", ".join(parts) or "-"


def _pruned(summary: BucketSummary) -> str:
    """Configs never tried: excluded by the static rules, or by --prune-predicted."""
    static = summary.statuses.get(STATIC_REJECTIONS, 0)
    text = str(static)
    if summary.pruned_by_model:
        text += f" + {summary.pruned_by_model} by the cost model"
    return text


def live_table(rows: Sequence[BucketSummary], budget: int | None) -> Table:
    table = Table(title="flashtune tune", expand=False)
    table.add_column("bucket", no_wrap=True)
    _columns(table, "candidates", "pruned", "done", "ok", "failures", "best so far")
    for s in rows:
        ok = s.statuses.get(TrialStatus.OK.value, 0) + s.statuses.get(
            TrialStatus.VERIFIED_UNTIMED.value, 0)
        done = f"{s.measured}/{min(budget, s.candidates) if budget else s.candidates}"
        best = (f"{s.best_tflops:.1f} TFLOP/s ({s.best_config.key()})"
                if s.best_tflops is not None and s.best_config is not None else "-")
        table.add_row(s.bucket.key(), str(s.candidates), _pruned(s), done, str(ok),
                      _failures(s.statuses), best)
    return table


def final_table(rows: Sequence[BucketSummary]) -> Table:
    """Per bucket: the winner, its TFLOP/s, the default's and the speed-up (timed runs), or
    what was verified (dry runs)."""
    if rows and not rows[0].timed:
        table = Table(title="dry run (untimed: compiled and verified only)")
        table.add_column("bucket", no_wrap=True)
        _columns(table, "verified", "pruned", "failures", "default")
        for s in rows:
            table.add_row(s.bucket.key(), str(s.statuses.get("verified_untimed", 0)),
                          _pruned(s), _failures(s.statuses),
                          s.default.key() if s.default else "-")
        return table
    table = Table(title="tuned winners")
    table.add_column("bucket", no_wrap=True)
    _columns(table, "winner", "TFLOP/s", "default", "default TFLOP/s", "speed-up")
    for s in rows:
        table.add_row(
            s.bucket.key(), s.winner.key() if s.winner else "none (nothing timed)",
            f"{s.winner_tflops:.1f}" if s.winner_tflops else "-",
            s.default.key() if s.default else "-",
            f"{s.default_tflops:.1f}" if s.default_tflops else "-",
            f"{s.speedup:.2f}x" if s.speedup else "-")
    return table


#: What a tuning run does between two buckets (before the live table moves again).
PREPARING = ("pruning the search space by the static rules and ranking it by the cost "
             "model")
#: What it does while a bucket's candidates are measured.
MEASURING = {True: "timing candidates on the GPU (NVRTC compiles included)",
             False: "verifying candidates: NVRTC compile, then an emulator build (g++, "
                    "15-30 s per kernel the first time) and run"}
#: At most this many distinct failure reasons are listed per bucket.
MAX_REASONS = 5


class _StatusLine:
    """A spinner, what the run is doing and for how long (re-rendered by the live display)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.since = time.monotonic()
        self._spinner = Spinner("dots")

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        self._spinner.update(text=f"{self.text} ({time.monotonic() - self.since:.0f} s)")
        yield self._spinner


class RichProgress:
    """An Observer (tuner.driver.Observer) that keeps a live table up to date.

    With ``phases``, a status line says what the run is doing while the table cannot move
    (pruning and ranking a bucket's space, measuring its candidates): inside the live
    display when stdout is a terminal, else on stderr when that is one, never in output
    that is not a terminal (the table printed at the end is unchanged). It also collects
    why configs failed, for ``failure_notes``.
    """

    def __init__(self, budget: int | None, console: Console | None = None, *,
                 phases: bool = False, errors: Console | None = None) -> None:
        self.console = console or Console()
        self.budget = budget
        self.rows: list[BucketSummary] = []
        #: bucket key -> (status, first line of the error) -> configs
        self.reasons: dict[str, dict[tuple[str, str], list[str]]] = {}
        self._phases = phases
        self._errors = errors or Console(stderr=True)
        self._line: _StatusLine | None = None
        self._err_status: Status | None = None
        self._live = Live(self._view(), console=self.console, refresh_per_second=4,
                          transient=False)

    def _view(self) -> RenderableType:
        table = live_table(self.rows, self.budget)
        if self._line is None or not self.console.is_terminal:
            return table
        return Group(table, self._line)

    def _say(self, text: str | None) -> None:
        """Show ``text`` as the status line (None: none)."""
        if not self._phases:
            return
        self._line = None if text is None else _StatusLine(text)
        if self.console.is_terminal or not self._errors.is_terminal:
            return
        if text is None:
            if self._err_status is not None:
                self._err_status.stop()
                self._err_status = None
        elif self._err_status is None:
            self._err_status = self._errors.status(text)
            self._err_status.start()
        else:
            self._err_status.update(text)

    def __enter__(self) -> RichProgress:
        self._live.__enter__()
        self._say(f"preparing: {PREPARING}")
        self._refresh()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._say(None)
        self._refresh()
        self._live.__exit__(exc_type, exc, tb)
        if exc_type is not None and not self.console.is_terminal:
            # a log's last table line has no newline yet: what follows (the interrupt's
            # hint, an error) starts on a line of its own
            self.console.line()
        self.console.file.flush()

    def _refresh(self) -> None:
        self._live.update(self._view())

    def bucket_started(self, summary: BucketSummary) -> None:
        self.rows.append(summary)
        self._say(f"{summary.bucket.key()}: {MEASURING[summary.timed]}")
        self._refresh()

    def trial_done(self, summary: BucketSummary, result: TrialResult) -> None:
        if result.status.value in _FAILURES:
            lines = (result.error or "").strip().splitlines()
            reason = lines[0] if lines else "(no message)"
            bucket = self.reasons.setdefault(summary.bucket.key(), {})
            bucket.setdefault((result.status.value, reason), []).append(result.config.key())
        self._refresh()

    def bucket_finished(self, summary: BucketSummary) -> None:
        self._say(f"preparing the next bucket: {PREPARING}")
        self._refresh()

    def failure_notes(self) -> list[str]:
        """One line per bucket and failure reason: why the configs counted under
        "failures" failed (the first line of their error), with the configs."""
        notes = []
        for bucket, reasons in self.reasons.items():
            ordered = sorted(reasons.items(), key=lambda item: (item[0][0], -len(item[1])))
            for (status, reason), configs in ordered[:MAX_REASONS]:
                shown = ", ".join(configs[:3]) + (f" and {len(configs) - 3} more"
                                                  if len(configs) > 3 else "")
                notes.append(f"{bucket}: {status} {len(configs)} ({shown}): {reason}")
            if len(ordered) > MAX_REASONS:
                notes.append(f"{bucket}: {len(ordered) - MAX_REASONS} more reasons: "
                             f"flashtune db show {bucket}")
        return notes


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
        _columns(table, "#", "config", "predicted ms", "predicted TFLOP/s", "bound")
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

    @property
    def summary(self) -> ReplaySummary | None:
        """The run so far (None before it started)."""
        return self._summary

    def evaluated(self, summary: ReplaySummary, point: TracePoint) -> None:
        if self._live is not None:
            self._live.update(replay_table(summary))

    def close(self) -> None:
        if self._live is not None and self._summary is not None:
            self._live.update(replay_table(self._summary))
            self._live.__exit__(None, None, None)
            self._live = None
