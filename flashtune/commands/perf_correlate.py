"""``flashtune correlate``: Spearman rank correlation between the cost model's PREDICTED
times and the measured ones recorded in a tuning database."""

from __future__ import annotations

import math
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flashtune.commands.options import DbOpt, fail
from flashtune.errors import FlashtuneError


def correlate_command(
    db: DbOpt = None,
    device: Annotated[str | None, typer.Option(
        "--device", help="Only this device's trials.")] = None,
) -> None:
    """Rank correlation (Spearman rho) of predicted vs measured times, per bucket with at
    least 3 measured configs that carry a prediction, and overall."""
    from flashtune.db.store import TuningStore
    from flashtune.perf.model.correlate import MIN_CONFIGS, correlate

    console = Console()
    try:
        with TuningStore(db, create=False) as store:
            report = correlate(store, device)
            where = store.where
    except (FlashtuneError, ValueError) as exc:
        raise fail(exc) from None
    if report.measured == 0:
        console.print(f"no GPU measurements in this database yet ({escape(where)}): run "
                      "'flashtune tune' on a GPU first", highlight=False)
        return
    if not report.buckets:
        console.print(f"{report.measured} measured trial(s), {report.with_prediction} with a "
                      f"prediction: no bucket has {MIN_CONFIGS} or more measured configs with "
                      "a prediction yet", highlight=False)
        return
    table = Table(title="PREDICTED vs measured: Spearman rank correlation", expand=False)
    for column in ("device", "problem", "seqlen", "n", "rho"):
        table.add_column(column)
    for b in report.buckets:
        rho = "n/a (constant)" if math.isnan(b.rho) else f"{b.rho:+.3f}"
        table.add_row(b.device, b.problem, str(b.seqlen), str(b.n), rho)
    console.print(table)
    overall = report.overall
    n = sum(b.n for b in report.buckets)
    text = "n/a" if overall is None else f"{overall:+.3f}"
    console.print(f"overall rho (n-weighted mean over {len(report.buckets)} bucket(s), "
                  f"n={n}): {text}", highlight=False)
