"""Ctrl-C as a request to stop the tuner at its next safe point.

Python raises KeyboardInterrupt at whatever bytecode runs when SIGINT arrives: inside a
garbage-collector callback it is printed and dropped (the run goes on as if nothing was
pressed), and inside a database commit or an Optuna call it can leave a library half way
or escape its caller's cleanup. Under ``deferred`` the first Ctrl-C only records the
request (and says so on stderr); the tuner's loops call ``checkpoint`` between trials,
which raises ``StopRequested`` there, in ordinary code with every cleanup path intact. A
second Ctrl-C raises KeyboardInterrupt at once, for a stop that cannot wait for a trial.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_requested = threading.Event()


class StopRequested(KeyboardInterrupt):
    """Ctrl-C, raised by ``checkpoint`` where the tuner can stop cleanly (a KeyboardInterrupt,
    so every handler of an interruption handles it)."""


@contextmanager
def deferred(notice: str) -> Iterator[None]:
    """Within the block, the first SIGINT sets the stop request and prints ``notice`` on
    stderr; the second raises KeyboardInterrupt as Python's default handler does. Outside
    the main thread (where signal handlers cannot be set), and where SIGINT is ignored (a
    background job of a shell, as Python itself leaves it), the block runs unchanged."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
        yield
        return
    silent = False  # set when the block ends without a Ctrl-C

    def say() -> None:
        # The notice is printed by this thread, started before any Ctrl-C: a handler runs
        # between two bytecodes of the main thread, which may hold the lock of the stream
        # (a write there raises "reentrant call") or of thread creation (a deadlock).
        _requested.wait()
        if not silent:
            print(notice, file=sys.stderr, flush=True)

    def first(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _requested.set()

    _requested.clear()
    speaker = threading.Thread(target=say, name="flashtune-ctrl-c", daemon=True)
    speaker.start()
    try:  # the thread ends with the block, even if a Ctrl-C comes before the handler is set
        previous = signal.signal(signal.SIGINT, first)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
    finally:
        silent = not _requested.is_set()  # then the wake-up below only ends the thread
        _requested.set()
        speaker.join(timeout=5.0)  # a stderr nobody reads must not hang the exit
        _requested.clear()


def checkpoint() -> None:
    """Raise StopRequested if a Ctrl-C under ``deferred`` asked to stop; otherwise nothing."""
    if _requested.is_set():
        raise StopRequested
