// Force-included (g++ -include) in front of every kernel the emulator compiles: the CUDA
// language as a C++20 program on the host.
//
// Provides __global__/__device__/__host__/__forceinline__/__launch_bounds__/__shared__,
// threadIdx/blockIdx/blockDim/gridDim/warpSize, __syncthreads/__syncwarp, the shuffle and
// vote families, atomics, the math and bit functions kernels use, half/bfloat16 and vector
// types (from the CUDA headers of the nvidia wheels, host side), and the launcher template.
// Everything that involves more than one thread calls into the emulator runtime library.
#pragma once

#ifndef FLASHTUNE_EMULATOR
#define FLASHTUNE_EMULATOR 1
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <bit>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <source_location>
#include <tuple>
#include <type_traits>
#include <utility>

#include "flashtune_emu/abi.h"

// ---------------------------------------------------------------------------------------
// Keywords. crt/host_defines.h (pulled in by cuda_fp16.h) already defines __global__,
// __device__, __host__ and __constant__ as nothing and __forceinline__/__align__ as GCC
// attributes on the host.

// __shared__ variables are statics in one section, so the runtime can poison and check them
// (one launch runs at a time, blocks one after another).
#undef __shared__
#define __shared__ static __attribute__((section("ftemu_shared")))
#undef __launch_bounds__
#define __launch_bounds__(...)
#ifndef __noinline__
#define __noinline__ __attribute__((noinline))
#endif
#ifndef __grid_constant__
#define __grid_constant__
#endif

// Keeps the section 128-byte aligned (and present, so its bounds always link).
[[gnu::used, gnu::section("ftemu_shared"), gnu::aligned(128)]] static unsigned char
    ftemu_shared_anchor_[1];
extern "C" unsigned char __start_ftemu_shared[] __attribute__((visibility("hidden")));
extern "C" unsigned char __stop_ftemu_shared[] __attribute__((visibility("hidden")));

// ---------------------------------------------------------------------------------------
// Built-in variables

#define threadIdx (::ftemu_current->thread_idx)
#define blockIdx (::ftemu_current->block_idx)
#define blockDim (::ftemu_current->block_dim)
#define gridDim (::ftemu_current->grid_dim)
static constexpr int warpSize = 32;

namespace ftemu {
using loc_t = std::source_location;
inline ftemu_loc to_loc(const loc_t& l) { return ftemu_loc{l.file_name(), l.line()}; }
template <class T>
inline constexpr bool is_word = std::is_trivially_copyable_v<T> && sizeof(T) == 4;
}  // namespace ftemu

// ---------------------------------------------------------------------------------------
// Synchronisation

inline void __syncthreads(ftemu::loc_t l = ftemu::loc_t::current()) {
    ftemu_syncthreads(ftemu::to_loc(l));
}
inline void __syncwarp(unsigned mask = 0xffffffffu, ftemu::loc_t l = ftemu::loc_t::current()) {
    ftemu_syncwarp(mask, ftemu::to_loc(l));
}
inline void __threadfence() {}
inline void __threadfence_block() {}

inline int __all_sync(unsigned mask, int p, ftemu::loc_t l = ftemu::loc_t::current()) {
    return static_cast<int>(ftemu_vote(FTEMU_VOTE_ALL, mask, p, ftemu::to_loc(l)));
}
inline int __any_sync(unsigned mask, int p, ftemu::loc_t l = ftemu::loc_t::current()) {
    return static_cast<int>(ftemu_vote(FTEMU_VOTE_ANY, mask, p, ftemu::to_loc(l)));
}
inline unsigned __ballot_sync(unsigned mask, int p, ftemu::loc_t l = ftemu::loc_t::current()) {
    return ftemu_vote(FTEMU_VOTE_BALLOT, mask, p, ftemu::to_loc(l));
}

// ---------------------------------------------------------------------------------------
// Shuffles: any trivially copyable type of 1, 2, 4 or 8 bytes (8 bytes as two 32-bit
// shuffles, as CUDA does).

namespace ftemu {
template <class T>
inline T shfl(int mode, unsigned mask, T var, int arg, int width, const loc_t& l) {
    static_assert(std::is_trivially_copyable_v<T> && (sizeof(T) <= 4 || sizeof(T) == 8),
                  "shuffles move values of 1, 2, 4 or 8 bytes");
    if constexpr (sizeof(T) == 8) {
        unsigned w[2];
        std::memcpy(w, &var, 8);
        w[0] = ftemu_shfl(mode, mask, w[0], arg, width, to_loc(l));
        w[1] = ftemu_shfl(mode, mask, w[1], arg, width, to_loc(l));
        T out;
        std::memcpy(&out, w, 8);
        return out;
    } else {
        unsigned w = 0;
        std::memcpy(&w, &var, sizeof(T));
        w = ftemu_shfl(mode, mask, w, arg, width, to_loc(l));
        T out;
        std::memcpy(&out, &w, sizeof(T));
        return out;
    }
}
}  // namespace ftemu

template <class T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,
                     ftemu::loc_t l = ftemu::loc_t::current()) {
    return ftemu::shfl(FTEMU_SHFL_IDX, mask, var, src_lane, width, l);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                        ftemu::loc_t l = ftemu::loc_t::current()) {
    return ftemu::shfl(FTEMU_SHFL_UP, mask, var, static_cast<int>(delta), width, l);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                          ftemu::loc_t l = ftemu::loc_t::current()) {
    return ftemu::shfl(FTEMU_SHFL_DOWN, mask, var, static_cast<int>(delta), width, l);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                         ftemu::loc_t l = ftemu::loc_t::current()) {
    return ftemu::shfl(FTEMU_SHFL_XOR, mask, var, lane_mask, width, l);
}

// ---------------------------------------------------------------------------------------
// Shared-memory address space

inline size_t __cvta_generic_to_shared(const void* p, ftemu::loc_t l = ftemu::loc_t::current()) {
    return ftemu_cvta_shared(p, ftemu::to_loc(l));
}

// ---------------------------------------------------------------------------------------
// Atomics (one emulated thread runs at a time, so plain read-modify-write is atomic)

template <class T>
inline T ftemu_atomic_rmw_(T* p, T v, int op) {
    T old = *p;
    switch (op) {
        case 0: *p = old + v; break;
        case 1: *p = v < old ? v : old; break;
        case 2: *p = v > old ? v : old; break;
        default: *p = v; break;
    }
    return old;
}
inline float atomicAdd(float* p, float v) { return ftemu_atomic_rmw_(p, v, 0); }
inline double atomicAdd(double* p, double v) { return ftemu_atomic_rmw_(p, v, 0); }
inline int atomicAdd(int* p, int v) { return ftemu_atomic_rmw_(p, v, 0); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return ftemu_atomic_rmw_(p, v, 0); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return ftemu_atomic_rmw_(p, v, 0);
}
inline int atomicMin(int* p, int v) { return ftemu_atomic_rmw_(p, v, 1); }
inline int atomicMax(int* p, int v) { return ftemu_atomic_rmw_(p, v, 2); }
inline unsigned atomicMin(unsigned* p, unsigned v) { return ftemu_atomic_rmw_(p, v, 1); }
inline unsigned atomicMax(unsigned* p, unsigned v) { return ftemu_atomic_rmw_(p, v, 2); }
inline int atomicExch(int* p, int v) { return ftemu_atomic_rmw_(p, v, 3); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return ftemu_atomic_rmw_(p, v, 3); }
inline float atomicExch(float* p, float v) { return ftemu_atomic_rmw_(p, v, 3); }
inline int atomicCAS(int* p, int cmp, int v) {
    int old = *p;
    if (old == cmp) *p = v;
    return old;
}
inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned v) {
    unsigned old = *p;
    if (old == cmp) *p = v;
    return old;
}

// ---------------------------------------------------------------------------------------
// Math and bit functions beyond <cmath>

inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.0f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }

inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline int __popc(unsigned x) { return std::popcount(x); }
inline int __popcll(unsigned long long x) { return std::popcount(x); }
inline int __clz(int x) { return std::countl_zero(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return x ? std::countr_zero(static_cast<unsigned>(x)) + 1 : 0; }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
template <class T>
inline T __ldg(const T* p) {
    ftemu_count_ldg(sizeof(T));
    return *p;
}
inline long long clock64() {
    return std::chrono::steady_clock::now().time_since_epoch().count();
}

// ---------------------------------------------------------------------------------------
// Launcher: a generic entry that unpacks void** arguments by the kernel's parameter types.

namespace ftemu {

template <class T>
constexpr char type_code() {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_pointer_v<U>) return 'p';
    else if constexpr (std::is_same_v<U, ftemu_tensor_map>) return 'T';
    else if constexpr (std::is_same_v<U, bool>) return 'b';
    else if constexpr (std::is_same_v<U, float>) return 'f';
    else if constexpr (std::is_same_v<U, double>) return 'd';
    else if constexpr (std::is_integral_v<U> && sizeof(U) == 4) return std::is_signed_v<U> ? 'i' : 'u';
    else if constexpr (std::is_integral_v<U> && sizeof(U) == 8) return std::is_signed_v<U> ? 'l' : 'L';
    else return '?';
}

template <class... P>
struct Closure {
    void (*fn)(P...);
    std::tuple<std::remove_cvref_t<P>...> args;
    // Each thread calls the kernel with its own copy of the parameters.
    static void run(void* self) {
        auto* c = static_cast<Closure*>(self);
        std::apply(c->fn, c->args);
    }
};

template <class... P, size_t... I>
int launch_impl(void (*fn)(P...), const char* name, const ftemu_launch_config* cfg, void** args,
                char* msg, unsigned long long msg_bytes, std::index_sequence<I...>) {
    Closure<P...> closure{fn, {*static_cast<std::remove_cvref_t<P>*>(args[I])...}};
    ftemu_kernel_desc desc{name, __start_ftemu_shared,
                           static_cast<unsigned long long>(__stop_ftemu_shared -
                                                           __start_ftemu_shared),
                           &Closure<P...>::run, &closure};
    return ftemu_run(cfg, &desc, msg, msg_bytes);
}

template <class... P>
int launch(void (*fn)(P...), const char* name, const ftemu_launch_config* cfg, void** args,
           char* msg, unsigned long long msg_bytes) {
    return launch_impl(fn, name, cfg, args, msg, msg_bytes, std::index_sequence_for<P...>{});
}

template <class... P>
const char* signature(void (*)(P...)) {
    static constexpr char codes[] = {type_code<P>()..., '\0'};
    return codes;
}

}  // namespace ftemu

// Defines the exported launcher and signature functions of one kernel entry point.
#define FTEMU_DEFINE_LAUNCHER(entry)                                                          \
    extern "C" FTEMU_API int ftemu_launch__##entry(const ftemu_launch_config* ftemu_cfg_,     \
                                                   void** ftemu_args_, char* ftemu_msg_,      \
                                                   unsigned long long ftemu_msg_bytes_) {     \
        return ::ftemu::launch(&entry, #entry, ftemu_cfg_, ftemu_args_, ftemu_msg_,           \
                               ftemu_msg_bytes_);                                             \
    }                                                                                         \
    extern "C" FTEMU_API const char* ftemu_signature__##entry(void) {                         \
        return ::ftemu::signature(&entry);                                                    \
    }

#include "flashtune_emu/primitives.h"
