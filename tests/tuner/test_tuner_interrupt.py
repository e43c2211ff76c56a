"""Ctrl-C under ``tuner.interrupt.deferred``: the first only asks to stop (the pipeline
stops once the trial being measured is recorded and told, and abandons what is in flight),
the second raises at once, and leaving the block restores the previous handler."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from interrupt_helpers import python_sigint

from flashtune.tuner.interrupt import StopRequested, checkpoint, deferred
from flashtune.tuner.pipeline import Limits, run_pipeline
from flashtune.tuner.search.proposers import Proposal


@pytest.fixture(autouse=True)
def _python_handles_sigint() -> Iterator[None]:
    """Nothing here would be raised where the run inherited SIGINT ignored."""
    with python_sigint():
        yield


def ctrl_c() -> None:
    # To this thread, not the process: the kernel may hand a process's signal to another
    # thread that a loaded machine does not run for a while, and the handler would then
    # run after the test had looked for it (seen once in a full run).
    signal.raise_signal(signal.SIGINT)


def test_the_first_ctrl_c_asks_the_second_raises_and_the_handler_is_restored(
        capfd: pytest.CaptureFixture[str]) -> None:
    before = signal.getsignal(signal.SIGINT)
    with deferred("stopping soon"):
        checkpoint()  # nothing asked yet
        ctrl_c()  # would raise here without deferred
        with pytest.raises(StopRequested):
            checkpoint()
        with pytest.raises(StopRequested):  # asked until the block ends
            checkpoint()
        with pytest.raises(KeyboardInterrupt) as second:
            ctrl_c()
        assert not isinstance(second.value, StopRequested)
    assert signal.getsignal(signal.SIGINT) is before
    checkpoint()  # the request ends with the block
    deadline = time.monotonic() + 5
    while "stopping soon" not in capfd.readouterr().err:  # said once, by its own thread
        assert time.monotonic() < deadline, "the notice was not printed on stderr"
        time.sleep(0.01)


def test_a_block_without_ctrl_c_says_nothing_and_leaves_no_thread(
        capfd: pytest.CaptureFixture[str]) -> None:
    with deferred("stopping soon"):
        checkpoint()
    assert capfd.readouterr().err == ""
    assert not [t for t in threading.enumerate() if t.name == "flashtune-ctrl-c"]


def test_without_deferred_ctrl_c_raises_at_once() -> None:
    with pytest.raises(KeyboardInterrupt):
        ctrl_c()
    checkpoint()


class Counting:
    """A proposer of 0, 1, 2, ... that records what it was told and what it abandoned."""

    def __init__(self) -> None:
        self.proposed = 0
        self.told: list[int] = []
        self.abandoned: list[int] = []

    def propose(self) -> Proposal[int] | None:
        self.proposed += 1
        return Proposal(self.proposed - 1)

    def tell(self, proposal: Proposal[int], result: int) -> None:
        assert result == proposal.config * 10
        self.told.append(proposal.config)

    def abandon(self, proposal: Proposal[int]) -> None:
        self.abandoned.append(proposal.config)


class PressedDuring:
    """Measures config c as 10 c; Ctrl-C arrives while ``pressed_at`` is measured."""

    def __init__(self, pressed_at: int) -> None:
        self.pressed_at = pressed_at

    def start(self, config: int) -> cf.Future[int]:
        future: cf.Future[int] = cf.Future()
        future.set_result(config * 10)
        return future

    def finish(self, config: int, started: cf.Future[int]) -> int:
        if config == self.pressed_at:
            ctrl_c()
        return started.result()


@pytest.mark.parametrize("pressed_at", [0, 3])
def test_the_pipeline_records_the_trial_in_progress_then_stops(pressed_at: int) -> None:
    proposer, recorded = Counting(), []
    depth = 3
    with deferred("stopping"), pytest.raises(StopRequested):
        run_pipeline(PressedDuring(pressed_at), proposer, Limits(trials=50), depth=depth,
                     on_result=lambda p, r: recorded.append(p.config))
    done = list(range(pressed_at + 1))  # the trial measured when Ctrl-C came included
    assert recorded == done and proposer.told == done
    in_flight = list(range(pressed_at + 1, pressed_at + depth))  # started, never finished
    assert proposer.abandoned == in_flight
    assert proposer.proposed == pressed_at + depth  # nothing proposed after the Ctrl-C


def test_an_ignored_sigint_stays_ignored() -> None:
    """A background job of a shell starts with SIGINT ignored; the block leaves it so."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the fixture restores Python's handler
    with deferred("stopping soon"):
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        ctrl_c()
        checkpoint()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
