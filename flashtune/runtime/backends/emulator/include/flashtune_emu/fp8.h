// The emulator's implementation of the FP8 conversions of flashtune/templates/fp8.cuh: the
// cvt instructions modelled bit for bit from their PTX definition (round to nearest even,
// satfinite, canonical NaNs, denormals), written from the OCP FP8 formats themselves rather
// than from the CUDA header's host path (whose satfinite NaN keeps the input's sign).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>

#include "flashtune_emu/runtime.h"

namespace ft {
namespace fp8_detail {

// One OCP FP8 format: mantissa bits, exponent bias, the code of its largest finite value.
struct Format {
    int man;
    int bias;
    unsigned max_code;
};
inline constexpr Format kE4M3{3, 7, 0x7Eu};
inline constexpr Format kE5M2{2, 15, 0x7Bu};

// The value of a non-NaN code's magnitude bits (exact in double).
inline double magnitude(Format f, unsigned code) {
    const int e = static_cast<int>((code & 0x7Fu) >> f.man);
    const unsigned m = code & ((1u << f.man) - 1u);
    if (e == 0) return std::ldexp(static_cast<double>(m), 1 - f.bias - f.man);
    return std::ldexp(static_cast<double>((1u << f.man) | m), e - f.bias - f.man);
}

// cvt.rn.satfinite to format f of one float.
inline unsigned char to_fp8_satfinite(Format f, float x) {
    if (std::isnan(x)) return 0x7F;  // the canonical NaN, whatever the input's sign
    const unsigned sign = std::signbit(x) ? 0x80u : 0u;
    const double a = std::fabs(static_cast<double>(x));
    const double max = magnitude(f, f.max_code);
    if (a >= max) return static_cast<unsigned char>(sign | f.max_code);  // incl. infinity
    // The spacing of the grid around a: the denormal spacing below the smallest normal.
    const int emin = 1 - f.bias;
    const int e = a == 0.0 ? emin : std::max(std::ilogb(a), emin);
    const double quantum = std::ldexp(1.0, e - f.man);
    // a / quantum is exact (a power-of-two scaling); nearbyint rounds half to even under the
    // default rounding mode, which the emulator never changes.
    const double r = std::nearbyint(a / quantum) * quantum;
    if (r >= max) return static_cast<unsigned char>(sign | f.max_code);
    unsigned code;
    if (r < std::ldexp(1.0, emin)) {
        code = static_cast<unsigned>(r / std::ldexp(1.0, emin - f.man));  // denormal or zero
    } else {
        const int er = std::ilogb(r);
        const unsigned m = static_cast<unsigned>(r / std::ldexp(1.0, er - f.man)) -
                           (1u << f.man);
        code = (static_cast<unsigned>(er + f.bias) << f.man) | m;
    }
    return static_cast<unsigned char>(sign | code);
}

// cvt.rn.f16 of one FP8 code: exact; NaN becomes 0x7FFF, e5m2's infinity stays one.
inline unsigned short to_half_bits(Format f, unsigned code) {
    const unsigned sign = code & 0x80u;
    const unsigned mag = code & 0x7Fu;
    const bool e5m2 = f.man == 2;
    if (e5m2 && mag > 0x7Cu) return 0x7FFF;
    if (!e5m2 && mag == 0x7Fu) return 0x7FFF;
    if (e5m2 && mag == 0x7Cu) return static_cast<unsigned short>((sign << 8) | 0x7C00u);
    __half h = __double2half(magnitude(f, mag));  // exact: every FP8 value is a half
    unsigned short bits;
    std::memcpy(&bits, &h, 2);
    return static_cast<unsigned short>(bits | (sign << 8));
}

inline float half_bits_to_float(unsigned short bits) {
    __half_raw r;
    r.x = bits;
    return __half2float(__half(r));
}

inline unsigned short pack(unsigned char lo, unsigned char hi) {
    return static_cast<unsigned short>(lo | (static_cast<unsigned>(hi) << 8));
}

}  // namespace fp8_detail

__device__ inline unsigned short cvt_e4m3x2_f32(float lo, float hi) {
    using namespace fp8_detail;
    return pack(to_fp8_satfinite(kE4M3, lo), to_fp8_satfinite(kE4M3, hi));
}
__device__ inline unsigned short cvt_e5m2x2_f32(float lo, float hi) {
    using namespace fp8_detail;
    return pack(to_fp8_satfinite(kE5M2, lo), to_fp8_satfinite(kE5M2, hi));
}
// From f16x2: each half is exactly a float, so the rounding is the one of the float path.
__device__ inline unsigned short cvt_e4m3x2_f16x2(unsigned h2) {
    using namespace fp8_detail;
    return cvt_e4m3x2_f32(half_bits_to_float(static_cast<unsigned short>(h2 & 0xffffu)),
                          half_bits_to_float(static_cast<unsigned short>(h2 >> 16)));
}
__device__ inline unsigned short cvt_e5m2x2_f16x2(unsigned h2) {
    using namespace fp8_detail;
    return cvt_e5m2x2_f32(half_bits_to_float(static_cast<unsigned short>(h2 & 0xffffu)),
                          half_bits_to_float(static_cast<unsigned short>(h2 >> 16)));
}
__device__ inline unsigned cvt_f16x2_e4m3x2(unsigned short v) {
    using namespace fp8_detail;
    return to_half_bits(kE4M3, v & 0xffu) |
           (static_cast<unsigned>(to_half_bits(kE4M3, v >> 8)) << 16);
}
__device__ inline unsigned cvt_f16x2_e5m2x2(unsigned short v) {
    using namespace fp8_detail;
    return to_half_bits(kE5M2, v & 0xffu) |
           (static_cast<unsigned>(to_half_bits(kE5M2, v >> 8)) << 16);
}

}  // namespace ft
