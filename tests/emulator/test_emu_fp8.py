"""FP8 conversions (templates/fp8.cuh) in the emulator against an independent table: every
code of e4m3 and e5m2 decoded by the OCP FP8 formula, every float32 boundary case (codes,
midpoints and their float32 neighbours, overflow, underflow, infinities, NaNs) encoded by
nearest-even search over that table, and torch's float8 casts where they follow the spec."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashtune.codegen.render import templates_dir
from flashtune.runtime.backends.emulator import EmulatedModule, build_module, i32, ptr

pytestmark = pytest.mark.emulator

SOURCE = r"""
#include "fp8.cuh"
extern "C" __global__ void to_fp8(const float* x, unsigned short* out, int n, int e5m2) {
  for (int i = 0; i < n; i += 2)
    out[i / 2] = e5m2 ? ft::cvt_e5m2x2_f32(x[i], x[i + 1]) : ft::cvt_e4m3x2_f32(x[i], x[i + 1]);
}
extern "C" __global__ void to_half(const unsigned short* v, unsigned* out, int n, int e5m2) {
  for (int i = 0; i < n; ++i)
    out[i] = e5m2 ? ft::cvt_f16x2_e5m2x2(v[i]) : ft::cvt_f16x2_e4m3x2(v[i]);
}
"""

FORMATS = {"e4m3": (3, 7), "e5m2": (2, 15)}


def decode(fmt: str, code: int) -> float:
    """The OCP FP8 value of one code."""
    man, bias = FORMATS[fmt]
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code & 0x7F) >> man, code & ((1 << man) - 1)
    if fmt == "e4m3" and e == 15 and m == 7:
        return math.nan
    if fmt == "e5m2" and e == 31:
        return math.nan if m else sign * math.inf
    if e == 0:
        return sign * m * 2.0 ** (1 - bias - man)
    return float(sign * (1 + m / 2**man) * 2.0 ** (e - bias))


def finite_codes(fmt: str) -> list[tuple[float, int]]:
    return sorted((decode(fmt, c), c) for c in range(128) if math.isfinite(decode(fmt, c)))


def encode_satfinite(fmt: str, x: float) -> int:
    """Nearest finite code (ties to the even code), magnitudes clamped; NaN -> 0x7F."""
    if math.isnan(x):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    table = finite_codes(fmt)
    a = min(abs(x), table[-1][0])
    best = min(table, key=lambda vc: (abs(vc[0] - a), vc[1] & 1))
    return sign | best[1]


def boundary_inputs(fmt: str) -> np.ndarray:
    vals = [v for v, _ in finite_codes(fmt)]
    xs: list[float] = [math.inf, -math.inf, math.nan, -math.nan, 0.0, -0.0, 3.4e38, 1e-45]
    for lo, hi in zip(vals, vals[1:] + [vals[-1] * 2], strict=True):
        mid = np.float32((lo + hi) / 2)
        xs += [lo, float(mid), float(np.nextafter(mid, np.float32(0))),
               float(np.nextafter(mid, np.float32(np.inf)))]
    xs += [vals[1] / 2, vals[1] / 4, float(np.nextafter(np.float32(vals[1] / 2), np.float32(1)))]
    arr = np.array(xs, dtype=np.float32)
    arr = np.concatenate([arr, -arr, np.random.default_rng().standard_normal(256).astype(
        np.float32) * np.float32(vals[-1] / 4)])
    return arr if len(arr) % 2 == 0 else np.append(arr, np.float32(1.0))


@pytest.fixture(scope="module")
def module() -> EmulatedModule:
    return build_module(SOURCE, ["to_fp8", "to_half"], include_dirs=[templates_dir()])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_code_decodes_to_its_ocp_value(module: EmulatedModule, fmt: str) -> None:
    codes = np.arange(0, 256, 2, dtype=np.uint32)
    packed = (codes | ((codes + 1) << 8)).astype(np.uint16)
    out = np.full(len(packed), 0xFFFFFFFF, dtype=np.uint32)
    module["to_half"].launch(1, 1, [ptr(packed), ptr(out), i32(len(packed)), i32(fmt == "e5m2")])
    halves = np.stack([out & 0xFFFF, out >> 16], axis=1).reshape(-1).astype(np.uint16)
    for code in range(256):
        want = decode(fmt, code)
        got = halves[code]
        if math.isnan(want):
            assert got == 0x7FFF, (fmt, hex(code), hex(got))
        else:
            assert got.view(np.float16) == np.float16(want), (fmt, hex(code))
            assert (got >> 15) == (code >> 7), (fmt, hex(code))  # signed zeros keep their sign


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_float_to_fp8_satfinite_matches_the_table(module: EmulatedModule, fmt: str) -> None:
    x = boundary_inputs(fmt)
    out = np.full(len(x) // 2, 0xAAAA, dtype=np.uint16)
    module["to_fp8"].launch(1, 1, [ptr(x), ptr(out), i32(len(x)), i32(fmt == "e5m2")])
    got = np.stack([out & 0xFF, out >> 8], axis=1).reshape(-1)
    want = np.array([encode_satfinite(fmt, float(v)) for v in x])
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(float(x[i]), hex(got[i]), hex(want[i])) for i in bad[:8]]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_torch_casts_agree_on_the_finite_in_range_inputs(fmt: str) -> None:
    x = boundary_inputs(fmt)
    table = finite_codes(fmt)
    keep = np.isfinite(x) & (np.abs(x) <= table[-1][0])  # torch does not saturate
    tdt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    got = torch.from_numpy(x[keep]).to(tdt).view(torch.uint8).numpy()
    want = np.array([encode_satfinite(fmt, float(v)) for v in x[keep]])
    assert (got == want).all()
