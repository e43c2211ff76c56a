"""`flashtune tune` and `flashtune report` from the command line, and the dry run end to end
(the real NVRTC compiler and the CPU emulator). The end-to-end dry run compiles in a process
pool; the other dry runs compile inline (``--compile-workers 0``: the pool is not their
point, and each spawned compile process costs an interpreter start)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch
from tuner_synthetic import SyntheticMeasurer
from tuner_testlib import FAST
from typer.testing import CliRunner

from flashtune.cli import app
from flashtune.commands.report import write_report
from flashtune.db.store import TuningStore
from flashtune.tuner.driver import tune

runner = CliRunner()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_tune_without_a_gpu_says_so_and_points_to_the_dry_run(db_url: str) -> None:
    result = runner.invoke(app, ["tune", "--head-dim", "128", "--db", db_url])
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "no CUDA GPU" in text and "--dry-run --arch sm_90" in text


def test_tune_rejects_bad_arguments_with_the_expected_form(db_url: str) -> None:
    for args, expected in ((["--seqlens", "10x"], "expected e.g."),
                           (["--budget", "soon"], "expected e.g. '10m'"),
                           (["--budget", "5%"], "needs --replay"),
                           (["--sampler", "annealing"], "expected one of"),
                           (["--dtype", "fp8"], "expected one of")):
        result = runner.invoke(app, ["tune", "--head-dim", "128", "--db", db_url, "--dry-run",
                                     *args])
        assert result.exit_code == 1, result.output
        assert expected in " ".join(result.output.split()), result.output


@pytest.mark.emulator
def test_dry_run_end_to_end_compiles_and_verifies_untimed(db_url: str) -> None:
    args = ["tune", "--head-dim", "64", "--dtype", "fp16", "--seqlens", "128", "--dry-run",
            "--arch", "sm_90", "--trials", "2", "--compile-workers", "1", "--db", db_url]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "dry run (untimed" in result.output
    assert "PREDICTED ranking" in result.output and "not a measurement" in result.output
    with TuningStore(db_url) as store:
        trials = store.trials(device="virtual-sm_90")
    verified = [t for t in trials if t.status.value == "verified_untimed"]
    assert verified and all(t.predicted_ms is not None and t.predicted_ms > 0
                            for t in verified)
    with TuningStore(db_url) as store:
        statuses = Counter(t.status.value for t in trials)
        assert store.all_best() == []  # nothing untimed is ever a performance result
    assert statuses["ok"] == 0 and all(t.tflops is None for t in trials)
    assert statuses["verified_untimed"] >= 1, statuses
    measured = [t for t in trials if "static" not in (t.error or "")]
    assert 1 <= len({t.config.key for t in measured}) <= 2
    # a second dry run skips what is settled and verifies the next candidates
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    with TuningStore(db_url) as store:
        keys = Counter(t.config.key for t in store.trials(device="virtual-sm_90"))
    assert max(keys.values()) == 1


@pytest.mark.emulator
def test_dry_run_tunes_a_problem_with_attention_features(db_url: str) -> None:
    """--features compiles the switches in: the bucket is the feature problem's own key, and
    its candidates are verified in the emulator with the features' values drawn."""
    args = ["tune", "--head-dim", "64", "--dtype", "fp16", "--features", "window,softcap",
            "--seqlens", "128", "--dry-run", "--arch", "sm_90", "--trials", "1",
            "--compile-workers", "0", "--db", db_url]
    assert _verified_keys(args, db_url, "virtual-sm_90") == {"fwd_d64_fp16_local_softcap"}


def _verified_keys(args: list[str], db_url: str, device: str) -> set[str]:
    """The problem keys of the verified trials a dry tuning run with ``args`` stored."""
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    with TuningStore(db_url) as store:
        trials = store.trials(device=device)
    verified = [t for t in trials if t.status.value == "verified_untimed"]
    assert verified, Counter(t.status.value for t in trials)
    return {t.problem.key for t in verified}


@pytest.mark.emulator
def test_dry_run_tunes_the_fp8_forward_with_either_input_format(db_url: str) -> None:
    """``--op fwd8 --dtype bf16``: O's type, e4m3 inputs; ``--input-dtype e5m2`` makes the
    bucket the e5m2 problem's own, verified in the emulator on a virtual sm_89."""
    args = ["tune", "--op", "fwd8", "--head-dim", "64", "--dtype", "bf16", "--seqlens", "128",
            "--dry-run", "--arch", "sm_89", "--trials", "1", "--compile-workers", "0",
            "--db", db_url]
    assert _verified_keys([*args, "--input-dtype", "e5m2"], db_url, "virtual-sm_89") == {
        "fwd8_d64_e5m2-e5m2-bf16_full"}
    wrong = runner.invoke(app, [*args, "--input-dtype", "e3m4"])
    assert wrong.exit_code != 0 and "e4m3, e5m2" in wrong.output, wrong.output


@pytest.mark.emulator
def test_dry_run_for_sm90a_tunes_the_family_that_serves_the_forward_there(db_url: str) -> None:
    """A cc 9.0 device's forward calls run the sm_90a family, so that is what a tuning run
    for it measures (and says), with the wgmma path's predictions; a feature problem too
    (dropout: the sm_90a family takes every built-in feature) is its own key there."""
    args = ["tune", "--head-dim", "64", "--dtype", "bf16", "--seqlens", "128", "--dry-run",
            "--arch", "sm_90a", "--trials", "1", "--compile-workers", "0", "--db", db_url]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "note: on virtual-sm_90a the fwd90aws family serves fwd calls, so it is the one " \
           "tuned (fwd90aws_d64_bf16_full); --arch sm_90 tunes the portable one" in said, said
    assert "fwd90aws_d64_bf16_full_n128: PREDICTED ranking (cost model fa3-wgmma-1/" in said
    with TuningStore(db_url) as store:
        trials = store.trials(device="virtual-sm_90a")
    assert trials and {t.problem.key for t in trials} == {"fwd90aws_d64_bf16_full"}
    featured = runner.invoke(app, [*args[:-2], "--features", "dropout", "--db", db_url])
    assert featured.exit_code == 0, featured.output
    assert "(fwd90aws_d64_bf16_full_dropout)" in " ".join(featured.output.split())
    with TuningStore(db_url) as store:
        keys = {t.problem.key for t in store.trials(device="virtual-sm_90a")}
    assert keys == {"fwd90aws_d64_bf16_full", "fwd90aws_d64_bf16_full_dropout"}, keys


def test_unknown_features_are_refused_with_the_choices(db_url: str) -> None:
    result = runner.invoke(app, ["tune", "--head-dim", "64", "--features", "window,rope",
                                 "--dry-run", "--db", db_url])
    assert result.exit_code == 1
    assert "unknown rope; expected a comma-separated subset of window, softcap, alibi, " \
        "varlen" in " ".join(result.output.split()), result.output
    # a feature the family lacks is refused before any bucket is opened
    result = runner.invoke(app, ["tune", "--op", "decode", "--head-dim", "64", "--features",
                                 "varlen", "--dry-run", "--db", db_url])
    assert result.exit_code == 1
    assert "does not implement variable-length batches" in " ".join(result.output.split())
    assert "decode_d64" not in result.output, result.output


def test_a_backward_with_a_window_dry_runs_without_a_cost_model(db_url: str) -> None:
    """The backward has no cost model: its configs are searched unranked, verified in the
    emulator with drawn window sizes."""
    result = runner.invoke(app, ["tune", "--op", "bwd", "--head-dim", "32", "--features",
                                 "window", "--dry-run", "--trials", "1", "--seqlens", "1024",
                                 "--arch", "sm_80", "--compile-workers", "0", "--db", db_url])
    assert result.exit_code == 0, result.output
    assert "bwd_d32_fp16_local_n1024" in result.output


def test_fix_restricts_the_search_to_the_fixed_knobs(db_url: str) -> None:
    """``--fix NAME=VALUE`` (TuneOptions.fixed): only configs with the fixed values are
    proposed, measured and crowned, under a study of their own; on the command line a knob
    or a value the family's space lacks is refused naming the choices."""
    from tuner_synthetic import DEVICE, SyntheticMeasurer

    from flashtune.codegen.spec import KernelConfig

    measurer = SyntheticMeasurer(best=KernelConfig(64, 64, 4, 2, extras=(("splits", 4),)))
    opts = dataclasses.replace(FAST, trials=6, fixed=(("splits", 4),))
    [summary] = tune(64, "fp16", False, [4096], op="decode", measurer=measurer, db=db_url,
                     options=opts)
    assert summary.study is not None and summary.study.endswith("/fixed:splits=4")
    assert summary.winner is not None and summary.winner.extra("splits", 0) == 4
    with TuningStore(db_url) as store:
        trials = store.trials(device=DEVICE.name)
    assert len(trials) >= 6
    assert {KernelConfig.from_key(t.config.key).extra("splits", 0) for t in trials} == {4}
    for fix, expected in (("splits=3", "its values are [0, 1, 2, 4, 8, 16, 32, 64, 128]"),
                          ("nosuch=1", "'nosuch' is not a knob of the 'decode' family; its "
                                       "knobs are ['block_m', 'block_n', 'num_warps', "
                                       "'num_stages', 'splits', 'splitsize']")):
        result = runner.invoke(app, ["tune", "--op", "decode", "--head-dim", "64", "--fix", fix,
                                     "--dry-run", "--db", db_url])
        assert result.exit_code == 1, result.output
        assert expected in " ".join(result.output.split()), result.output


def test_report_writes_png_and_html(db_url: str, tmp_path: Path) -> None:
    opts = dataclasses.replace(FAST, trials=8, final_top=2, final_rounds=1)
    measurer = SyntheticMeasurer(compile_fail=frozenset({"m64_n128_w4_s1"}))
    tune(128, "bf16", False, [1024, 4096], measurer=measurer, db=db_url, options=opts)
    written = write_report(db_url, tmp_path / "png", "png")
    names = sorted(p.name for p in written)
    assert names[0] == "best_so_far.png" and names[-1] == "winners.png"
    assert len([n for n in names if n.startswith("landscape-")]) == 2
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
    result = runner.invoke(app, ["report", "--db", db_url, "--out", str(tmp_path / "html"),
                                 "--format", "html"])
    assert result.exit_code == 0, result.output
    page = (tmp_path / "html" / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 4
    missing = runner.invoke(app, ["report", "--db", f"sqlite:///{tmp_path / 'none.db'}",
                                  "--out", str(tmp_path / "x")])
    # a read command: a mistyped path is refused, not created
    assert missing.exit_code == 1 and "no database file" in " ".join(missing.output.split())
    assert not (tmp_path / "none.db").exists()
