"""wgmma.mma_async m64nNk32 with e4m3 / e5m2 operands (sm_90a) in the emulator: one warpgroup
computes D = A B^T (64 x N, K = 128 bytes, 4 k32 steps) from 128-byte-swizzled K-major shared
memory (SS) and with A from registers (RS), the registers packed here in NumPy from the PTX
ISA's 8-bit A fragment (written out below, independently of the emulator). The reference
decodes the codes with torch's float8 types (an independent conversion table) and models the
accumulation as mma.sync m16n8k32's: each k32 step's exact sum of products added to the
accumulator and rounded to float32 once, so the comparison is bit for bit. An MN-major 8-bit
operand is refused naming the fix. The device half compiles with NVRTC for sm_90a into FP8
GMMAs (SASS spells them QGMMA.64xNx32.F32.E4M3.E4M3 / .E5M2.E5M2, not HGMMA)."""

from __future__ import annotations

import collections
import hashlib
import re

import numpy as np
import pytest
import torch
from emu_helpers import sm90a_source

from flashtune.codegen.render import templates_dir
from flashtune.errors import EmulatorError
from flashtune.runtime.backends.emulator import (
    EmulatedModule,
    LaunchOptions,
    build_module,
    i32,
    ptr,
)
from flashtune.runtime.backends.emulator.kernel import Schedule
from flashtune.toolchain.compiler import compile_source
from flashtune.toolchain.cuda import find_toolchain
from flashtune.toolchain.disasm import disassemble

pytestmark = pytest.mark.emulator

SOURCE = r"""
#include "wgmma.cuh"

// a: (64 x 128) bytes [m][k]; b: (N x 128) bytes [n][k]; aregs: 4 k-steps x 128 threads x 4
// registers (A's fragment, used when mode == 1); d: (64 x N) f32.
// bug: 0 none, 1 B issued MN-major (imm-trans-b = 1, through the emulator's raw call).
template <int N, bool E5M2>
__device__ void gemm(const unsigned char* a, const unsigned char* b, const unsigned* aregs,
                     float* d, int mode, int bug) {
  FT_DYNAMIC_SMEM(unsigned char, raw);
  const unsigned window = ft::smem_address(raw);
  const unsigned pad = (1024u - (window & 1023u)) & 1023u;  // 128B swizzle: 1024-B aligned
  unsigned char* smem = raw + pad;
  const unsigned a_addr = window + pad, b_addr = a_addr + 64 * 128;
  const int tid = threadIdx.x;
  // 128-byte rows (128 8-bit elements), chunk c of row r at c ^ (r % 8)
  for (int i = tid; i < 64 * 8; i += 128) {
    int r = i / 8, c = i % 8;
    *reinterpret_cast<uint4*>(smem + r * 128 + ((c ^ (r % 8)) * 16)) =
        *reinterpret_cast<const uint4*>(a + r * 128 + c * 16);
  }
  unsigned char* bs = smem + 64 * 128;
  for (int i = tid; i < N * 8; i += 128) {
    int r = i / 8, c = i % 8;
    *reinterpret_cast<uint4*>(bs + r * 128 + ((c ^ (r % 8)) * 16)) =
        *reinterpret_cast<const uint4*>(b + r * 128 + c * 16);
  }
  ft::fence_proxy_async();
  __syncthreads();
  float acc[N / 2];
  ft::wgmma_fence();
#pragma unroll
  for (int s = 0; s < 4; ++s) {  // k32 steps: 32 bytes along the swizzled row each
    const unsigned long long bd = ft::wgmma_desc(b_addr + s * 32, 16, 1024, ft::kSwizzle128B);
#if defined(FLASHTUNE_EMULATOR)
    if (bug == 1) {
      ftemu_wgmma_args args{acc, nullptr, ft::wgmma_desc(a_addr + s * 32, 16, 1024,
                                                         ft::kSwizzle128B), bd, s > 0};
      ftemu_wgmma(N << 8 | FTEMU_WGMMA_E4M3 | FTEMU_WGMMA_TRANS_B, &args,
                  ::ftemu::to_loc(::ftemu::loc_t::current()));
      continue;
    }
#endif
    if (mode == 0) {
      ft::wgmma_ss_fp8<N, E5M2>(acc, ft::wgmma_desc(a_addr + s * 32, 16, 1024,
                                                    ft::kSwizzle128B), bd, s > 0);
    } else {
      const unsigned ar[4] = {aregs[(s * 128 + tid) * 4 + 0], aregs[(s * 128 + tid) * 4 + 1],
                              aregs[(s * 128 + tid) * 4 + 2], aregs[(s * 128 + tid) * 4 + 3]};
      ft::wgmma_rs_fp8<N, E5M2>(acc, ar, bd, s > 0);
    }
  }
  ft::wgmma_commit();
  ft::wgmma_wait<0>();
  ft::wgmma_fence_operands(acc);
  const int warp = tid / 32, lane = tid % 32;
#pragma unroll
  for (int v = 0; v < N / 2; ++v) {
    const int row = 16 * warp + lane / 4 + 8 * ((v >> 1) & 1);
    const int col = 8 * (v >> 2) + 2 * (lane % 4) + (v & 1);
    d[row * N + col] = acc[v];
  }
}

#define GEMM_ENTRY(name, N, E5M2)                                                          \
  extern "C" __global__ void name(const unsigned char* a, const unsigned char* b,           \
                                  const unsigned* aregs, float* d, int mode, int bug) {     \
    gemm<N, E5M2>(a, b, aregs, d, mode, bug);                                                \
  }
GEMM_ENTRY(gemm8_n64_e4m3, 64, false)
GEMM_ENTRY(gemm8_n128_e4m3, 128, false)
GEMM_ENTRY(gemm8_n256_e4m3, 256, false)
GEMM_ENTRY(gemm8_n176_e4m3, 176, false)
GEMM_ENTRY(gemm8_n64_e5m2, 64, true)
"""

ENTRIES = {"gemm8_n64_e4m3": (64, "e4m3"), "gemm8_n128_e4m3": (128, "e4m3"),
           "gemm8_n256_e4m3": (256, "e4m3"),
           # FA3's FP8 key tile is not a power of two (224); 176 covers the same descriptor walk
           "gemm8_n176_e4m3": (176, "e4m3"), "gemm8_n64_e5m2": (64, "e5m2")}

TORCH_TYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@pytest.fixture(scope="module")
def module() -> EmulatedModule:
    return build_module(SOURCE, list(ENTRIES), include_dirs=[templates_dir()])


def decode(codes: np.ndarray, fmt: str) -> np.ndarray:
    """float64 values of FP8 codes through torch's float8 types (not the emulator's tables)."""
    return torch.from_numpy(codes).view(TORCH_TYPE[fmt]).to(torch.float64).numpy()


def random_codes(rng: np.random.Generator, shape: tuple[int, int], fmt: str) -> np.ndarray:
    """e4m3: uniformly random codes over the whole finite table (denormals to +-448, both
    zeros); e5m2: normal values cast to e5m2 (its full range would overflow float32 sums)."""
    if fmt == "e4m3":
        codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
        out: np.ndarray = np.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes).astype(np.uint8)
        return out
    t = torch.from_numpy(rng.standard_normal(shape) * 8).to(torch.float8_e5m2)
    e5m2: np.ndarray = t.view(torch.uint8).numpy().copy()
    return e5m2


def a_register_coords(thread: int, reg: int, byte: int) -> tuple[int, int]:
    """(row, k) of byte `byte` of A register `reg` of warpgroup thread `thread` in a k32 step
    (PTX ISA, wgmma .m64nNk32 A fragment for 8-bit types): warp w owns rows 16w..16w+15."""
    warp, lane = divmod(thread, 32)
    return 16 * warp + lane // 4 + 8 * (reg % 2), 4 * (lane % 4) + 16 * (reg // 2) + byte


def a_registers(a: np.ndarray) -> np.ndarray:
    """4 k-steps x 128 threads x 4 registers of the byte codes a (64 x 128)."""
    regs = np.zeros((4, 128, 4), dtype=np.uint32)
    for s in range(4):
        for thread in range(128):
            for reg in range(4):
                word = 0
                for byte in range(4):
                    row, k = a_register_coords(thread, reg, byte)
                    word |= int(a[row, 32 * s + k]) << (8 * byte)
                regs[s, thread, reg] = word
    return regs


def accumulate(a_vals: np.ndarray, b_vals: np.ndarray) -> np.ndarray:
    """The accumulator after 4 k32 steps: each step's sum of FP8 products is exact in float64
    (e4m3 products are multiples of 2^-18 below 2^18), added to the float32 accumulator in
    float64 and rounded to float32 once."""
    d = np.zeros((a_vals.shape[0], b_vals.shape[0]), dtype=np.float32)
    for s in range(4):
        step = a_vals[:, 32 * s:32 * s + 32] @ b_vals[:, 32 * s:32 * s + 32].T
        d = (step + d.astype(np.float64)).astype(np.float32)
    return d


def _run(module: EmulatedModule, entry: str, mode: int, bug: int, seed: int,
         schedule: Schedule = Schedule.FORWARD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, fmt = ENTRIES[entry]
    rng = np.random.default_rng(seed)
    a = random_codes(rng, (64, 128), fmt)
    b = random_codes(rng, (n, 128), fmt)
    regs = a_registers(a)  # held here: ptr() keeps no reference to its array
    d = np.full((64, n), np.nan, dtype=np.float32)
    smem = 1024 + 64 * 128 + n * 128
    module[entry].launch(1, 128, [ptr(a), ptr(b), ptr(regs), ptr(d), i32(mode), i32(bug)],
                         smem_bytes=smem, options=LaunchOptions(schedule=schedule))
    a_vals, b_vals = decode(a, fmt), decode(b, fmt)
    return d, accumulate(a_vals, b_vals), a_vals @ b_vals.T


@pytest.mark.parametrize("schedule", list(Schedule))
@pytest.mark.parametrize("mode", [0, 1], ids=["ss", "rs"])
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_fp8_wgmma_is_bit_exact(module: EmulatedModule, entry: str, mode: int,
                                schedule: Schedule) -> None:
    seed = int.from_bytes(hashlib.sha256(f"{entry}{mode}{schedule}".encode()).digest()[:4], "big")
    d, exact_model, float64 = _run(module, entry, mode, 0, seed, schedule)
    assert np.isfinite(d).all(), f"seed {seed}: unwritten or poisoned accumulators"
    mismatch = np.argwhere(d.view(np.uint32) != exact_model.view(np.uint32))
    assert mismatch.size == 0, f"seed {seed}: {len(mismatch)} elements differ, first {mismatch[0]}"
    # and within 4 float32 roundings of the float64 product
    scale = np.abs(float64).max()
    assert np.abs(d - float64).max() <= 4 * 2.0**-24 * scale * 4, f"seed {seed}"


def test_fp8_register_layout_is_not_the_16bit_one(module: EmulatedModule) -> None:
    """Registers packed in the 16-bit map (element pairs in accumulator order) give a wrong
    product: the test would see a fragment-layout bug."""
    rng = np.random.default_rng(5)
    a = random_codes(rng, (64, 128), "e4m3")
    b = random_codes(rng, (64, 128), "e4m3")
    regs = a_registers(a)
    swapped = regs[:, :, [0, 2, 1, 3]].copy()  # rows g / g + 8 exchanged with k halves
    d = np.full((64, 64), np.nan, dtype=np.float32)
    module["gemm8_n64_e4m3"].launch(1, 128, [ptr(a), ptr(b), ptr(swapped), ptr(d), i32(1),
                                             i32(0)], smem_bytes=1024 + 2 * 64 * 128)
    assert not np.array_equal(d, accumulate(decode(a, "e4m3"), decode(b, "e4m3")))


def test_e4m3_nan_code_propagates(module: EmulatedModule) -> None:
    a = np.full((64, 128), 0x38, dtype=np.uint8)  # 1.0
    b = np.full((64, 128), 0x38, dtype=np.uint8)
    a[17, 100] = 0x7F  # NaN in row 17
    regs = a_registers(a)
    for mode in (0, 1):
        d = np.zeros((64, 64), dtype=np.float32)
        module["gemm8_n64_e4m3"].launch(1, 128, [ptr(a), ptr(b), ptr(regs), ptr(d),
                                                 i32(mode), i32(0)],
                                        smem_bytes=1024 + 2 * 64 * 128)
        assert np.isnan(d[17]).all() and (np.delete(d, 17, axis=0) == 128.0).all(), mode


def test_mn_major_fp8_operand_is_refused(module: EmulatedModule) -> None:
    with pytest.raises(EmulatorError, match=r"m64nNk32 e4m3 wgmma with imm-trans-b = 1; 8-bit "
                       r"operands must be K-major .*ldmatrix\.trans / stmatrix"):
        _run(module, "gemm8_n64_e4m3", 0, 1, seed=3)


def test_nvrtc_compiles_it_for_sm90a_into_fp8_gmma() -> None:
    kernel = compile_source(sm90a_source(SOURCE, "gemm8_n128_e4m3"), "sm_90")
    assert kernel.arch == "sm_90a" and kernel.resources.spill_bytes == 0
    if find_toolchain().nvdisasm is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    sass = disassemble(kernel.cubin)  # the whole module: all five kernels
    found = collections.Counter(
        re.findall(r"\bQGMMA\.(64x\d+x32\.F32\.E[45]M[23]\.E[45]M[23])\b", sass))
    # each kernel: 4 k-steps from shared memory and 4 with A from registers
    assert found == {"64x64x32.F32.E4M3.E4M3": 8, "64x128x32.F32.E4M3.E4M3": 8,
                     "64x256x32.F32.E4M3.E4M3": 8, "64x176x32.F32.E4M3.E4M3": 8,
                     "64x64x32.F32.E5M2.E5M2": 8}, found
    # FP8 wgmma is QGMMA in SASS; the only HGMMA ptxas adds is its zero-register
    # 64x8x16 drain at the end of each warpgroup MMA sequence (it writes RZ), never a 16-bit
    # product of the operands
    assert set(re.findall(r"\bHGMMA\.\S+ (\w+),", sass)) <= {"RZ"}
