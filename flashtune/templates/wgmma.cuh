// sm_90a primitives of flashtune kernels: wgmma.mma_async (f32 accumulators; m64nNk16 with
// f16/bf16 operands, m64nNk32 with e4m3/e5m2 operands, which must both be K-major) with 64-bit shared-memory matrix descriptors, its fence / commit / wait,
// and fence.proxy.async. Kernels that include this header compile for sm_90a only (the
// family sets KernelSource.target); under FLASHTUNE_EMULATOR the emulator's implementation
// (flashtune_emu/hopper.h) replaces the GPU half, signature for signature.
//
// Contract (the Hopper notes, sections 2.1-2.4 and 6.1):
//   * a warpgroup is 4 consecutive warps; every thread of it executes each call (.aligned);
//   * accumulator d[v] of thread 32w + L is D[16w + L/4 + 8((v>>1)&1)][8(v>>2) + 2(L%4) + (v&1)];
//     the register A operand (RS) uses the same map with N = 16, two 16-bit values per register;
//     for 8-bit types (k32) register r holds bytes k = 4(L%4) + 16(r/2) + 0..3 of row
//     16w + L/4 + 8(r%2), as mma.m16n8k32's A;
//   * wgmma_fence before the first wgmma and after the accumulators or A registers were
//     touched; wgmma_commit closes a group; wgmma_wait<N> returns when at most N groups are
//     pending; the accumulators must not be read before the wait that covers them;
//   * shared memory written by threads must be followed by fence_proxy_async before a wgmma
//     reads it.
#pragma once

#include "primitives.cuh"

namespace ft {

// Matrix-descriptor swizzle modes (bits 63..62).
enum WgmmaSwizzle : int { kSwizzleNone = 0, kSwizzle128B = 1, kSwizzle64B = 2, kSwizzle32B = 3 };

// The 64-bit descriptor of a shared-memory operand: start address, leading and stride byte
// offsets (each encoded as (x & 0x3FFFF) >> 4) and the swizzle mode; base offset 0 (the
// swizzle pattern starts on its repeat boundary: 1024 B for 128B swizzle).
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned smem_addr, unsigned lbo_bytes,
                                                         unsigned sbo_bytes, int swizzle) {
  return static_cast<unsigned long long>((smem_addr & 0x3FFFFu) >> 4) |
         static_cast<unsigned long long>((lbo_bytes & 0x3FFFFu) >> 4) << 16 |
         static_cast<unsigned long long>((sbo_bytes & 0x3FFFFu) >> 4) << 32 |
         static_cast<unsigned long long>(swizzle & 3) << 62;
}

// ``desc`` moved on by ``bytes`` (a multiple of 16): its start-address field grows by
// bytes / 16, one integer add (an immediate where ``bytes`` is a constant), so a kernel builds
// each buffer's descriptor once and advances it per k-step (FA3's 2 uniform instructions per
// HGMMA instead of a descriptor built per call). Exact while the moved address stays in the
// 256 KiB shared window: the 14-bit field cannot carry into the reserved bits above it.
__device__ __forceinline__ unsigned long long wgmma_desc_add(unsigned long long desc,
                                                             unsigned bytes) {
  return desc + (bytes >> 4);
}

}  // namespace ft

#if defined(FLASHTUNE_EMULATOR)
#include "flashtune_emu/hopper.h"
#else

namespace ft {

// Shared-window address of a generic pointer into shared memory (descriptor start addresses).
__device__ __forceinline__ unsigned smem_address(const void* p) { return detail::smem_u32(p); }

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  static_assert(N >= 0 && N <= 7, "wgmma.wait_group N: 0..7");
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Ties the accumulators to this point, so the compiler neither reads them before a wait nor
// moves their updates across a fence.
template <int R>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

namespace detail {

// The inline asm of wgmma m64nNk16 for each N that is a multiple of 16 (16..256), spelled
// by the macros below (the FT_WG_ prefix belongs to this header): FT_WG_OUT_R lists the
// R = N / 2 accumulator operands, FT_WG_REG_R names them in the PTX (%0 .. %R-1) and
// FT_WG_NEXT_R numbers the six operands after them.
#define FT_WG_STR_(x) #x
#define FT_WG_STR(x) FT_WG_STR_(x)
#define FT_WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                    "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define FT_WG_OUT_8 FT_WG_D8(0)
#define FT_WG_OUT_16 FT_WG_OUT_8, FT_WG_D8(8)
#define FT_WG_OUT_24 FT_WG_OUT_16, FT_WG_D8(16)
#define FT_WG_OUT_32 FT_WG_OUT_24, FT_WG_D8(24)
#define FT_WG_OUT_40 FT_WG_OUT_32, FT_WG_D8(32)
#define FT_WG_OUT_48 FT_WG_OUT_40, FT_WG_D8(40)
#define FT_WG_OUT_56 FT_WG_OUT_48, FT_WG_D8(48)
#define FT_WG_OUT_64 FT_WG_OUT_56, FT_WG_D8(56)
#define FT_WG_OUT_72 FT_WG_OUT_64, FT_WG_D8(64)
#define FT_WG_OUT_80 FT_WG_OUT_72, FT_WG_D8(72)
#define FT_WG_OUT_88 FT_WG_OUT_80, FT_WG_D8(80)
#define FT_WG_OUT_96 FT_WG_OUT_88, FT_WG_D8(88)
#define FT_WG_OUT_104 FT_WG_OUT_96, FT_WG_D8(96)
#define FT_WG_OUT_112 FT_WG_OUT_104, FT_WG_D8(104)
#define FT_WG_OUT_120 FT_WG_OUT_112, FT_WG_D8(112)
#define FT_WG_OUT_128 FT_WG_OUT_120, FT_WG_D8(120)
#define FT_WG_REG_8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define FT_WG_REG_16 FT_WG_REG_8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define FT_WG_REG_24 FT_WG_REG_16 ", %16, %17, %18, %19, %20, %21, %22, %23"
#define FT_WG_REG_32 FT_WG_REG_24 ", %24, %25, %26, %27, %28, %29, %30, %31"
#define FT_WG_REG_40 FT_WG_REG_32 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define FT_WG_REG_48 FT_WG_REG_40 ", %40, %41, %42, %43, %44, %45, %46, %47"
#define FT_WG_REG_56 FT_WG_REG_48 ", %48, %49, %50, %51, %52, %53, %54, %55"
#define FT_WG_REG_64 FT_WG_REG_56 ", %56, %57, %58, %59, %60, %61, %62, %63"
#define FT_WG_REG_72 FT_WG_REG_64 ", %64, %65, %66, %67, %68, %69, %70, %71"
#define FT_WG_REG_80 FT_WG_REG_72 ", %72, %73, %74, %75, %76, %77, %78, %79"
#define FT_WG_REG_88 FT_WG_REG_80 ", %80, %81, %82, %83, %84, %85, %86, %87"
#define FT_WG_REG_96 FT_WG_REG_88 ", %88, %89, %90, %91, %92, %93, %94, %95"
#define FT_WG_REG_104 FT_WG_REG_96 ", %96, %97, %98, %99, %100, %101, %102, %103"
#define FT_WG_REG_112 FT_WG_REG_104 ", %104, %105, %106, %107, %108, %109, %110, %111"
#define FT_WG_REG_120 FT_WG_REG_112 ", %112, %113, %114, %115, %116, %117, %118, %119"
#define FT_WG_REG_128 FT_WG_REG_120 ", %120, %121, %122, %123, %124, %125, %126, %127"
#define FT_WG_NEXT_8 8, 9, 10, 11, 12, 13
#define FT_WG_NEXT_16 16, 17, 18, 19, 20, 21
#define FT_WG_NEXT_24 24, 25, 26, 27, 28, 29
#define FT_WG_NEXT_32 32, 33, 34, 35, 36, 37
#define FT_WG_NEXT_40 40, 41, 42, 43, 44, 45
#define FT_WG_NEXT_48 48, 49, 50, 51, 52, 53
#define FT_WG_NEXT_56 56, 57, 58, 59, 60, 61
#define FT_WG_NEXT_64 64, 65, 66, 67, 68, 69
#define FT_WG_NEXT_72 72, 73, 74, 75, 76, 77
#define FT_WG_NEXT_80 80, 81, 82, 83, 84, 85
#define FT_WG_NEXT_88 88, 89, 90, 91, 92, 93
#define FT_WG_NEXT_96 96, 97, 98, 99, 100, 101
#define FT_WG_NEXT_104 104, 105, 106, 107, 108, 109
#define FT_WG_NEXT_112 112, 113, 114, 115, 116, 117
#define FT_WG_NEXT_120 120, 121, 122, 123, 124, 125
#define FT_WG_NEXT_128 128, 129, 130, 131, 132, 133
// SS: A and B descriptors, then scale-d; RS: A's four registers, B's descriptor, scale-d.
#define FT_WG_SS_ASM(N, T, TA, TB, REGS, a, b, s, ...)                                     \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" FT_WG_STR(s) ", 0;\n"                                   \
  "wgmma.mma_async.sync.aligned.m64n" FT_WG_STR(N) "k16.f32." T "." T " {" REGS "}, %"     \
  FT_WG_STR(a) ", %" FT_WG_STR(b) ", p, 1, 1, " FT_WG_STR(TA) ", " FT_WG_STR(TB) ";\n}\n"
#define FT_WG_RS_ASM(N, T, TB, REGS, a0, a1, a2, a3, b, s)                                \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" FT_WG_STR(s) ", 0;\n"                                   \
  "wgmma.mma_async.sync.aligned.m64n" FT_WG_STR(N) "k16.f32." T "." T " {" REGS "}, {%"   \
  FT_WG_STR(a0) ", %" FT_WG_STR(a1) ", %" FT_WG_STR(a2) ", %" FT_WG_STR(a3) "}, %"           \
  FT_WG_STR(b) ", p, 1, 1, " FT_WG_STR(TB) ";\n}\n"
// The 8-bit forms (m64nNk32): no transpose operands, T the format of A and B.
#define FT_WG_SS8_ASM(N, T, REGS, a, b, s, ...)                                          \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" FT_WG_STR(s) ", 0;\n"                                   \
  "wgmma.mma_async.sync.aligned.m64n" FT_WG_STR(N) "k32.f32." T "." T " {" REGS "}, %"     \
  FT_WG_STR(a) ", %" FT_WG_STR(b) ", p, 1, 1;\n}\n"
#define FT_WG_RS8_ASM(N, T, REGS, a0, a1, a2, a3, b, s)                                   \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" FT_WG_STR(s) ", 0;\n"                                   \
  "wgmma.mma_async.sync.aligned.m64n" FT_WG_STR(N) "k32.f32." T "." T " {" REGS "}, {%"   \
  FT_WG_STR(a0) ", %" FT_WG_STR(a1) ", %" FT_WG_STR(a2) ", %" FT_WG_STR(a3) "}, %"           \
  FT_WG_STR(b) ", p, 1, 1;\n}\n"
// The indirections let FT_WG_NEXT_R expand into separate arguments.
#define FT_WG_SS_ASM_(...) FT_WG_SS_ASM(__VA_ARGS__)
#define FT_WG_RS_ASM_(...) FT_WG_RS_ASM(__VA_ARGS__)
#define FT_WG_SS8_ASM_(...) FT_WG_SS8_ASM(__VA_ARGS__)
#define FT_WG_RS8_ASM_(...) FT_WG_RS8_ASM(__VA_ARGS__)
#define FT_WG_SS8(N, R, T)                                                               \
  asm volatile(FT_WG_SS8_ASM_(N, T, FT_WG_REG_##R, FT_WG_NEXT_##R)                          \
               : FT_WG_OUT_##R : "l"(a), "l"(b), "r"(scale_d))
#define FT_WG_RS8(N, R, T)                                                               \
  asm volatile(FT_WG_RS8_ASM_(N, T, FT_WG_REG_##R, FT_WG_NEXT_##R)                          \
               : FT_WG_OUT_##R                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d))
#define FT_WG_SS(N, R, T, TA, TB)                                                        \
  asm volatile(FT_WG_SS_ASM_(N, T, TA, TB, FT_WG_REG_##R, FT_WG_NEXT_##R)                   \
               : FT_WG_OUT_##R : "l"(a), "l"(b), "r"(scale_d))
#define FT_WG_RS(N, R, T, TB)                                                            \
  asm volatile(FT_WG_RS_ASM_(N, T, TB, FT_WG_REG_##R, FT_WG_NEXT_##R)                       \
               : FT_WG_OUT_##R                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d))
#define FT_WG_SS_T(N, R, T)                                                              \
  if constexpr (!TA && !TB) FT_WG_SS(N, R, T, 0, 0);                                       \
  else if constexpr (!TA) FT_WG_SS(N, R, T, 0, 1);                                         \
  else if constexpr (!TB) FT_WG_SS(N, R, T, 1, 0);                                         \
  else FT_WG_SS(N, R, T, 1, 1)
#define FT_WG_RS_T(N, R, T)                                                              \
  if constexpr (!TB) FT_WG_RS(N, R, T, 0);                                                 \
  else FT_WG_RS(N, R, T, 1)
// Wgmma<N>::ss / ::rs issue one m64nNk16 (f16 or bf16 operands, f32 accumulators);
// ::ss8 / ::rs8 one m64nNk32 (e4m3, or e5m2 where E5M2).
template <int N>
struct Wgmma;
#define FT_WG_DEFINE(N, R)                                                               \
  template <>                                                                              \
  struct Wgmma<N> {                                                                        \
    template <bool BF16, bool TA, bool TB>                                                 \
    static __device__ __forceinline__ void ss(float (&d)[R], unsigned long long a,         \
                                              unsigned long long b, int scale_d) {         \
      if constexpr (BF16) { FT_WG_SS_T(N, R, "bf16"); }                                    \
      else { FT_WG_SS_T(N, R, "f16"); }                                                    \
    }                                                                                      \
    template <bool BF16, bool TB>                                                          \
    static __device__ __forceinline__ void rs(float (&d)[R], const unsigned (&a)[4],       \
                                              unsigned long long b, int scale_d) {         \
      if constexpr (BF16) { FT_WG_RS_T(N, R, "bf16"); }                                    \
      else { FT_WG_RS_T(N, R, "f16"); }                                                    \
    }                                                                                      \
    template <bool E5M2>                                                                   \
    static __device__ __forceinline__ void ss8(float (&d)[R], unsigned long long a,        \
                                               unsigned long long b, int scale_d) {        \
      if constexpr (E5M2) { FT_WG_SS8(N, R, "e5m2"); }                                     \
      else { FT_WG_SS8(N, R, "e4m3"); }                                                    \
    }                                                                                      \
    template <bool E5M2>                                                                   \
    static __device__ __forceinline__ void rs8(float (&d)[R], const unsigned (&a)[4],      \
                                               unsigned long long b, int scale_d) {        \
      if constexpr (E5M2) { FT_WG_RS8(N, R, "e5m2"); }                                     \
      else { FT_WG_RS8(N, R, "e4m3"); }                                                    \
    }                                                                                      \
  };
FT_WG_DEFINE(16, 8)
FT_WG_DEFINE(32, 16)
FT_WG_DEFINE(48, 24)
FT_WG_DEFINE(64, 32)
FT_WG_DEFINE(80, 40)
FT_WG_DEFINE(96, 48)
FT_WG_DEFINE(112, 56)
FT_WG_DEFINE(128, 64)
FT_WG_DEFINE(144, 72)
FT_WG_DEFINE(160, 80)
FT_WG_DEFINE(176, 88)
FT_WG_DEFINE(192, 96)
FT_WG_DEFINE(208, 104)
FT_WG_DEFINE(224, 112)
FT_WG_DEFINE(240, 120)
FT_WG_DEFINE(256, 128)

}  // namespace detail

// D (64 x N, f32) = A * B (+ D when scale_d != 0), A and B from shared memory through their
// descriptors; TRANS_A / TRANS_B: the operand is MN-major (16-bit types only). N: a multiple
// of 16 in 16..256 (PTX allows every multiple of 8; flashtune's tiles step by 16).
template <int N, bool BF16, bool TRANS_A, bool TRANS_B>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], unsigned long long a_desc,
                                         unsigned long long b_desc, int scale_d) {
  static_assert(N % 16 == 0 && N >= 16 && N <= 256, "wgmma_ss: N a multiple of 16 in 16..256");
  detail::Wgmma<N>::template ss<BF16, TRANS_A, TRANS_B>(d, a_desc, b_desc, scale_d);
}

// The same with A (64 x 16) from registers: the 4 registers of each thread in the
// accumulator layout with N = 16 (e.g. S accumulators converted to 16-bit pairs).
template <int N, bool BF16, bool TRANS_B>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4],
                                         unsigned long long b_desc, int scale_d) {
  static_assert(N % 16 == 0 && N >= 16 && N <= 256, "wgmma_rs: N a multiple of 16 in 16..256");
  detail::Wgmma<N>::template rs<BF16, TRANS_B>(d, a, b_desc, scale_d);
}

// D (64 x N, f32) = A * B (+ D when scale_d != 0) over k = 32 8-bit elements (e4m3, or e5m2
// where E5M2), A and B from shared memory through their descriptors, both K-major (a row of
// 32 bytes; the descriptors' swizzles and offsets are the 16-bit case's in bytes).
template <int N, bool E5M2>
__device__ __forceinline__ void wgmma_ss_fp8(float (&d)[N / 2], unsigned long long a_desc,
                                             unsigned long long b_desc, int scale_d) {
  static_assert(N % 16 == 0 && N >= 16 && N <= 256,
                "wgmma_ss_fp8: N a multiple of 16 in 16..256");
  detail::Wgmma<N>::template ss8<E5M2>(d, a_desc, b_desc, scale_d);
}

// The same with A (64 x 32 bytes) from registers in the 8-bit A layout of the contract above.
template <int N, bool E5M2>
__device__ __forceinline__ void wgmma_rs_fp8(float (&d)[N / 2], const unsigned (&a)[4],
                                             unsigned long long b_desc, int scale_d) {
  static_assert(N % 16 == 0 && N >= 16 && N <= 256,
                "wgmma_rs_fp8: N a multiple of 16 in 16..256");
  detail::Wgmma<N>::template rs8<E5M2>(d, a, b_desc, scale_d);
}

}  // namespace ft

#endif  // FLASHTUNE_EMULATOR
