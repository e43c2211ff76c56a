"""The compile worker pool: workers are spawned and die with the process that made them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

SCRIPT = """
import os, sys, time
from flashtune.toolchain.processes import compile_process_pool
pool = compile_process_pool(1)
print(pool.submit(os.getpid).result(), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (dead, not yet reaped by init) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux")
def test_workers_die_when_their_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        assert worker != parent.pid and _alive(worker)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 20
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), f"compile worker {worker} outlived its killed parent"


# A parent with its own Ctrl-C handling (as `flashtune tune` has), whose process group gets
# SIGINT again and again while its workers start: a worker spawns on the first submit and
# spends a good part of a second importing, where Python's default handler would raise (the
# pool then breaks).
CTRL_C_SCRIPT = """
import os, signal, sys, time
from flashtune.toolchain.processes import compile_process_pool, sigint_held
signal.signal(signal.SIGINT, lambda signum, frame: print("parent: ctrl-c", flush=True))
with compile_process_pool(2) as pool:
    futures = [pool.submit(os.getpid) for _ in range(2)]
    end = time.monotonic() + 3
    while time.monotonic() < end and not all(f.done() for f in futures):
        os.killpg(0, signal.SIGINT)
        time.sleep(0.02)
    print("ran in workers:", os.getpid() not in {f.result() for f in futures}, flush=True)
    with sigint_held():
        os.killpg(0, signal.SIGINT)
        print("held", flush=True)
print("unblocked", flush=True)
"""


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="no signal masks")
def test_ctrl_c_while_workers_start_is_the_parents_alone() -> None:
    proc = subprocess.run([sys.executable, "-c", CTRL_C_SCRIPT], capture_output=True,
                          text=True, timeout=120, start_new_session=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "ran in workers: True" in out and out.count("parent: ctrl-c") >= 2, out
    # the parent's own Ctrl-C under sigint_held is not lost: another thread of the process
    # takes it, or the main thread when the block ends
    tail = proc.stdout.split("ran in workers: True\n")[1].splitlines()
    assert sorted(tail) == ["held", "parent: ctrl-c", "unblocked"], out
