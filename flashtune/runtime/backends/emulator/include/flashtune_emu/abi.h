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

#define FTEMU_ABI_VERSION 4
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

// Counters of one launch (mirrored in native.py), filled when the caller passes one in
// ftemu_launch_config.counters. The runtime zeroes every field except block_mma and
// block_mma_len at launch start. A "warp request" of cp.async is the k-th cp.async of each
// lane of a warp (what the hardware coalesces); shared-memory accesses are split into phases
// of at most 128 bytes (ldmatrix: one 8x8 matrix, 8 rows of 16 bytes; cp.async: 8, 16 or 32
// lanes for 16-, 8- or 4-byte copies) and a phase takes as many wavefronts as the largest
// number of distinct 4-byte words that fall in one of the 32 banks (1: conflict-free).
#define FTEMU_MAX_SITES 64
#define FTEMU_SITE_CP_ASYNC 0
#define FTEMU_SITE_LDMATRIX 1
struct ftemu_site_counters {
    const char* file;                      // call site (kernel source file and line)
    unsigned line;
    int kind;                              // FTEMU_SITE_*
    unsigned long long requests;           // warp requests (cp.async) or instructions
    unsigned long long phases;             // shared-memory phases (ideal wavefronts)
    unsigned long long wavefronts;         // shared-memory wavefronts taken
    unsigned long long global_bytes;       // cp.async: bytes read from global memory
    unsigned long long sectors;            // cp.async: 32-byte sectors of the requests
    unsigned long long min_sectors;        // cp.async: ceil(request bytes / 32), summed
};
struct ftemu_counters {
    unsigned long long cp_async_copies;    // per-thread copies issued
    unsigned long long cp_async_requests;  // warp requests
    unsigned long long cp_async_bytes;     // bytes read from global memory (src_bytes)
    unsigned long long cp_async_fill_bytes;  // bytes zero-filled (bytes - src_bytes)
    unsigned long long cp_async_sectors;
    unsigned long long cp_async_min_sectors;
    unsigned long long cp_async_smem_phases;
    unsigned long long cp_async_smem_wavefronts;
    unsigned long long ldmatrix_count;     // warp instructions
    unsigned long long ldmatrix_phases;
    unsigned long long ldmatrix_wavefronts;
    unsigned long long mma_count;          // warp instructions (m16n8k16)
    unsigned long long shfl_count;         // warp shuffles
    unsigned long long barrier_count;      // completed __syncthreads, all blocks
    unsigned long long ldg_bytes;          // bytes read from global memory by __ldg
    unsigned long long* block_mma;         // mma per block, x fastest (caller's; may be null)
    unsigned long long block_mma_len;
    unsigned nsites;
    unsigned sites_dropped;                // call sites beyond FTEMU_MAX_SITES (not itemised)
    ftemu_site_counters sites[FTEMU_MAX_SITES];
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
    ftemu_counters* counters;              // null: nothing is counted
    int block_order;                       // FTEMU_BLOCK_ORDER_*
    unsigned long long block_order_seed;   // seed of FTEMU_BLOCK_ORDER_SHUFFLED
};

// Which runnable thread runs next: the lowest index (warps run as far ahead as they can,
// in order) or the highest. Running both exposes races in either direction.
#define FTEMU_SCHEDULE_FORWARD 0
#define FTEMU_SCHEDULE_REVERSE 1

// Order in which the blocks of the grid run (one after another): x fastest, then y, then z;
// or a permutation of that order drawn from block_order_seed (a Fisher-Yates shuffle driven
// by splitmix64, so one seed gives the same order on every platform). A kernel whose result
// depends on the order of its blocks (atomics, cross-block races) shows it under shuffling.
#define FTEMU_BLOCK_ORDER_LINEAR 0
#define FTEMU_BLOCK_ORDER_SHUFFLED 1

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
#define FTEMU_MMA_E4M3 2  // m16n8k32, e4m3 A and B (ftemu_mma_m16n8k32)
#define FTEMU_MMA_E5M2 3  // m16n8k32, e5m2 A and B (ftemu_mma_m16n8k32)
FTEMU_API void ftemu_mma_m16n8k16(int kind, float* d, const unsigned* a, const unsigned* b,
                        const float* c, ftemu_loc loc);
FTEMU_API void ftemu_mma_m16n8k32(int kind, float* d, const unsigned* a, const unsigned* b,
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
// Counts a read-only global load of `bytes` (__ldg) while counters are on.
FTEMU_API void ftemu_count_ldg(unsigned bytes);
FTEMU_API void ftemu_syncwarp(unsigned mask, ftemu_loc loc);
FTEMU_API unsigned ftemu_cvta_shared(const void* ptr, ftemu_loc loc);

// wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16} and
// .m64nNk32.f32.{e4m3,e5m2}.{e4m3,e5m2} (sm_90a; A and B of one format). kind: bit 0 bf16,
// bit 1 A from registers, bit 2 imm-trans-a, bit 3 imm-trans-b (16-bit types only), bit 4
// e4m3, bit 5 e5m2 (k32: 16 8-bit A elements per thread in the 4 registers), bits 8.. N.
#define FTEMU_WGMMA_BF16 1
#define FTEMU_WGMMA_RS 2
#define FTEMU_WGMMA_TRANS_A 4
#define FTEMU_WGMMA_TRANS_B 8
#define FTEMU_WGMMA_E4M3 16
#define FTEMU_WGMMA_E5M2 32
struct ftemu_wgmma_args {
    float* d;                   // N/2 accumulators of this thread
    const unsigned* a;          // RS: the 4 A registers of this thread; SS: null
    unsigned long long a_desc;  // SS: the A matrix descriptor
    unsigned long long b_desc;
    int scale_d;                // 0: D = A*B, else D = A*B + D
};
FTEMU_API void ftemu_wgmma(int kind, void* args, ftemu_loc loc);
FTEMU_API void ftemu_wgmma_fence(ftemu_loc loc);
FTEMU_API void ftemu_wgmma_commit(ftemu_loc loc);
FTEMU_API void ftemu_wgmma_wait(int pending, ftemu_loc loc);
// The point where count accumulators at d are read: an error while a wgmma not yet covered
// by a wgmma_wait still writes any of them.
FTEMU_API void ftemu_wgmma_fence_operands(const float* d, int count, ftemu_loc loc);
FTEMU_API void ftemu_fence_proxy_async(ftemu_loc loc);

// mbarrier objects in shared memory (8 bytes, 8-byte aligned): init, arrive (with an
// optional expect-tx), complete-tx, cp.async.mbarrier.arrive.noinc and try_wait.parity.
FTEMU_API void ftemu_mbarrier_init(void* bar, unsigned count, ftemu_loc loc);
FTEMU_API void ftemu_mbarrier_arrive(void* bar, unsigned expect_tx, ftemu_loc loc);
FTEMU_API void ftemu_mbarrier_complete_tx(void* bar, unsigned tx, ftemu_loc loc);
FTEMU_API void ftemu_mbarrier_cp_async_arrive(void* bar, ftemu_loc loc);
FTEMU_API int ftemu_mbarrier_try_wait_parity(void* bar, unsigned parity, ftemu_loc loc);

// The emulator's tensor map: what a kernel receives as its `const __grid_constant__
// CUtensorMap` parameter under the emulator (128 bytes, 64-byte aligned, like the driver's
// opaque object). flashtune.runtime.tma.encode_emulator writes it; the fields are those of
// cuTensorMapEncodeTiled, with the driver's enum values (cuda.h), byte offsets in brackets.
#define FTEMU_TMAP_MAGIC 0x70616d726f736e74ull  // "tnsormap", little-endian
struct alignas(64) ftemu_tensor_map {
    unsigned long long magic;          // [0]   FTEMU_TMAP_MAGIC
    unsigned long long address;        // [8]   global address of element (0, ..., 0)
    unsigned long long dims[5];        // [16]  elements per dim, innermost first
    unsigned long long strides[4];     // [56]  bytes between consecutive indices of dims 1..
    unsigned box[5];                   // [88]  box elements per dim
    unsigned char rank;                // [108] 1..5
    unsigned char elem_bytes;          // [109] 1, 2, 4 or 8
    unsigned char swizzle;             // [110] CU_TENSOR_MAP_SWIZZLE_{NONE,32B,64B,128B}: 0..3
    unsigned char oob_fill;            // [111] CU_TENSOR_MAP_FLOAT_OOB_FILL_{NONE,NAN_...}: 0, 1
    unsigned char elem_strides[5];     // [112] 1..8 (the emulator models 1 only)
    unsigned char data_type;           // [117] CUtensorMapDataType
    unsigned char reserved[10];        // [118] zero
};
static_assert(sizeof(ftemu_tensor_map) == 128, "a tensor map is 128 bytes");

// cp.async.bulk.tensor.<rank>d.shared::cluster.global.tile.mbarrier::complete_tx::bytes:
// loads the box at `coords` (rank signed ints, innermost first) of the tensor `map` into
// shared memory at `smem_dst` (swizzled as the map says; out-of-bounds elements filled) and
// completes its bytes as transactions on the mbarrier `bar`.
FTEMU_API void ftemu_tma_load(void* smem_dst, const void* map, int rank, const int* coords,
                              void* bar, ftemu_loc loc);
// prefetch.param.tensormap: checks the map (the emulator has no descriptor cache).
FTEMU_API void ftemu_prefetch_tensormap(const void* map, ftemu_loc loc);
// setmaxnreg.{inc,dec}.sync.aligned.u32 count (sm_90a): inc 1 or 0.
FTEMU_API void ftemu_setmaxnreg(int inc, unsigned count, ftemu_loc loc);
// bar.sync id, count (sync 1: arrive and wait) / bar.arrive id, count (sync 0): named barriers
// 1..15 of the block (0 is __syncthreads'), count threads per phase.
FTEMU_API void ftemu_named_barrier(int sync, unsigned id, unsigned count, ftemu_loc loc);

// Records a fault of the current thread and ends the launch (never returns).
[[noreturn]] FTEMU_API void ftemu_fail(const char* message, ftemu_loc loc);

}  // extern "C"
