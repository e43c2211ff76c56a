"""Named barriers (bar.sync / bar.arrive with an id and a thread count) in the emulator: two
warps that hand a turn back and forth through them write a strictly alternating log in both
thread orders; the rules (id 1..15, a count that is a multiple of 32 within the block, one
count per phase) are checked, and a phase that cannot complete is a deadlock naming the
barrier."""

from __future__ import annotations

import numpy as np
import pytest

from flashtune.codegen.render import templates_dir
from flashtune.errors import EmulatorDeadlock, EmulatorError
from flashtune.runtime.backends.emulator import LaunchOptions, build_module, i32, ptr
from flashtune.runtime.backends.emulator.kernel import Schedule

pytestmark = pytest.mark.emulator

SOURCE = r"""
#include "warpgroup.cuh"

// 64 threads, two warps taking turns `rounds` times: warp w waits on barrier 1 + w, appends
// its id to the log, and hands the turn to the other (barrier 2 - w). bug: 0 none, 1 no first
// turn, 2 a hand-over counting 32 threads, 3 id 0, 4 id 16, 5 a count of 48, 6 a count of 96.
extern "C" __global__ void turns(int* log, int rounds, int bug) {
  const unsigned w = threadIdx.x / 32;
  const unsigned count = bug == 5 ? 48 : bug == 6 ? 96 : 64;
  const unsigned mine = bug == 3 ? 0 : bug == 4 ? 16 : 1 + w;
  if (w == 1 && bug != 1) ft::named_barrier_arrive(1, 64);  // warp 0 goes first
  for (int r = 0; r < rounds; ++r) {
    ft::named_barrier_sync(mine, count);
    if (threadIdx.x % 32 == 0) log[2 * r + w] = static_cast<int>(w) + 10 * r;
    ft::named_barrier_arrive(2 - w, bug == 2 ? 32 : 64);
  }
}
"""


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    return build_module(SOURCE, ["turns"], include_dirs=[templates_dir()])["turns"]


def _run(kernel, bug: int, schedule: Schedule = Schedule.FORWARD) -> np.ndarray:  # type: ignore[no-untyped-def]
    log = np.full(8, -1, dtype=np.int32)
    kernel.launch(1, 64, [ptr(log), i32(4), i32(bug)],
                  options=LaunchOptions(schedule=schedule, hang_timeout_s=60))
    return log


@pytest.mark.parametrize("schedule", list(Schedule))
def test_turns_alternate(kernel, schedule: Schedule) -> None:  # type: ignore[no-untyped-def]
    assert list(_run(kernel, 0, schedule)) == [0, 1, 10, 11, 20, 21, 30, 31]


@pytest.mark.parametrize(("bug", "error", "pattern"), [
    (1, EmulatorDeadlock, r"warp 0: lanes 0-31 wait in bar.sync at .* on named barrier 1 for "
                          r"phase 0 to complete: 32 of 64 threads arrived"),
    (2, EmulatorError, r"bar.arrive 2, 32 at .*: phase 0 of named barrier 2 was started with a "
                       r"count of 64 threads"),
    (3, EmulatorError, r"bar.sync 0 at .*: the named barrier id must be in 1..15"),
    (4, EmulatorError, r"bar.sync 16 at .*: the named barrier id must be in 1..15"),
    (5, EmulatorError, r"bar.sync 1, 48 at .*: the thread count must be a non-zero multiple of "
                       r"32 not above the block's 64 threads"),
    (6, EmulatorError, r"bar.sync 1, 96 at .*: the thread count must be"),
])
def test_rule_violations_are_caught(kernel, bug: int, error: type[Exception],  # type: ignore[no-untyped-def]
                                    pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        _run(kernel, bug)
