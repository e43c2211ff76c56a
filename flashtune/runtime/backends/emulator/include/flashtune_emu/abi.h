// The C ABI between an emulated kernel library and the emulator runtime library.
//
// A kernel library (the rendered .cu plus a generated launcher) is built against this header
// and calls the runtime for everything that involves more than one thread: block barriers,
// warp collectives (mma, ldmatrix, shuffles, votes), cp.async and the shared-memory checks.
// The runtime owns the fibers, the scheduler and the error state of a launch.
//
// FTEMU_ABI_VERSION is part of every cache key; bump it whenever anything here changes.
#pragma once

#include <stddef.h>
#include <vector_types.h>

#define FTEMU_ABI_VERSION 1
#define FTEMU_API __attribute__((visibility("default")))

extern "C" {

// Where a primitive was called from (the kernel's source file and line).
struct ftemu_loc {
    const char* file;
    unsigned line;
};

// What the kernel reads about the thread that is running right now.
struct ftemu_thread_ctx {
    uint3 thread_idx;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
    unsigned char* dyn_smem;
};

// Launch parameters chosen by the caller (mirrored by a ctypes Structure in native.py).
struct ftemu_launch_config {
    unsigned grid[3];
    unsigned block[3];
    unsigned long long dyn_smem_bytes;
    unsigned long long smem_limit_bytes;   // static + dynamic shared memory allowed per block
    unsigned long long stack_bytes;        // stack of each emulated thread
    int schedule;                          // FTEMU_SCHEDULE_*
    int checks;                            // FTEMU_CHECK_* bits
    double hang_timeout_s;                 // <= 0: no watchdog for threads that never yield
};

// Which runnable thread runs next: the lowest index (warps run as far ahead as they can,
// in order) or the highest. Running both exposes races in either direction.
#define FTEMU_SCHEDULE_FORWARD 0
#define FTEMU_SCHEDULE_REVERSE 1

// Optional checks (all on by default in Python).
#define FTEMU_CHECK_POISON_OPERANDS 1  // mma operands equal to the shared-memory poison
#define FTEMU_CHECK_BARRIER_SITE 2     // all threads reach the same __syncthreads call

// What the kernel library tells the runtime about the kernel being launched.
typedef void (*ftemu_body_fn)(void* closure);
struct ftemu_kernel_desc {
    const char* name;
    unsigned char* static_smem;            // section of __shared__ variables (may be null)
    unsigned long long static_smem_bytes;
    ftemu_body_fn body;                    // runs the kernel for the current thread
    void* closure;
};

// Status codes of ftemu_run and of the generated launchers.
#define FTEMU_OK 0
#define FTEMU_ERROR 1        // a fault in the kernel (bad address, race, poison, ...)
#define FTEMU_DEADLOCK 2     // a barrier or warp collective that can never complete
#define FTEMU_BAD_LAUNCH 3   // invalid launch parameters

// Current thread of the running launch; valid only while kernel code runs.
FTEMU_API extern ftemu_thread_ctx* ftemu_current;

FTEMU_API int ftemu_run(const ftemu_launch_config* config, const ftemu_kernel_desc* kernel,
              char* message, unsigned long long message_bytes);
FTEMU_API const char* ftemu_runtime_version(void);

// --- primitives (called by the kernel library on the current thread) ---
#define FTEMU_MMA_F16 0
#define FTEMU_MMA_BF16 1
FTEMU_API void ftemu_mma_m16n8k16(int kind, float* d, const unsigned* a, const unsigned* b,
                        const float* c, ftemu_loc loc);
FTEMU_API void ftemu_ldmatrix(int count, int trans, unsigned* regs, const void* row_addr,
                              ftemu_loc loc);

FTEMU_API void ftemu_cp_async(void* smem_dst, const void* gmem_src, int bytes, int src_bytes,
                    ftemu_loc loc);
FTEMU_API void ftemu_cp_async_commit(ftemu_loc loc);
FTEMU_API void ftemu_cp_async_wait(int pending, ftemu_loc loc);   // wait_group N
FTEMU_API void ftemu_cp_async_wait_all(ftemu_loc loc);

#define FTEMU_SHFL_IDX 0
#define FTEMU_SHFL_UP 1
#define FTEMU_SHFL_DOWN 2
#define FTEMU_SHFL_XOR 3
FTEMU_API unsigned ftemu_shfl(int mode, unsigned mask, unsigned value, int arg, int width,
                              ftemu_loc loc);

#define FTEMU_VOTE_ALL 0
#define FTEMU_VOTE_ANY 1
#define FTEMU_VOTE_BALLOT 2
FTEMU_API unsigned ftemu_vote(int mode, unsigned mask, int predicate, ftemu_loc loc);

FTEMU_API void ftemu_syncthreads(ftemu_loc loc);
FTEMU_API void ftemu_syncwarp(unsigned mask, ftemu_loc loc);
FTEMU_API unsigned ftemu_cvta_shared(const void* ptr, ftemu_loc loc);

// Records a fault of the current thread and ends the launch (never returns).
[[noreturn]] FTEMU_API void ftemu_fail(const char* message, ftemu_loc loc);

}  // extern "C"
