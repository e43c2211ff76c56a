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
    the main thread (where signal handlers cannot be set) the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def first(signum: int, frame: FrameType | None) -> None:
        _requested.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # Not printed here: a signal handler can run inside a write to the same stream,
        # which raises "reentrant call"; a thread waits for the stream's lock instead.
        threading.Thread(target=_say, args=(notice,), daemon=True).start()

    previous = signal.signal(signal.SIGINT, first)
    _requested.clear()
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _requested.clear()


def _say(notice: str) -> None:
    print(notice, file=sys.stderr, flush=True)


def checkpoint() -> None:
    """Raise StopRequested if a Ctrl-C under ``deferred`` asked to stop; otherwise nothing."""
    if _requested.is_set():
        raise StopRequested
