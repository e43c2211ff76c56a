"""Worker processes that die with their parent and leave Ctrl-C to it.

The terminal sends SIGINT to the whole process group, workers included. A worker must not
act on it: a KeyboardInterrupt inside a pool worker kills it (the pool breaks, and the
parent prints a traceback it did not cause) or cuts a result short in the pool's pipe,
where the pool's manager thread, which the parent joins at exit, waits for the rest of it
forever. The parent stops or cancels the workers' work; the workers ignore SIGINT.

Ignoring it from the worker's own code is too late for a Ctrl-C that lands while the new
interpreter still imports (a second or more on a loaded machine): Python's default handler
is in place from the start. So workers are started with SIGINT blocked (``sigint_held``;
a signal mask is kept across fork and exec), and ``tie_worker_to_parent`` ignores it, which
drops one that arrived meanwhile, before unblocking it.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager


@contextmanager
def sigint_held() -> Iterator[None]:
    """Block SIGINT in the calling thread for the block: processes started in it begin with
    SIGINT blocked. The process's own Ctrl-C is not lost: another thread takes it, or this
    one when the block ends. Where signal masks do not exist (Windows) nothing changes."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def tie_worker_to_parent() -> None:
    """Make this worker process (compile or tuning) ignore Ctrl-C and die with its parent,
    so that a killed `flashtune tune` or `compile --all` leaves no workers behind and Ctrl-C
    prints the parent's one message. Call it first thing in a worker started under
    ``sigint_held``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        if os.getppid() == 1:  # the parent died before the request took effect
            os._exit(1)


class _HeldProcess(multiprocessing.context.SpawnProcess):
    def start(self) -> None:
        with sigint_held():
            super().start()


class _WorkerContext(multiprocessing.context.SpawnContext):
    """Spawn (not fork: no inherited locks of other threads, no CUDA context), with SIGINT
    held from the start."""

    Process = _HeldProcess


def compile_process_pool(workers: int) -> ProcessPoolExecutor:
    """The one kind of worker pool (``compile --all``, precompile, the tuner's compiles):
    spawned workers that die with their parent and ignore Ctrl-C, which is the parent's."""
    return ProcessPoolExecutor(max_workers=workers, mp_context=_WorkerContext(),
                               initializer=tie_worker_to_parent)
