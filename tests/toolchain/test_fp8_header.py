"""templates/fp8.cuh's GPU half goes through NVRTC and ptxas for the archs that have the FP8
conversions (sm_89 and later), and is refused for sm_80, which has none."""

from __future__ import annotations

from pathlib import Path

import pytest

import flashtune.templates
from flashtune.toolchain import nvrtc
from flashtune.toolchain.cuda import Toolchain

KERNEL = r'''
#include <cuda_fp16.h>
#include "fp8.cuh"
extern "C" __global__ void k(const float* x, unsigned short* y, float* z) {
  const int i = threadIdx.x;
  const unsigned short a = ft::cvt_e4m3x2_f32(x[2 * i], x[2 * i + 1]);
  const unsigned short b = ft::cvt_e5m2x2_f32(x[2 * i], x[2 * i + 1]);
  y[4 * i] = a;
  y[4 * i + 1] = b;
  y[4 * i + 2] = ft::cvt_e4m3x2_f16x2(__float_as_uint(x[i]));
  y[4 * i + 3] = ft::cvt_e5m2x2_f16x2(__float_as_uint(x[i]));
  float lo, hi;
  ft::e4m3x2_to_float2(a, lo, hi);
  z[2 * i] = lo + hi;
  ft::e5m2x2_to_float2(b, lo, hi);
  z[2 * i + 1] = lo + hi;
}
'''


@pytest.mark.parametrize("arch, ok", [("sm_89", True), ("sm_90", True), ("sm_80", False)])
def test_fp8_conversions_compile_where_the_arch_has_them(toolchain: Toolchain, arch: str,
                                                        ok: bool) -> None:
    templates = Path(flashtune.templates.__file__).parent
    result = nvrtc.load(toolchain.nvrtc_path).compile(
        KERNEL, "fp8_probe.cu", {},
        [f"--gpu-architecture={arch}", f"-I{templates}", f"-I{toolchain.include_dir}",
         "-std=c++17"])
    assert result.ok is ok, result.log
    if not ok:
        assert "requires .target sm_89 or higher" in result.log
    else:
        assert "cvt.rn.satfinite.e4m3x2.f32" in result.ptx
        assert "cvt.rn.f16x2.e5m2x2" in result.ptx
