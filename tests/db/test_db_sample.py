"""The sample bundle shipped with flashtune (``db import --sample``): what importing it
gives, that the runtime serves it only when imported as trusted, and that the report of an
imported database draws its data (tests that fail on an empty plot)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.db.bundle import read_bundle
from flashtune.db.records import TrialStatus
from flashtune.db.samples import SAMPLE_BUNDLE, SAMPLE_DEVICE, SAMPLE_SOURCE
from flashtune.db.store import TuningStore
from flashtune.runtime.installed import installed_digest, serving_state

runner = CliRunner()


def _import(db: str, *extra: str) -> str:
    result = runner.invoke(app, ["db", "import", "--db", db, "--sample", *extra])
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def _explain(db: str, *where: str, causal: bool = False) -> str:
    result = runner.invoke(app, ["explain", "--db", db, "--head-dim", "128", "--seqlen",
                                 "4096", "--dtype", "fp16",
                                 "--causal" if causal else "--no-causal", *where])
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def test_the_sample_is_package_data_and_says_what_it_is() -> None:
    bundle = read_bundle(SAMPLE_BUNDLE)
    assert [d.name for d in bundle.devices] == [SAMPLE_DEVICE]
    assert "sample" in SAMPLE_DEVICE and {t.host for t in bundle.trials} == {"flashtune-sample"}
    assert all(t.status is TrialStatus.OK and t.tflops and t.median_ms for t in bundle.trials)
    # one best per bucket (two problems x three sequence buckets), the bucket's fastest
    assert len(bundle.best) == 6
    for uid in bundle.best:
        best = next(t for t in bundle.trials if t.uid == uid)
        same = [t for t in bundle.trials
                if (t.problem, t.seqlen) == (best.problem, best.seqlen)]
        assert len(same) >= 10 and best.median_ms == min(t.median_ms or 0 for t in same)
    # the published FA2 H100 figures the bests run at (docs/sample_bundle.py)
    published = {("fwd_d128_fp16_full", 4096): 368.0, ("fwd_d128_fp16_causal", 16384): 335.0}
    for (problem, seqlen), tflops in published.items():
        [best] = [t for t in bundle.trials if t.uid in bundle.best
                  and (t.problem.key, t.seqlen) == (problem, seqlen)]
        assert best.tflops == pytest.approx(tflops)
    assert "not measured" in SAMPLE_SOURCE


def test_importing_the_sample_gives_current_best_entries_marked_as_a_sample(
        tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'tuning.db'}"
    text = _import(db)
    assert "trials │ 72" in text or "trials 72" in text.replace("│", "")
    assert "derived from published H100 figures, not measured" in text
    with TuningStore(db, create=False, installed=installed_digest) as store:
        best = store.all_best()
    assert len(best) == 6 and {e.device for e in best} == {SAMPLE_DEVICE}
    # served kernel sources: the trials carry the installed templates' digests (a template
    # change makes them stale: rerun docs/sample_bundle.py)
    assert {serving_state(e) for e in best} == {"current"}
    assert all(e.provenance is not None and e.provenance.source == SAMPLE_SOURCE
               and not e.provenance.trusted for e in best)
    # neither a bundle file and --sample, nor neither of them
    both = runner.invoke(app, ["db", "import", "--db", db, "--sample", str(SAMPLE_BUNDLE)])
    neither = runner.invoke(app, ["db", "import", "--db", db])
    for result in (both, neither):
        assert result.exit_code != 0 and "--sample" in " ".join(result.output.split())


def test_the_runtime_serves_the_sample_only_when_imported_as_trusted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the sample holds the mma.sync forward's results: on a named cc 9.0 GPU that is what
    # serves with the sm_90a kernels off
    monkeypatch.setenv("FLASHTUNE_ARCH_SPECIFIC", "0")
    untrusted, trusted = (f"sqlite:///{tmp_path / name}" for name in ("u.db", "t.db"))
    _import(untrusted)
    _import(trusted, "--trust")
    for where in (["--arch", "sm_90"], ["--device", "NVIDIA H100 80GB HBM3", "--arch",
                                         "sm_90"]):
        refused = _explain(untrusted, *where)
        assert "tier: default" in refused and "sample" not in refused
        served = _explain(trusted, *where)
        assert "tier: same_arch" in served and "m256_n64_w8_s2" in served
        assert "derived from published H100 figures, not measured" in served
    # another arch is never served another arch's results, trusted or not
    assert "tier: default" in _explain(trusted, "--arch", "sm_80")
    # the sample's own name finds its own results (nothing but explain can ask for it)
    assert "tier: exact" in _explain(untrusted, "--device", SAMPLE_DEVICE, causal=True)


def _coloured_pixels(png: Path) -> int:
    """Pixels of a PNG that are clearly coloured (not white, black or grey: not the
    background, text, axes or grid), i.e. drawn data."""
    import matplotlib.image

    rgb = matplotlib.image.imread(png)[..., :3]
    return int(((rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.25).sum())


def _data_artists(fig: object) -> int:
    """Lines with points, bars with a height and images with a finite cell, over the
    figure's axes (what an empty plot has none of)."""
    import numpy as np

    count = 0
    for ax in fig.axes:  # type: ignore[attr-defined]
        count += sum(1 for line in ax.get_lines() if len(line.get_xdata()) > 0)
        count += sum(1 for patch in ax.patches if getattr(patch, "get_height", lambda: 0)() > 0)
        count += sum(1 for image in ax.get_images()
                     if np.isfinite(np.asarray(image.get_array(), dtype=float)).any())
    return count


def test_report_of_the_imported_sample_draws_every_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import numpy as np

    from flashtune.commands.report import (
        best_so_far_figure,
        landscape_figure,
        load_buckets,
        winners_figure,
        write_report,
    )

    db = f"sqlite:///{tmp_path / 'tuning.db'}"
    _import(db)
    buckets = load_buckets(db)
    assert len(buckets) == 6 and all(b.best is not None and b.timed for b in buckets)
    best = best_so_far_figure(buckets)
    assert _data_artists(best) == 6  # one line per bucket
    colours = {tuple(line.get_color()) for line in best.axes[0].get_lines()}
    assert len(colours) == 6  # distinct colours for distinct legend entries
    winners = winners_figure(buckets)
    assert _data_artists(winners) == 12  # a winner and a default bar per bucket
    handles, labels = winners.axes[0].get_legend_handles_labels()
    assert labels == ["winner (best entry)", "default config"]
    assert handles[0].patches[0].get_facecolor() != handles[1].patches[0].get_facecolor()
    for data in buckets:
        figure = landscape_figure(data)
        cells = sum(int(np.isfinite(np.asarray(image.get_array(), dtype=float)).sum())
                    for ax in figure.axes for image in ax.get_images())
        assert cells >= 8, data.label  # the bucket's distinct tiles, each with its TFLOP/s
    written = write_report(db, tmp_path / "report")
    assert len(written) == 8
    for path in written:
        assert _coloured_pixels(path) > 2000, path.name


def test_an_empty_plot_fails_the_checks(tmp_path: Path) -> None:
    """The checks above are not vacuous: a figure without data has no data artist and no
    coloured pixel."""
    pytest.importorskip("matplotlib")
    from flashtune.commands.report import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots()
    ax.set_title("Best so far")
    ax.grid(alpha=0.3)
    ax.text(0.5, 0.5, "nothing")
    path = tmp_path / "empty.png"
    fig.savefig(path)
    assert _data_artists(fig) == 0 and _coloured_pixels(path) == 0
    plt.close(fig)


def test_report_of_a_dry_run_draws_predictions_in_every_bucket(tmp_path: Path) -> None:
    """A dry run times nothing: every bucket's plots show the stored predictions, labelled
    PREDICTED, and a failed config is marked, never given a predicted speed."""
    pytest.importorskip("matplotlib")
    from dbfactories import CONFIGS, H100, PROBLEMS, trial

    from flashtune.codegen.arch import get_arch
    from flashtune.commands.report import load_buckets, winners_figure, write_report
    from flashtune.families import of

    default = of(PROBLEMS[0]).default_config(PROBLEMS[0], get_arch(H100.arch))
    db = f"sqlite:///{tmp_path / 'tuning.db'}"
    with TuningStore(db) as store:
        store.record_device(H100)
        for i, seqlen in enumerate((1024, 4096, 16384)):
            for j, config in enumerate((default, *CONFIGS[:3])):
                store.record_trial(trial(H100, PROBLEMS[0], seqlen, config,
                                         status=TrialStatus.VERIFIED_UNTIMED,
                                         predicted_ms=0.5 + j / 10, minutes=10 * i + j))
            store.record_trial(trial(H100, PROBLEMS[0], seqlen, CONFIGS[4],
                                     status=TrialStatus.INVALID, predicted_ms=0.01,
                                     minutes=10 * i + 5))
    buckets = load_buckets(db)
    assert len(buckets) == 3 and not any(b.timed for b in buckets)
    winners = winners_figure(buckets)
    assert "PREDICTED" in winners.axes[0].get_title()
    assert _data_artists(winners) == 6  # the best prediction and the default's per bucket
    # the invalid config's 0.01 ms prediction is not the predicted best: the default's
    # 0.5 ms is, so each bucket's two bars are equal
    bars = [p.get_height() for p in winners.axes[0].patches]
    assert bars[:3] == pytest.approx(bars[3:])
    written = write_report(db, tmp_path / "report")
    assert [p.name for p in written].count("best_so_far.png") == 1 and len(written) == 5
    for path in written:
        assert _coloured_pixels(path) > 2000, path.name
