"""TMA tile loads in the emulator: a box of a rank-4 (or rank-2) tensor lands in shared
memory with the map's swizzle and zero fill out of bounds, completing on an mbarrier, against
an independent NumPy placement; planted bugs (a misaligned destination, a missing or wrong
expect-tx, a box past the limits, a driver map handed to the emulator) are caught with clear
messages. The same source compiles with NVRTC for sm_90a; on a GPU the driver-encoded map
loads the same bytes (gpu marker)."""

from __future__ import annotations

import hashlib
import re
from typing import TypedDict

import numpy as np
import pytest

from flashtune.codegen.abi import ArgType
from flashtune.codegen.render import included_headers, templates_dir
from flashtune.codegen.spec import DType, KernelConfig, KernelSource, Problem
from flashtune.codegen.tensormap import TensorMap, TmaDType, TmaSwizzle
from flashtune.errors import EmulatorDeadlock, EmulatorError, InvalidInput
from flashtune.runtime.backends.emulator import LaunchOptions, build_module, i32, ptr
from flashtune.runtime.backends.emulator.kernel import Arg, Schedule
from flashtune.runtime.tma import encode_emulator
from flashtune.toolchain.compiler import compile_source
from flashtune.toolchain.cuda import find_toolchain
from flashtune.toolchain.disasm import disassemble

pytestmark = pytest.mark.emulator

SOURCE = r"""
#include "tma.cuh"
#include "wgmma.cuh"

// Loads the box at (c0, c1, c2, c3) (rank 4) or (c0, c1) (rank 2) of `map` into shared
// memory `offset` bytes past a 1024-byte boundary, waits for it and copies the box's bytes,
// as they lie in shared memory, to `out`. bug: 0 none, 1 a plain arrive instead of the
// expect-tx, 2 expect-tx of `expect` after the load.
extern "C" __global__ void tma_box(const __grid_constant__ CUtensorMap map, unsigned char* out,
                                   int nbytes, int rank, int c0, int c1, int c2, int c3,
                                   int expect, int offset, int bug) {
  FT_DYNAMIC_SMEM(unsigned char, raw);
  const unsigned window = ft::smem_address(raw);
  const unsigned pad = (1024u - (window & 1023u)) & 1023u;
  unsigned char* smem = raw + pad;
  auto* bar = reinterpret_cast<unsigned long long*>(smem);
  unsigned char* dst = smem + 1024 + offset;
  if (threadIdx.x == 0) {
    ft::prefetch_tensormap(&map);
    ft::mbarrier_init(bar, 1);
    ft::mbarrier_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (bug == 0) ft::mbarrier_arrive_expect_tx(bar, expect);
    if (rank == 4) ft::tma_load_4d(dst, &map, bar, c0, c1, c2, c3);
    else ft::tma_load_2d(dst, &map, bar, c0, c1);
    if (bug == 1) ft::mbarrier_arrive(bar);
    if (bug == 2) ft::mbarrier_arrive_expect_tx(bar, expect);
  }
  ft::mbarrier_wait_parity(bar, 0);
  for (int i = threadIdx.x; i < nbytes; i += blockDim.x) out[i] = dst[i];
}
"""

SMEM = 1024 + 1024 + 65536 + 1024


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    return build_module(SOURCE, ["tma_box"], include_dirs=[templates_dir()])["tma_box"]


def qkv_like(rows: int, heads: int, head_dim: int, seed: int) -> np.ndarray:
    """A (rows, heads, head_dim) uint16 tensor of distinct-looking values (bit patterns)."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, 0x7000, size=(rows, heads, head_dim), dtype=np.uint16)


def panel_map(x: np.ndarray, box_rows: int, swizzle: TmaSwizzle,
              address: int | None = None) -> TensorMap:
    """The (span/2 elements, rows, head_dim / (span/2) panels, heads) view of x (at
    ``address``: x's own by default) as the kernels use it: one box fills whole panels."""
    rows, heads, dim = x.shape
    inner = swizzle.span // 2 if swizzle is not TmaSwizzle.NONE else 64
    where = x.ctypes.data if address is None else address
    return TensorMap(TmaDType.BFLOAT16, where, (inner, rows, dim // inner, heads),
                     (heads * dim * 2, inner * 2, dim * 2), (inner, box_rows, dim // inner, 1),
                     swizzle)


def reference(x: np.ndarray, tmap: TensorMap, coords: tuple[int, ...]) -> np.ndarray:
    """The bytes the box must leave in shared memory (1024-byte-aligned destination)."""
    inner, rows, panels, _ = tmap.box
    c0, c1, c2, c3 = coords
    out = np.zeros(tmap.box_bytes, dtype=np.uint8)
    mask = {0: 0, 1: 1, 2: 3, 3: 7}[int(tmap.swizzle)]
    flat = x.view(np.uint8)
    for p in range(panels):
        for r in range(rows):
            row = c1 + r
            linear = (p * rows + r) * inner * 2
            for e in range(inner):
                col = (c2 + p) * inner + c0 + e
                if 0 <= row < x.shape[0] and 0 <= c3 < x.shape[1] and 0 <= col < x.shape[2]:
                    value = flat[row, c3, 2 * col: 2 * col + 2]
                else:
                    value = np.zeros(2, dtype=np.uint8)
                lin = linear + 2 * e
                phys = lin ^ (((lin >> 7) & mask) << 4)
                out[phys: phys + 2] = value
    return out


def run(kernel, tmap: TensorMap, coords: tuple[int, ...], *, expect: int | None = None,  # type: ignore[no-untyped-def]
        offset: int = 0, bug: int = 0, rank: int = 4,
        schedule: Schedule = Schedule.FORWARD) -> np.ndarray:
    nbytes = tmap.box_bytes
    out = np.full(nbytes, 0xEE, dtype=np.uint8)
    c = list(coords) + [0] * (4 - len(coords))
    args: list[Arg] = [(ArgType.TMAP, tmap), ptr(out), i32(nbytes), i32(rank),
                       *(i32(v) for v in c), i32(nbytes if expect is None else expect),
                       i32(offset), i32(bug)]
    kernel.launch(1, 128, args, smem_bytes=SMEM,
                  options=LaunchOptions(schedule=schedule, hang_timeout_s=60))
    return out


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize("swizzle", list(TmaSwizzle))
def test_box_lands_swizzled_with_zero_fill(kernel, swizzle: TmaSwizzle,  # type: ignore[no-untyped-def]
                                           schedule: Schedule) -> None:
    x = qkv_like(100, 3, 128, seed=int(swizzle))
    tmap = panel_map(x, 64, swizzle)
    # Rows 64..127 of head 2: rows 100.. are out of bounds (zero fill).
    coords = (0, 64, 0, 2)
    got = run(kernel, tmap, coords, schedule=schedule)
    np.testing.assert_array_equal(got, reference(x, tmap, coords))


def test_negative_and_past_the_end_coordinates_fill_zero(kernel) -> None:  # type: ignore[no-untyped-def]
    x = qkv_like(40, 2, 128, seed=7)
    tmap = panel_map(x, 64, TmaSwizzle.B128)
    for coords in [(0, -20, 0, 1), (0, 10, 1, 0), (0, 0, 0, 2)]:
        got = run(kernel, tmap, coords)
        np.testing.assert_array_equal(got, reference(x, tmap, coords), err_msg=str(coords))
    assert not run(kernel, tmap, (0, 0, 0, 2)).any()  # a head past the end: all zeros


def test_rank2_box(kernel) -> None:  # type: ignore[no-untyped-def]
    x = qkv_like(50, 1, 64, seed=3)
    tmap = TensorMap(TmaDType.FLOAT16, x.ctypes.data, (64, 50), (128,), (64, 32),
                     TmaSwizzle.B128)
    got = run(kernel, tmap, (0, 30), rank=2)
    want = reference(x, TensorMap(TmaDType.FLOAT16, x.ctypes.data, (64, 50, 1, 1),
                                  (128, 128, 128), (64, 32, 1, 1), TmaSwizzle.B128), (0, 30, 0, 0))
    np.testing.assert_array_equal(got, want)


def test_the_emulator_record_layout() -> None:
    x = qkv_like(8, 1, 64, seed=1)
    tmap = panel_map(x, 8, TmaSwizzle.B128)
    blob = encode_emulator(tmap)
    assert len(blob) == 128
    words = np.frombuffer(blob[:88], dtype="<u8")
    assert words[0] == 0x70616D726F736E74 and words[1] == x.ctypes.data
    assert list(words[2:6]) == [64, 8, 1, 1] and list(words[7:10]) == [128, 128, 128]
    assert list(np.frombuffer(blob[88:108], dtype="<u4")[:4]) == [64, 8, 1, 1]
    assert tuple(blob[108:112]) == (4, 2, 3, 0) and blob[117] == TmaDType.BFLOAT16


class _Planted(TypedDict, total=False):
    """Keywords of ``run`` that plant a bug."""

    offset: int
    bug: int
    expect: int


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"offset": 64}, r"tma_load at .*destination .* is not 128-byte aligned"),
    ({"bug": 1}, r"mbarrier_arrive at .*last arrival of phase 0 .* transaction bytes completed "
                 r"beyond those expected \(expect-tx 0\)"),
    ({"bug": 2, "expect": 4096}, r"last arrival of phase 0 .* 12288 transaction bytes completed "
                                 r"beyond"),
    ({"expect": 4096}, r"tma_load at .*complete 12288 more transaction bytes than phase 0"),
])
def test_planted_bugs_are_caught(kernel, kwargs: _Planted, pattern: str) -> None:  # type: ignore[no-untyped-def]
    x = qkv_like(100, 1, 128, seed=5)
    with pytest.raises(EmulatorError, match=pattern):
        run(kernel, panel_map(x, 64, TmaSwizzle.B128), (0, 0, 0, 0), **kwargs)


def test_too_few_bytes_is_a_deadlock_naming_barrier_and_phase(kernel) -> None:  # type: ignore[no-untyped-def]
    x = qkv_like(100, 1, 128, seed=6)
    with pytest.raises(EmulatorDeadlock, match=r"mbarrier at dynamic shared memory offset \d+ "
                       r".*phase 0 \(parity 0\).*transaction count 16"):
        run(kernel, panel_map(x, 64, TmaSwizzle.B128), (0, 0, 0, 0), expect=16384 + 16)


def test_the_emulator_decoder_checks_limits(kernel) -> None:  # type: ignore[no-untyped-def]
    """A record past the limits (built around the host-side checks) is refused on device."""
    x = qkv_like(400, 1, 64, seed=8)
    tmap = panel_map(x, 64, TmaSwizzle.B128)
    object.__setattr__(tmap, "box", (64, 300, 1, 1))
    with pytest.raises(EmulatorError, match=r"invalid tensor map: box dim 1 is 300 elements; "
                       r"expected 1..256"):
        run(kernel, tmap, (0, 0, 0, 0))


@pytest.mark.parametrize(("change", "pattern"), [
    ({"box": (64, 257, 2, 1)}, r"box dim 1 is 257; expected 1..256"),
    ({"box": (4, 64, 2, 1)}, r"inner box dim is 8 bytes .* multiple of 16"),
    ({"box": (128, 64, 1, 1)}, r"256 bytes, more than the 128-byte span of B128"),
    ({"strides": (24, 128, 256)}, r"stride of dim 1 is 24 bytes"),
    ({"address": 8}, r"16-byte aligned"),
])
def test_host_side_rules(change: dict[str, object], pattern: str) -> None:
    fields: dict[str, object] = {"dtype": TmaDType.BFLOAT16, "address": 1 << 20,
                                 "dims": (64, 100, 2, 1), "strides": (256, 128, 25600),
                                 "box": (64, 64, 2, 1), "swizzle": TmaSwizzle.B128}
    fields.update(change)
    with pytest.raises(InvalidInput, match=pattern):
        TensorMap(**fields)  # type: ignore[arg-type]


def _nvrtc_source() -> KernelSource:
    code = SOURCE
    headers = included_headers(code)
    digest = hashlib.sha256(code.encode() + repr(sorted(headers.items())).encode()).hexdigest()
    source = KernelSource(problem=Problem(head_dim=64, dtype=DType.FP16),
                          config=KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=1),
                          code=code, entry="tma_box", headers=headers,
                          options=("-std=c++17",), digest=digest, smem_bytes=SMEM, threads=128,
                          target="sm_90a")
    return source


def test_nvrtc_compiles_it_for_sm90a_into_utmaldg() -> None:
    """The GPU half of tma.cuh: the same kernel compiles for sm_90a into TMA loads."""
    kernel = compile_source(_nvrtc_source(), "sm_90")
    assert kernel.arch == "sm_90a" and kernel.resources.spill_bytes == 0
    if find_toolchain().nvdisasm is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    sass = disassemble(kernel.cubin)
    assert re.search(r"\bUTMALDG\.4D\b", sass) and re.search(r"\bUTMALDG\.2D\b", sass), sass[:2000]


@pytest.mark.gpu
@pytest.mark.parametrize("swizzle", [TmaSwizzle.NONE, TmaSwizzle.B128])
def test_a_driver_encoded_map_loads_the_same_box_on_a_gpu(swizzle: TmaSwizzle) -> None:
    """cuTensorMapEncodeTiled (through ctypes) and the CUtensorMap parameter on a real TMA:
    the bytes in shared memory equal the emulator's reference placement."""
    import torch

    from flashtune.runtime.backends.cuda import CudaBackend

    x = qkv_like(100, 3, 128, seed=11)
    on_gpu = torch.from_numpy(x.view(np.int16)).cuda()
    tmap = panel_map(x, 64, swizzle, address=on_gpu.data_ptr())
    coords = (0, 64, 0, 2)
    out = torch.full((tmap.box_bytes,), 0xEE, dtype=torch.uint8, device="cuda")
    kernel = CudaBackend().load(_nvrtc_source())
    kernel.launch((1, 1, 1), [(ArgType.TMAP, tmap), (ArgType.PTR, out.data_ptr()),
                              *(i32(v) for v in (tmap.box_bytes, 4, *coords, tmap.box_bytes, 0,
                                                 0))])
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out.cpu().numpy(), reference(x, panel_map(x, 64, swizzle),
                                                               coords))


def test_driver_encoding_without_a_driver_says_what_is_missing() -> None:
    """Where no CUDA driver is installed, encoding for the GPU fails with the reason."""
    import ctypes

    from flashtune.errors import DeviceError
    from flashtune.runtime.tma import encode_driver

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        x = qkv_like(8, 1, 64, seed=2)
        with pytest.raises(DeviceError, match=r"libcuda.so.1, with cuTensorMapEncodeTiled"):
            encode_driver(panel_map(x, 8, TmaSwizzle.B128))
    else:
        pytest.skip("a CUDA driver is installed (the gpu-marked test encodes with it)")
