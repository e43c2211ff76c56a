"""Ctrl-C as a terminal sends it: SIGINT to a process group, once the process is ready."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def python_sigint() -> Iterator[None]:
    """Python's own SIGINT handling within the block, as in a terminal's foreground process:
    a test run that was itself started as a background job inherits SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def start_as_foreground_job(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **kwargs)`` in a process group of its own with SIGINT at its
    default, as a terminal starts a command (not ignored, as a background job's child)."""
    with python_sigint():  # caught here: exec resets a caught signal to its default
        return subprocess.Popen(argv, start_new_session=True, **kwargs)


def interrupt_when_ready(proc: subprocess.Popen[bytes], ready: Callable[[], bool], what: str,
                         *, settle_s: float = 0.0, timeout_s: float = 120.0) -> str:
    """Wait until ``ready()`` (failing if ``proc``, started by start_as_foreground_job, ends
    first or ``what`` does not happen in ``timeout_s``), wait ``settle_s``, send SIGINT
    to its process group and return what it printed (stdout and stderr, as piped). Give
    ``proc`` PYTHONFAULTHANDLER=1 so that a hang after Ctrl-C fails with its stacks."""
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert proc.poll() is None, b"".join(x for x in proc.communicate() if x).decode()
            assert time.monotonic() < deadline, f"{what} did not happen in {timeout_s} s"
            time.sleep(0.05)
        time.sleep(settle_s)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            return b"".join(x for x in proc.communicate(timeout=timeout_s) if x).decode()
        except subprocess.TimeoutExpired:
            # Where it hangs: with PYTHONFAULTHANDLER=1 in its environment, SIGABRT makes
            # each Python process of the group print every thread's stack.
            os.killpg(proc.pid, signal.SIGABRT)
            said = b"".join(x for x in proc.communicate(timeout=30) if x).decode()
            raise AssertionError(f"still running {timeout_s} s after Ctrl-C; its output and "
                                 f"stacks:\n{said}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
