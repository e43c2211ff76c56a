"""The tune display: statically pruned configs are "pruned", not failures; the reason of
each failure is printed where it is counted; a status line says what a long phase does
(on the terminal only: output that is not a terminal is unchanged)."""

from __future__ import annotations

import io
import time
from collections import Counter

from rich.console import Console

from flashtune.codegen.spec import KernelConfig, ProblemBucket
from flashtune.commands.tune_progress import (
    PREPARING,
    RichProgress,
    final_table,
    live_table,
)
from flashtune.db.records import TrialStatus
from flashtune.tuner.measure.evaluate import TrialResult
from flashtune.tuner.options import STATIC_REJECTIONS, BucketSummary

BUCKET = ProblemBucket.from_key("fwd_d64_fp16_full_n128")
BAD = KernelConfig.from_key("m128_n128_w2_s3")
REASON = "shared memory of 98304 B exceeds the 49152 B an sm_90 block may use"


def _summary() -> BucketSummary:
    summary = BucketSummary(BUCKET, None, 4539, timed=False, pruned_by_model=12,
                            statuses=Counter({STATIC_REJECTIONS: 96837, "invalid": 2,
                                              "verified_untimed": 3}))
    summary.measured = 5
    return summary


def _text(renderable: object, *, terminal: bool = False) -> str:
    out = io.StringIO()
    Console(file=out, width=160, force_terminal=terminal, color_system=None).print(renderable)
    return out.getvalue()


def test_statically_pruned_configs_are_pruned_not_failures() -> None:
    for table in (live_table([_summary()], 40), final_table([_summary()])):
        text = _text(table)
        assert "pruned" in text and "96837 + 12 by the cost model" in text, text
        assert "static" not in text and "invalid 2" in text, text


def test_the_reason_of_each_failure_is_printed_with_its_configs() -> None:
    progress = RichProgress(40, Console(file=io.StringIO()), phases=True)
    summary = _summary()
    with progress:
        progress.bucket_started(summary)
        for config in (BAD, KernelConfig.from_key("m128_n128_w4_s3")):
            progress.trial_done(summary, TrialResult(config, TrialStatus.INVALID,
                                                     error=f"{REASON}\n  detail"))
        progress.trial_done(summary, TrialResult(BAD, TrialStatus.VERIFIED_UNTIMED))
    [note] = progress.failure_notes()
    assert note == (f"{BUCKET.key()}: invalid 2 ({BAD.key()}, m128_n128_w4_s3): {REASON}")


def test_a_status_line_says_what_a_long_phase_does_on_a_terminal_only() -> None:
    screen = io.StringIO()
    progress = RichProgress(40, Console(file=screen, force_terminal=True, width=200),
                            phases=True)
    with progress:
        assert PREPARING in _text(progress._view(), terminal=True)
        time.sleep(0.6)  # the live display redraws 4 times a second
        assert PREPARING in screen.getvalue()
        progress.bucket_started(_summary())
        assert "emulator build" in _text(progress._view(), terminal=True)
    assert PREPARING not in _text(progress._view(), terminal=True)  # gone at the end

    log = io.StringIO()
    errors = io.StringIO()
    quiet = RichProgress(40, Console(file=log, width=200), phases=True,
                         errors=Console(file=errors, force_terminal=True, width=200))
    with quiet:
        time.sleep(0.3)
    assert PREPARING not in log.getvalue()  # output that is not a terminal: the table only
    assert PREPARING in errors.getvalue()  # ... and the status on stderr, a terminal


def test_config_keys_in_the_tables_are_whole_at_80_columns() -> None:
    summary = _summary()
    summary.default = KernelConfig.from_key("m128_n32_w2_s1_persistent-1")
    out = io.StringIO()
    console = Console(file=out, width=80, color_system=None)
    console.print(final_table([summary]))
    console.print(live_table([summary], 40))
    assert out.getvalue().count("m128_n32_w2_s1_persistent-1") == 1, out.getvalue()
    assert out.getvalue().count(BUCKET.key()) == 2, out.getvalue()
