"""setmaxnreg (sm_90a) in the emulator: accepted as FA3 uses it (producer .dec, consumers
.inc) and its rules checked: a count that is not a multiple of 8 in 24..256, warps of one
warpgroup that disagree or skip it, a whole warpgroup that skips it while the others move
registers, an .inc below the previous request, and final requests beyond the block's 64 Ki
registers."""

from __future__ import annotations

import pytest

from flashtune.codegen.render import templates_dir
from flashtune.errors import EmulatorError
from flashtune.runtime.backends.emulator import build_module, i32

pytestmark = pytest.mark.emulator

SOURCE = r"""
#include "warpgroup.cuh"

// 384 threads: warpgroup 0 the producer, 1 and 2 the consumers. bug: 0 none (24 / 240),
// 1 a count of 100, 2 warp 5 asks for 232, 3 warp 6 skips it, 4 an .inc to 232 after the
// .inc to 240, 5 consumers at 256 (24 x 128 + 256 x 256 > 65536), 6 warpgroup 2 skips it.
// (Warpgroup 2 skipping it keeps the total at 24 x 128 + 240 x 128, within 65536.)
extern "C" __global__ void regs(int bug) {
  const int warp = threadIdx.x / 32;
  if (warp < 4) {
    ft::setmaxnreg_dec<24>();
    return;
  }
  if (bug == 1) ft::setmaxnreg_inc<100>();
  else if (bug == 2 && warp == 5) ft::setmaxnreg_inc<232>();
  else if ((bug == 3 && warp == 6) || (bug == 6 && warp >= 8)) {}
  else if (bug == 5) ft::setmaxnreg_inc<256>();
  else ft::setmaxnreg_inc<240>();
  if (bug == 4) ft::setmaxnreg_inc<232>();
}
"""


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    return build_module(SOURCE, ["regs"], include_dirs=[templates_dir()])["regs"]


def test_fa3_split_is_accepted(kernel) -> None:  # type: ignore[no-untyped-def]
    kernel.launch(2, 384, [i32(0)])


@pytest.mark.parametrize(("bug", "pattern"), [
    (1, r"setmaxnreg.inc at .*: count 100 must be a multiple of 8 in 24..256"),
    (2, r"setmaxnreg.inc 232 at .*: thread \d+ executed setmaxnreg.inc 240 at .* as the same "
        r"\(number 1\) setmaxnreg of warpgroup 1; .sync.aligned requires the same instruction"),
    (3, r"setmaxnreg: thread 192 \(warp 6\) of warpgroup 1 executed 0 setmaxnreg but thread "
        r"128 executed 1"),
    (4, r"setmaxnreg.inc 232 at .*: the warpgroup's previous request was 240 .* \.inc must not "
        r"lower it"),
    (5, r"final requests add up to 68608 registers .* more than the 65536 of the block"),
    (6, r"setmaxnreg: warpgroup 2 \(threads 256..383\) executed no setmaxnreg, but warpgroup 0 "
        r"did \(setmaxnreg.dec 24 at .*\): in a block that moves registers between warpgroups "
        r"every warpgroup states its limit"),
])
def test_rule_violations_are_caught(kernel, bug: int, pattern: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(EmulatorError, match=pattern):
        kernel.launch(1, 384, [i32(bug)])
