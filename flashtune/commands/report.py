"""``flashtune report``: plots of the tuning results stored in a database.

Reads the database's trials and best entries (what ``flashtune tune`` records, and what an
import or merge brings: a database of imported results has no Optuna study, and its report
shows the same plots), one bucket being a (device, problem, sequence bucket), and writes:

- ``best_so_far.png``: the best TFLOP/s found against the trial number (trials in the order
  they were recorded), one line per bucket;
- ``landscape-<device>_<bucket>.png``: TFLOP/s over B_r x B_c, one panel per (warps,
  stages), one per bucket that has trials; the configs of a cell that differ in further
  knobs are folded into the cell's best; failed configs are marked with their status;
- ``winners.png``: each bucket's best entry and its default config's TFLOP/s.

Where nothing was timed (a dry run verifies but never times) the cost model's predictions,
which every trial stores, are drawn instead, and each such figure says PREDICTED. With
``--format html`` the figures are embedded in one self-contained ``index.html``.
matplotlib is imported only here (the ``plot``/``dev`` extras install it).
"""

from __future__ import annotations

import base64
import functools
import html
import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashtune import families
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import KernelConfig, Problem, ProblemBucket
from flashtune.db.records import BestEntry, TrialRecord, TrialStatus
from flashtune.errors import FlashtuneError, TuningError
from flashtune.tuner.measure.workload import make_workload

FORMATS = ("png", "html")
_SHORT = {"compile_failed": "CF", "runtime_failed": "RF", "wrong_result": "WR",
          "invalid": "IN", "verified_untimed": "VU"}
_LEGEND = ("CF compile failed, RF runtime failed, WR wrong result, IN invalid, "
           "VU verified untimed")
#: Trials whose config passed its checks (a prediction of a failed one is not drawn).
_PASSED = (TrialStatus.OK, TrialStatus.VERIFIED_UNTIMED)
#: Winner and default bars: two colours that differ in hue and lightness.
_WINNER, _DEFAULT = "tab:blue", "tab:orange"


@dataclass(frozen=True)
class BucketData:
    """The trials (oldest first) and best entry of one (device, problem, seqlen bucket)."""

    device: str
    arch: str
    bucket: ProblemBucket
    trials: tuple[TrialRecord, ...]
    best: BestEntry | None

    @property
    def label(self) -> str:
        return f"{self.device}/{self.bucket.key()}"

    @property
    def timed(self) -> bool:
        """Whether any trial of the bucket was timed (else its plots show predictions)."""
        return any(_measured(t) is not None for t in self.trials)

    def value(self, trial: TrialRecord, predicted: bool) -> float | None:
        """A trial's TFLOP/s: measured, or (``predicted``) the cost model's prediction over
        the bucket's default tuning workload."""
        if not predicted:
            return _measured(trial)
        if trial.status not in _PASSED or not trial.predicted_ms or trial.predicted_ms <= 0:
            return None  # a config that failed has no speed, predicted or not
        flops = _workload_flops(self.bucket)
        return None if flops is None else flops / (trial.predicted_ms * 1e-3) / 1e12

    @property
    def default_key(self) -> str | None:
        """The key of the family's default config on the device's arch (None if unknown)."""
        try:
            problem = self.bucket.problem
            return families.of(problem).default_config(problem, get_arch(self.arch)).key()
        except FlashtuneError:
            return None


def _measured(trial: TrialRecord) -> float | None:
    return trial.tflops if trial.status is TrialStatus.OK and trial.tflops else None


@functools.lru_cache(maxsize=256)
def _workload_flops(bucket: ProblemBucket) -> float | None:
    """Geometric mean FLOPs of the shapes ``flashtune tune`` times the bucket on by
    default (a prediction in ms over it is the tuner's TFLOP/s convention)."""
    try:
        workload = make_workload(bucket)
        counts = [families.of(bucket.problem).flops(bucket.problem, s) for s in workload.shapes]
    except FlashtuneError:
        return None
    return math.exp(sum(math.log(c) for c in counts) / len(counts)) if counts else None


def load_buckets(db: str | None, bucket_filter: str | None = None) -> list[BucketData]:
    """Every bucket with trials in ``db`` (read-only), optionally only those whose label
    (``<device>/<bucket key>``) or Optuna study name contains ``bucket_filter``."""
    from flashtune.db.store import TuningStore

    with TuningStore(db, create=False) as store:
        trials = store.trials()
        best = {(e.device, e.problem, e.seqlen): e for e in store.all_best()}
        archs = {d.name: d.arch for d in store.devices()}
    grouped: dict[tuple[str, str, int], list[TrialRecord]] = {}
    for trial in trials:
        grouped.setdefault((trial.device, trial.problem.key, trial.seqlen), []).append(trial)
    out = []
    for (device, problem, seqlen), group in sorted(grouped.items()):
        try:
            bucket = ProblemBucket(Problem.from_key(problem), seqlen)
        except FlashtuneError:
            continue  # a problem this flashtune cannot name (a newer one's): not plotted
        data = BucketData(device, archs.get(device, "sm_90"), bucket,
                          tuple(sorted(group, key=lambda t: (t.created_at, t.uid))),
                          best.get((device, problem, seqlen)))
        if bucket_filter and not (bucket_filter in data.label or any(
                bucket_filter in (t.study or "") for t in group)):
            continue
        out.append(data)
    if not out:
        raise TuningError("no tuning results found" + (f" matching {bucket_filter!r}"
                                                       if bucket_filter else "")
                          + "; run `flashtune tune` or import a bundle (`flashtune db import "
                            "--sample` imports the sample one) first")
    return out


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")[:120]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise TuningError("flashtune report needs matplotlib: pip install 'flashtune[plot]'"
                          ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colours(n: int) -> list[Any]:
    """``n`` distinct colours (tab10, then tab20, then evenly spaced hues)."""
    plt = _pyplot()
    name = "tab10" if n <= 10 else "tab20" if n <= 20 else "hsv"
    cmap = plt.get_cmap(name)
    if name == "hsv":
        return [cmap(i / n) for i in range(n)]
    return [cmap(i) for i in range(n)]


def _predicted(buckets: Sequence[BucketData]) -> bool:
    """Whether the figures of ``buckets`` show predictions: when nothing was timed."""
    return not any(b.timed for b in buckets)


def _names(buckets: Sequence[BucketData]) -> tuple[dict[str, str], str]:
    """Short names of the buckets (their keys when they share one device, said in the
    returned title suffix) for legends and axes."""
    devices = {b.device for b in buckets}
    if len(devices) == 1:
        return {b.label: b.bucket.key() for b in buckets}, f" on {next(iter(devices))}"
    return {b.label: b.label for b in buckets}, ""


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True)
    ax.set_axis_off()


def best_so_far_figure(buckets: Sequence[BucketData]) -> Any:
    plt = _pyplot()
    predicted = _predicted(buckets)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names, where = _names(buckets)
    lines = []
    for data in buckets:
        xs, ys, best = [], [], 0.0
        for i, trial in enumerate(data.trials, start=1):
            best = max(best, data.value(trial, predicted) or 0.0)
            if best:
                xs.append(i)
                ys.append(best)
        if xs:
            lines.append((names[data.label], xs, ys))
    for (label, xs, ys), colour in zip(lines, _colours(len(lines)), strict=True):
        ax.step(xs, ys, where="post", label=label, color=colour, marker=".",
                linestyle="--" if predicted else "-")
    if not lines:
        _empty(ax, "no trial has a time or a prediction")
        return fig
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # trials are counted
    ax.set_xlabel("trial of the bucket (in the order recorded)")
    ax.set_ylabel("best PREDICTED TFLOP/s so far" if predicted else "best TFLOP/s so far")
    ax.set_title(("Best so far, PREDICTED by the cost model (nothing was timed)" if predicted
                  else "Best so far") + where, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def landscape_figure(data: BucketData) -> Any:
    """TFLOP/s over (block_m, block_n), one panel per (num_warps, num_stages)."""
    plt = _pyplot()
    import numpy as np

    predicted = not data.timed
    # (warps, stages) -> (block_m, block_n) -> (best value, a failure status, configs)
    cells: dict[tuple[int, int], dict[tuple[int, int], list[Any]]] = {}
    for trial in data.trials:
        try:
            config = KernelConfig.from_key(trial.config.key)
        except FlashtuneError:
            continue
        cell = cells.setdefault((config.num_warps, config.num_stages), {}).setdefault(
            (config.block_m, config.block_n), [None, trial.status.value, 0])
        value = data.value(trial, predicted)
        if value is not None and (cell[0] is None or value > cell[0]):
            cell[0] = value
        cell[2] += 1
    kind = "PREDICTED TFLOP/s" if predicted else "TFLOP/s"
    if not cells:
        fig, ax = plt.subplots(figsize=(4, 2))
        _empty(ax, f"{data.label}: no trial names a config with a tile")
        return fig
    warps = sorted({w for w, _ in cells})
    stages = sorted({s for _, s in cells})
    ms = sorted({m for p in cells.values() for m, _ in p})
    ns = sorted({n for p in cells.values() for _, n in p})
    values = [c[0] for p in cells.values() for c in p.values() if c[0] is not None]
    vmax = max(values) if values else 1.0
    fig, axes = plt.subplots(len(warps), len(stages),
                             figsize=(0.55 * len(ns) * len(stages) + 2.5,
                                      0.45 * len(ms) * len(warps) + 1.8),
                             squeeze=False, layout="constrained")
    image = None
    for r, w in enumerate(warps):
        for c, s in enumerate(stages):
            ax = axes[r][c]
            grid = np.full((len(ms), len(ns)), np.nan)
            if (w, s) not in cells:
                _empty(ax, f"{w} warps, {s} stages:\nno config tried")
                continue
            for (m, n), (value, status, _) in cells.get((w, s), {}).items():
                i, j = ms.index(m), ns.index(n)
                if value is not None:
                    grid[i, j] = value
                    ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=6)
                else:
                    ax.text(j, i, _SHORT.get(status, "x"), ha="center", va="center",
                            fontsize=6, color="red")
            image = ax.imshow(grid, vmin=0, vmax=vmax, cmap="viridis", aspect="auto")
            ax.set_xticks(range(len(ns)), [str(n) for n in ns], fontsize=6)
            ax.set_yticks(range(len(ms)), [str(m) for m in ms], fontsize=6)
            ax.set_title(f"{w} warps, {s} stages", fontsize=8)
            ax.set_xlabel("B_c (block_n)", fontsize=7)
            ax.set_ylabel("B_r (block_m)", fontsize=7)
    if image is not None:
        fig.colorbar(image, ax=axes, label=kind, shrink=0.8)
    what = "PREDICTED TFLOP/s (cost model; nothing was timed)" if predicted else kind
    fig.suptitle(f"{data.label}: {what}, best of the configs in a cell\n({_LEGEND})",
                 fontsize=8)
    return fig


def _winners(buckets: Sequence[BucketData], predicted: bool
             ) -> list[tuple[str, float, float | None, str]]:
    """(label, winner value, default value or None, winner config key) per bucket: the best
    entry when nothing is predicted, else the best prediction."""
    names, _ = _names(buckets)
    out = []
    for data in buckets:
        default_key = data.default_key
        default = max((v for t in data.trials if t.config.key == default_key
                       for v in [data.value(t, predicted)] if v is not None), default=None)
        if not predicted:
            if data.best is None or data.best.trial.tflops is None:
                continue
            out.append((names[data.label], data.best.trial.tflops, default, data.best.config.key))
            continue
        scored = [(v, t.config.key) for t in data.trials
                  for v in [data.value(t, predicted)] if v is not None]
        if scored:
            value, key = max(scored)
            out.append((names[data.label], value, default, key))
    return out


def winners_figure(buckets: Sequence[BucketData]) -> Any:
    plt = _pyplot()
    predicted = _predicted(buckets)
    rows = _winners(buckets, predicted)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(rows) + 2), 5))
    if not rows:
        _empty(ax, "no best entry: no bucket has a timed result")
        return fig
    xs = list(range(len(rows)))
    ax.bar([x - 0.2 for x in xs], [r[1] for r in rows], width=0.4, color=_WINNER,
           label="PREDICTED best" if predicted else "winner (best entry)")
    defaults = [(x, r[2]) for x, r in zip(xs, rows, strict=True) if r[2] is not None]
    ax.bar([x + 0.2 for x, _ in defaults], [v for _, v in defaults], width=0.4,
           color=_DEFAULT, label="default config" + (" (PREDICTED)" if predicted else ""))
    for x, row in zip(xs, rows, strict=True):
        ax.text(x - 0.2, row[1] / 2, row[3], rotation=90, ha="center", va="center",
                fontsize=6, color="white")
        if row[2] is None:
            ax.text(x + 0.2, 0, "default\nnot tried" if predicted else "default\nnot timed",
                    ha="center", va="bottom", fontsize=6)
    ax.set_xticks(xs, [r[0] for r in rows], rotation=30, ha="right", fontsize=6)
    ax.set_ylabel("PREDICTED TFLOP/s" if predicted else "TFLOP/s")
    ax.set_title(("PREDICTED best per bucket (nothing was timed)" if predicted
                  else "Winners per bucket") + _names(buckets)[1], fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_report(db: str | None, out: Path, fmt: str = "png",
                 study_filter: str | None = None) -> list[Path]:
    """Write the figures (PNG files, or one HTML page) to ``out``; returns the paths."""
    if fmt not in FORMATS:
        raise TuningError(f"report format {fmt!r} is unknown; expected one of {FORMATS}")
    buckets = load_buckets(db, study_filter)
    plt = _pyplot()
    figures = [("best_so_far", "Best so far", best_so_far_figure(buckets))]
    figures += [(f"landscape-{_slug(d.label)}", f"Landscape: {d.label}", landscape_figure(d))
                for d in buckets]
    figures.append(("winners", "Winners per bucket", winners_figure(buckets)))
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    sections = []
    for stem, title, fig in figures:
        if fmt == "png":
            path = out / f"{stem}.png"
            fig.savefig(path, dpi=110, bbox_inches="tight")
            written.append(path)
        else:
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
            data = base64.b64encode(buf.getvalue()).decode()
            sections.append(f"<h2>{html.escape(title)}</h2>\n"
                            f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}">')
        plt.close(fig)
    if fmt == "html":
        path = out / "index.html"
        path.write_text("<!doctype html>\n<meta charset='utf-8'>\n<title>flashtune report"
                        "</title>\n<h1>flashtune tuning report</h1>\n" + "\n".join(sections)
                        + "\n")
        written.append(path)
    return written
