"""Every ldmatrix variant against the lane tables of the reference, with row addresses that
are neither contiguous nor in order, and the address checks (alignment, bounds)."""

from __future__ import annotations

import numpy as np
import pytest
from emu_helpers import ldmatrix_expected

from flashtune.errors import EmulatorError
from flashtune.runtime.backends.emulator import EmulatedModule, build_module, i32, ptr

pytestmark = pytest.mark.emulator

ROWS = 64  # rows of 8 elements (16 bytes) in shared memory

SOURCE = r"""
// Fills ROWS rows of 16 bytes of shared memory from `data`, then every lane passes the row
// `rows[lane]` (bad_lane, if >= 0, passes a row address shifted by `bad_offset` bytes) and
// ldmatrix variant `variant` (count 1/2/4, trans) writes its registers to out[lane][j].
template <int COUNT, bool TRANS>
__device__ void load(unsigned* out, const unsigned char* row, int lane) {
  unsigned r[COUNT];
  if constexpr (COUNT == 1) {
    if (TRANS) ft::ldmatrix_x1_trans(r, row); else ft::ldmatrix_x1(r, row);
  } else if constexpr (COUNT == 2) {
    if (TRANS) ft::ldmatrix_x2_trans(r, row); else ft::ldmatrix_x2(r, row);
  } else {
    if (TRANS) ft::ldmatrix_x4_trans(r, row); else ft::ldmatrix_x4(r, row);
  }
  for (int j = 0; j < COUNT; ++j) out[lane * 4 + j] = r[j];
}

extern "C" __global__ void ldm(const unsigned short* data, const int* rows, unsigned* out,
                               int variant, int bad_lane, int bad_offset) {
  FT_DYNAMIC_SMEM(unsigned char, smem);
  int lane = threadIdx.x;
  unsigned short* s = reinterpret_cast<unsigned short*>(smem);
  for (int i = lane; i < ROWS * 8; i += 32) s[i] = data[i];
  __syncthreads();
  const unsigned char* row = smem + rows[lane] * 16 + (lane == bad_lane ? bad_offset : 0);
  switch (variant) {
    case 1: load<1, false>(out, row, lane); break;
    case 2: load<2, false>(out, row, lane); break;
    case 4: load<4, false>(out, row, lane); break;
    case 17: load<1, true>(out, row, lane); break;
    case 18: load<2, true>(out, row, lane); break;
    case 20: load<4, true>(out, row, lane); break;
  }
}
"""


@pytest.fixture(scope="module")
def module() -> EmulatedModule:
    return build_module(SOURCE, ["ldm"], defines=[f"ROWS={ROWS}"])


def _run(module: EmulatedModule, count: int, trans: bool, rows: np.ndarray,
         bad_lane: int = -1, bad_offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng()
    data = rng.integers(0, 1 << 16, size=ROWS * 8, dtype=np.uint16)
    out = np.zeros((32, 4), dtype=np.uint32)
    variant = count | (16 if trans else 0)
    module["ldm"].launch(1, 32, [ptr(data), ptr(rows), ptr(out), i32(variant), i32(bad_lane),
                                 i32(bad_offset)], smem_bytes=ROWS * 16)
    return data, out


@pytest.mark.parametrize("trans", [False, True], ids=["plain", "trans"])
@pytest.mark.parametrize("count", [1, 2, 4])
def test_ldmatrix_lane_tables(module: EmulatedModule, count: int, trans: bool) -> None:
    rng = np.random.default_rng()
    rows = rng.permutation(ROWS)[:32].astype(np.int32)
    data, out = _run(module, count, trans, rows)
    mats = np.stack([data.reshape(ROWS, 8)[rows[8 * j: 8 * j + 8]] for j in range(count)])
    np.testing.assert_array_equal(out[:, :count], ldmatrix_expected(mats, trans))


@pytest.mark.parametrize("count", [1, 2])
def test_addresses_of_unused_lanes_are_ignored(module: EmulatedModule, count: int) -> None:
    rows = np.arange(32, dtype=np.int32)
    # A misaligned address from a lane that supplies no row must not matter.
    data, out = _run(module, count, False, rows, bad_lane=8 * count, bad_offset=3)
    mats = np.stack([data.reshape(ROWS, 8)[8 * j: 8 * j + 8] for j in range(count)])
    np.testing.assert_array_equal(out[:, :count], ldmatrix_expected(mats, False))


def test_misaligned_row_address_is_an_error(module: EmulatedModule) -> None:
    rows = np.arange(32, dtype=np.int32)
    with pytest.raises(EmulatorError,
                       match=r"ldmatrix_x4 at .*row address of lane 9 .* offset 152 is not "
                             r"16-byte aligned"):
        _run(module, 4, False, rows, bad_lane=9, bad_offset=8)


def test_row_outside_shared_memory_is_an_error(module: EmulatedModule) -> None:
    rows = np.arange(32, dtype=np.int32)
    rows[3] = ROWS  # one row past the end of the allocation
    with pytest.raises(EmulatorError,
                       match=rf"ldmatrix_x2_trans .*lane 3 .* offset {ROWS * 16} of the "
                             rf"{ROWS * 16}-byte dynamic shared memory \(out of bounds\)"):
        _run(module, 2, True, rows)
