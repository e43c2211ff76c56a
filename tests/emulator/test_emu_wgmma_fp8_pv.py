"""The FP8 forward's on-chip steps on sm_90a (templates/hopper_fp8.cuh) in the emulator: one
warpgroup computes S = Q K^T by FP8 wgmma (e4m3, both operands K-major), P = e4m3(S * scale)
packed from the S accumulators into the 8-bit A registers with no value leaving its thread,
V (key rows as TMA lands them, 128-byte swizzled) transposed in shared memory into the
K-major V^T whose key order matches P's registers, and O = P V by FP8 wgmma from registers.
Compared bit for bit with NumPy: torch's e4m3 casts (an independent conversion table), and
each k32 step's exact sum of products added to the float32 accumulator and rounded once.
The key permutation itself is checked against its definition, and a V^T written in natural
key order is shown to give a wrong O (so the test sees the permutation)."""

from __future__ import annotations

import collections
import re

import numpy as np
import pytest
import torch
from emu_helpers import sm90a_source

from flashtune.codegen.render import templates_dir
from flashtune.runtime.backends.emulator import EmulatedModule, build_module, f32, i32, ptr
from flashtune.toolchain.compiler import compile_source
from flashtune.toolchain.cuda import find_toolchain
from flashtune.toolchain.disasm import disassemble

pytestmark = pytest.mark.emulator

SOURCE = r"""
#include "hopper_fp8.cuh"
#include "wgmma.cuh"

// q: (64 x 128) e4m3 [m][d]; k, v: (128 x 128) e4m3 [key][d]; s, o: (64 x 128) f32.
// natural: 1 writes V^T in natural key order (a planted bug: P's registers are permuted).
extern "C" __global__ void qk_pv(const unsigned char* q, const unsigned char* k,
                                 const unsigned char* v, float* s_out, float* o_out,
                                 float p_scale, int natural) {
  FT_DYNAMIC_SMEM(unsigned char, raw);
  const unsigned window = ft::smem_address(raw);
  const unsigned pad = (1024u - (window & 1023u)) & 1023u;
  unsigned char* smem = raw + pad;
  unsigned char* sq = smem;
  unsigned char* sk = sq + 64 * 128;
  unsigned char* sv = sk + 128 * 128;
  unsigned char* svt = sv + 128 * 128;
  const unsigned q_addr = window + pad, k_addr = q_addr + 64 * 128;
  const unsigned vt_addr = k_addr + 2 * 128 * 128;
  const int tid = threadIdx.x;
  for (int i = tid; i < 64 * 8; i += 128) {
    const int r = i / 8, c = i % 8;
    *reinterpret_cast<uint4*>(sq + ft::swizzled_byte(64, r, 16 * c)) =
        *reinterpret_cast<const uint4*>(q + r * 128 + 16 * c);
  }
  for (int i = tid; i < 128 * 8; i += 128) {
    const int r = i / 8, c = i % 8;
    *reinterpret_cast<uint4*>(sk + ft::swizzled_byte(128, r, 16 * c)) =
        *reinterpret_cast<const uint4*>(k + r * 128 + 16 * c);
    *reinterpret_cast<uint4*>(sv + ft::swizzled_byte(128, r, 16 * c)) =
        *reinterpret_cast<const uint4*>(v + r * 128 + 16 * c);
  }
  __syncthreads();
  if (natural) {
    for (int i = tid; i < 128 * 128; i += 128) {
      const int key = i / 128, d = i % 128;
      svt[ft::swizzled_byte(128, d, key)] = sv[ft::swizzled_byte(128, key, d)];
    }
  } else {
    ft::transpose_v_fp8<128, 128, 128>(sv, svt, tid);
  }
  ft::fence_proxy_async();
  __syncthreads();
  float acc_s[64];
  ft::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    ft::wgmma_ss_fp8<128, false>(
        acc_s, ft::wgmma_desc(q_addr + 32 * ks, 16, 1024, ft::kSwizzle128B),
        ft::wgmma_desc(k_addr + 32 * ks, 16, 1024, ft::kSwizzle128B), ks > 0);
  }
  ft::wgmma_commit();
  ft::wgmma_wait<0>();
  ft::wgmma_fence_operands(acc_s);
  const int warp = tid / 32, lane = tid % 32;
  float scaled[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    const int row = 16 * warp + lane / 4 + 8 * ((i >> 1) & 1);
    const int col = 8 * (i >> 2) + 2 * (lane % 4) + (i & 1);
    s_out[row * 128 + col] = acc_s[i];
    scaled[i] = acc_s[i] * p_scale;
  }
  unsigned p[4][4];
  ft::fp8_p_registers<128, false>(scaled, p);
  float acc_o[64];
  ft::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    ft::wgmma_rs_fp8<128, false>(acc_o, p[kk],
                                 ft::wgmma_desc(vt_addr + 32 * kk, 16, 1024, ft::kSwizzle128B),
                                 kk > 0);
  }
  ft::wgmma_commit();
  ft::wgmma_wait<0>();
  ft::wgmma_fence_operands(acc_o);
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    const int row = 16 * warp + lane / 4 + 8 * ((i >> 1) & 1);
    const int col = 8 * (i >> 2) + 2 * (lane % 4) + (i & 1);
    o_out[row * 128 + col] = acc_o[i];
  }
}
"""

SMEM = 1024 + 64 * 128 + 3 * 128 * 128


@pytest.fixture(scope="module")
def module() -> EmulatedModule:
    return build_module(SOURCE, ["qk_pv"], include_dirs=[templates_dir()])


def e4m3(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The e4m3 codes of float values by torch's cast and their float64 values."""
    t = torch.from_numpy(x).to(torch.float8_e4m3fn)
    return t.view(torch.uint8).numpy().copy(), t.to(torch.float64).numpy()


def k32_model(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A (m x K) times B (n x K)^T as the FP8 wgmma chain forms it: per k32 step the exact
    sum of products, added to the float32 accumulator in float64 and rounded once."""
    d = np.zeros((a.shape[0], b.shape[0]), dtype=np.float32)
    for s in range(a.shape[1] // 32):
        step = a[:, 32 * s:32 * s + 32] @ b[:, 32 * s:32 * s + 32].T
        d = (step + d.astype(np.float64)).astype(np.float32)
    return d


def key_of_position(p: int) -> int:
    """The PTX layouts' reason for the permutation, spelled from the two fragment maps: A
    position 16 h + 4 t + j of thread t (PTX ISA, 8-bit A) takes the accumulator it holds in
    n8 block 2 h + j // 2, column 2 t + j % 2 (the f32 D map)."""
    h, t, j = p // 16, (p % 16) // 4, p % 4
    return 8 * (2 * h + j // 2) + 2 * t + j % 2


def test_key_order_is_a_permutation() -> None:
    order = [key_of_position(p) for p in range(32)]
    assert sorted(order) == list(range(32))
    assert order[:8] == [0, 1, 8, 9, 2, 3, 10, 11]


def _run(module: EmulatedModule, seed: int, natural: int = 0
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q, qv = e4m3(rng.standard_normal((64, 128)).astype(np.float32))
    k, kv = e4m3(rng.standard_normal((128, 128)).astype(np.float32))
    v, vv = e4m3((rng.standard_normal((128, 128)) * 4).astype(np.float32))
    s_model = k32_model(qv, kv)
    # P within e4m3's range (torch's cast does not saturate): a power of two keeps it exact
    p_scale = float(2.0 ** np.floor(np.log2(400.0 / np.abs(s_model).max())))
    s = np.full((64, 128), np.nan, dtype=np.float32)
    o = np.full((64, 128), np.nan, dtype=np.float32)
    module["qk_pv"].launch(1, 128, [ptr(q), ptr(k), ptr(v), ptr(s), ptr(o), f32(p_scale),
                                    i32(natural)], smem_bytes=SMEM)
    _, pv = e4m3((s_model * np.float32(p_scale)).astype(np.float32))
    return s, s_model, o, k32_model(pv, vv.T.copy())


@pytest.mark.parametrize("seed", [20260, 20261])
def test_qk_p_and_pv_are_bit_exact(module: EmulatedModule, seed: int) -> None:
    s, s_model, o, o_model = _run(module, seed)
    assert np.isfinite(s).all() and np.isfinite(o).all(), f"seed {seed}: unwritten elements"
    assert np.array_equal(s.view(np.uint32), s_model.view(np.uint32)), f"seed {seed}: S"
    assert np.array_equal(o.view(np.uint32), o_model.view(np.uint32)), f"seed {seed}: O"


def test_natural_key_order_in_vt_is_wrong(module: EmulatedModule) -> None:
    _, _, o, o_model = _run(module, 20262, natural=1)
    assert np.isfinite(o).all()
    assert np.abs(o - o_model).max() > 1.0


def test_nvrtc_sm90a_issues_fp8_gmmas_and_no_shuffles() -> None:
    kernel = compile_source(sm90a_source(SOURCE, "qk_pv"), "sm_90")
    assert kernel.arch == "sm_90a" and kernel.resources.spill_bytes == 0
    if find_toolchain().nvdisasm is None:
        pytest.skip("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm)")
    sass = disassemble(kernel.cubin)
    found = collections.Counter(re.findall(r"\bQGMMA\.(64x\d+x32\.F32\.E4M3\.E4M3)\b", sass))
    assert found == {"64x128x32.F32.E4M3.E4M3": 8}, found
    # P reaches the A registers in place: no value moves between threads
    assert "SHFL" not in sass
    assert re.search(r"\bF2FP\.SATFINITE\.E4M3\.F32\.PACK_AB", sass)
