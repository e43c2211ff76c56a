"""``flashtune report``: plots of the tuning studies stored in a database.

Reads Optuna's studies (the tuner stores each trial's config, status and timing as user
attributes, and each bucket's final pick as study attributes) and writes:

- ``best_so_far.png``: the best TFLOP/s found against the trial number, one line per study;
- ``landscape-<study>.png``: TFLOP/s over B_r x B_c, one panel per (warps, stages), failed
  configs marked with their status;
- ``winners.png``: each bucket's winner and default TFLOP/s.

With ``--format html`` the same figures are embedded in one self-contained ``index.html``.
matplotlib is imported only here (the ``plot``/``dev`` extras install it).
"""

from __future__ import annotations

import base64
import html
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from flashtune.db.engine import resolve_url
from flashtune.errors import TuningError
from flashtune.tuner.search.proposers import CONFIG_ATTR, DUPLICATE_ATTR, STATUS_ATTR

FORMATS = ("png", "html")
_SHORT = {"compile_failed": "CF", "runtime_failed": "RF", "wrong_result": "WR",
          "invalid": "IN"}


@dataclass(frozen=True)
class StudyData:
    name: str
    trials: tuple[FrozenTrial, ...]
    attrs: dict[str, Any]

    @property
    def measured(self) -> list[FrozenTrial]:
        """Trials that measured a config (no duplicates, no rejected proposals)."""
        return [t for t in self.trials if CONFIG_ATTR in t.user_attrs
                and DUPLICATE_ATTR not in t.user_attrs
                and t.state in (TrialState.COMPLETE, TrialState.PRUNED)
                and t.user_attrs.get(STATUS_ATTR) != "interrupted"]


def load_studies(db: str | None, study_filter: str | None = None) -> list[StudyData]:
    resolved = resolve_url(db)
    url = resolved.render_as_string(hide_password=False)
    try:
        summaries = optuna.get_all_study_summaries(url, include_best_trial=False)
    except Exception as exc:  # optuna raises several types for a missing/foreign database
        where = resolved.render_as_string(hide_password=True)
        raise TuningError(f"cannot read tuning studies from {where}: {exc}") from exc
    out = []
    for summary in sorted(summaries, key=lambda s: s.study_name):
        if study_filter and study_filter not in summary.study_name:
            continue
        study = optuna.load_study(study_name=summary.study_name, storage=url)
        out.append(StudyData(summary.study_name, tuple(study.get_trials(deepcopy=False)),
                             dict(study.user_attrs)))
    if not out:
        raise TuningError("no tuning study found" + (f" matching {study_filter!r}"
                                                      if study_filter else "")
                          + "; run `flashtune tune` first")
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


def best_so_far_figure(studies: Sequence[StudyData]) -> Any:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for data in studies:
        xs, ys, best = [], [], 0.0
        for i, t in enumerate(data.measured, start=1):
            if t.state is TrialState.COMPLETE and t.value is not None:
                best = max(best, t.value)
            if best:
                xs.append(i)
                ys.append(best)
        if xs:
            ax.step(xs, ys, where="post", label=data.name)
    ax.set_xlabel("measured trial")
    ax.set_ylabel("best TFLOP/s so far")
    ax.set_title("Best so far")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    return fig


def landscape_figure(data: StudyData) -> Any:
    """TFLOP/s over (block_m, block_n), one panel per (num_warps, num_stages)."""
    plt = _pyplot()
    import numpy as np

    cells: dict[tuple[int, int], dict[tuple[int, int], tuple[float | None, str]]] = {}
    for t in data.measured:
        a = t.user_attrs
        if not all(k in a for k in ("block_m", "block_n", "num_warps", "num_stages")):
            continue
        value = t.value if t.state is TrialState.COMPLETE else None
        panel = cells.setdefault((int(a["num_warps"]), int(a["num_stages"])), {})
        panel[(int(a["block_m"]), int(a["block_n"]))] = (value, str(a.get(STATUS_ATTR, "")))
    panels = sorted(cells)
    if not panels:
        fig, ax = plt.subplots(figsize=(4, 2))
        ax.text(0.5, 0.5, "no measured configs", ha="center", va="center")
        ax.set_axis_off()
        return fig
    ms = sorted({m for p in cells.values() for m, _ in p})
    ns = sorted({n for p in cells.values() for _, n in p})
    values = [v for p in cells.values() for v, _ in p.values() if v is not None]
    vmax = max(values) if values else 1.0
    cols = len(sorted({s for _, s in panels}))
    rows = len(sorted({w for w, _ in panels}))
    warps = sorted({w for w, _ in panels})
    stages = sorted({s for _, s in panels})
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False,
                             layout="constrained")
    image = None
    for r, w in enumerate(warps):
        for c, s in enumerate(stages):
            ax = axes[r][c]
            grid = np.full((len(ms), len(ns)), np.nan)
            for (m, n), (v, status) in cells.get((w, s), {}).items():
                i, j = ms.index(m), ns.index(n)
                if v is not None:
                    grid[i, j] = v
                    ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7)
                else:
                    ax.text(j, i, _SHORT.get(status, "x"), ha="center", va="center",
                            fontsize=7, color="red")
            image = ax.imshow(grid, vmin=0, vmax=vmax, cmap="viridis", aspect="auto")
            ax.set_xticks(range(len(ns)), [str(n) for n in ns])
            ax.set_yticks(range(len(ms)), [str(m) for m in ms])
            ax.set_title(f"{w} warps, {s} stages", fontsize=8)
            ax.set_xlabel("B_c (block_n)", fontsize=7)
            ax.set_ylabel("B_r (block_m)", fontsize=7)
    if image is not None:
        fig.colorbar(image, ax=axes, label="TFLOP/s", shrink=0.8)
    fig.suptitle(f"{data.name}\n(CF compile failed, RF runtime failed, WR wrong result, "
                 "IN invalid)", fontsize=8)
    return fig


def winners_figure(studies: Sequence[StudyData]) -> Any:
    plt = _pyplot()
    done = [d for d in studies if "winner_tflops" in d.attrs]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(done) + 2), 4))
    labels = [d.name.split("/")[-2] if d.name.count("/") >= 2 else d.name for d in done]
    xs = range(len(done))
    ax.bar([x - 0.2 for x in xs], [d.attrs["winner_tflops"] for d in done], width=0.4,
           label="winner")
    ax.bar([x + 0.2 for x in xs], [d.attrs.get("default_tflops", 0.0) for d in done],
           width=0.4, label="default config")
    for x, d in zip(xs, done, strict=True):
        ax.text(x - 0.2, d.attrs["winner_tflops"] / 2, str(d.attrs.get("winner", "")),
                rotation=90, ha="center", va="center", fontsize=7, color="white")
    ax.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title("Winners per bucket")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_report(db: str | None, out: Path, fmt: str = "png",
                 study_filter: str | None = None) -> list[Path]:
    """Write the figures (PNG files, or one HTML page) to ``out``; returns the paths."""
    if fmt not in FORMATS:
        raise TuningError(f"report format {fmt!r} is unknown; expected one of {FORMATS}")
    studies = load_studies(db, study_filter)
    plt = _pyplot()
    figures = [("best_so_far", "Best so far", best_so_far_figure(studies))]
    figures += [(f"landscape-{_slug(d.name)}", f"Landscape: {d.name}", landscape_figure(d))
                for d in studies]
    figures.append(("winners", "Winners per bucket", winners_figure(studies)))
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
