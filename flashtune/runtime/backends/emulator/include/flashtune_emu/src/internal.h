// Internal state of the emulator runtime (not seen by kernel code).
//
// One launch runs on the calling OS thread: blocks one after another, each block's threads
// as fibers. Execution is deterministic: a fiber runs until it blocks (barrier, warp
// collective) or returns, then the scheduler picks the next runnable thread by index. When no
// thread is runnable and some are still alive, nothing can ever make progress: a deadlock.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "flashtune_emu/abi.h"

namespace ftemu {

// Shared memory is filled with this 32-bit word at block start and wherever a cp.async is in
// flight. Every 16-bit half (0xffa5) is a NaN in fp16 and bf16 and the word is a NaN in
// fp32, so poison that reaches arithmetic shows up as NaN; the payload is distinctive enough
// (no conversion produces it) that mma can recognise it in its operands.
constexpr uint32_t kPoisonWord = 0xFFA5FFA5u;
constexpr uint16_t kPoisonHalf = 0xFFA5u;

struct Thread;

// ---------------------------------------------------------------------------------------
// Fibers

struct Context {
    void* sp = nullptr;  // saved stack pointer (x86-64) or ucontext (elsewhere)
    void* uc = nullptr;
};
void context_init(Context* ctx, unsigned char* stack_lo, size_t stack_size, void (*entry)());
void context_switch(Context* from, Context* to);
void context_release(Context* ctx);

// ---------------------------------------------------------------------------------------
// Shared memory with a shadow state per 4-byte word

enum class Word : uint8_t {
    Clean,           // visible to every thread
    Pending,         // a cp.async into it is in flight (memory holds poison)
    PrivateVisible,  // a completed cp.async of `owner`, not yet published by a barrier
    PrivateHidden,   // the same while `owner` is switched out: data in `saved`, memory poison
};

struct SmemSpace {
    const char* name = "";
    unsigned char* base = nullptr;
    size_t size = 0;
    std::vector<Word> state;
    std::vector<uint16_t> owner;
    std::vector<uint32_t> saved;
    std::vector<uint32_t> read_epoch;  // barrier epoch + 1 of the last ldmatrix read (0: none)
    std::vector<uint16_t> reader_warp;
    std::vector<ftemu_loc> reader_loc;

    void assign(const char* space_name, unsigned char* p, size_t bytes);
    void reset();  // all words clean, no reads recorded
    bool contains(const void* p) const {
        auto* c = static_cast<const unsigned char*>(p);
        return c >= base && c < base + size;
    }
    size_t word_of(const void* p) const {
        return static_cast<size_t>(static_cast<const unsigned char*>(p) - base) / 4;
    }
    uint32_t load(size_t w) const;
    void store(size_t w, uint32_t v);
};

struct Copy {
    SmemSpace* space;
    uint32_t word;
    uint32_t nwords;
    uint32_t data[4];
    ftemu_loc loc;
    bool tma = false;  // a TMA box's part: it completes without its issuing thread
};

struct Region {
    SmemSpace* space;
    uint32_t word;
    uint32_t nwords;
};

// ---------------------------------------------------------------------------------------
// Threads, warps, collectives

enum class TState : uint8_t { Runnable, AtBarrier, InCollective, Exited, AtMbarrier, AtNamedBarrier };

struct Thread {
    ftemu_thread_ctx ctx{};
    unsigned tid = 0, warp = 0, lane = 0;
    TState state = TState::Runnable;
    Context context;
    unsigned char* stack_lo = nullptr;
    size_t stack_size = 0;
    void* asan_fake_stack = nullptr;
    ftemu_loc wait_loc{};
    int collective = -1;  // index into its warp's pool while InCollective

    std::vector<Copy> uncommitted;
    std::deque<std::vector<Copy>> groups;  // committed, oldest first
    std::vector<Region> priv;              // landed copies not yet published
    bool hidden = false;
    uint32_t cp_seq = 0;                   // cp.async calls so far in this block (counters)

    // wgmma.mma_async results in flight (wgmma.cpp): written to the accumulator registers
    // only at the wgmma_wait that covers their group; the registers hold poison until then.
    struct WgmmaResult {
        float* d;
        std::vector<float> values;
        ftemu_loc loc;
    };
    std::vector<WgmmaResult> wg_uncommitted;
    std::deque<std::vector<WgmmaResult>> wg_groups;  // committed, oldest first
    bool wg_fenced = false;  // a wgmma_fence since the accumulators were last handed back

    // While AtMbarrier (mbarrier.cpp): the barrier and the phase this thread waits to complete.
    const void* wait_bar = nullptr;
    uint64_t wait_phase = 0;

    unsigned nreg_calls = 0;  // setmaxnreg executed so far in this block (setmaxnreg.cpp)
    // While AtNamedBarrier (named_barrier.cpp): the barrier id and the phase waited for.
    unsigned named_id = 0;
    uint64_t named_phase = 0;
};

// A named barrier (bar.sync / bar.arrive with an id and a thread count).
struct NamedBarrier {
    unsigned count = 0;    // threads of the phase in progress (0: no arrival yet)
    unsigned arrived = 0;
    uint64_t phase = 0;    // phases completed
    unsigned first_tid = 0;
    ftemu_loc first_loc{};
};

// One setmaxnreg of a warpgroup, as its first thread executed it (setmaxnreg.cpp).
struct NregRequest {
    int inc;
    unsigned count;
    unsigned tid;
    ftemu_loc loc;
};

// An mbarrier object (mbarrier.cpp), keyed by its shared-memory address.
struct MBarrier {
    uint32_t expected = 0;     // arrivals per phase (the init count)
    uint32_t pending = 0;      // arrivals still missing in the current phase
    int64_t tx = 0;            // transaction count of the current phase
    uint64_t phase = 0;        // phases completed so far (parity: phase & 1)
    uint64_t image = 0;        // what its 8 bytes of shared memory hold (plain stores show)
    unsigned init_tid = 0;
    uint32_t init_epoch = 0;   // block-barrier epoch of the init
    ftemu_loc init_loc{};
    uint32_t arrived_warps = 0;  // warps with an arrival in the current phase
    std::vector<Copy> copies;    // cp.async tracked by cp.async.mbarrier.arrive: land at completion
    std::vector<std::pair<unsigned, Region>> released;  // private copies released by arrivals
};

enum class Op : uint8_t { Mma, Ldmatrix, Shfl, Vote, SyncWarp, Wgmma };

struct LaneArgs {
    void* out;
    const void* in0;
    const void* in1;
    const void* in2;
    unsigned value;
    int arg;
};

struct Collective {
    bool active = false;
    Op op = Op::SyncWarp;
    int kind = 0;   // mma: FTEMU_MMA_*; ldmatrix: count | trans << 4; shfl / vote: mode
    int width = 32;
    unsigned mask = 0;
    unsigned arrived = 0;
    uint64_t serial = 0;  // creation order
    ftemu_loc loc{};
    LaneArgs lanes[32];
};

// The k-th cp.async of the lanes of one warp (counters only).
struct CpRequest {
    unsigned lanes = 0;
    ftemu_loc loc{};
    uintptr_t src[32];
    uintptr_t dst[32];
    uint8_t bytes[32];
    uint8_t src_bytes[32];
};

struct Warp {
    std::map<uint32_t, CpRequest> cp_requests;  // by cp_seq, until every lane issued it
    unsigned present = 0;  // lanes that exist (the last warp of a block may be partial)
    unsigned exited = 0;
    std::vector<Collective> pool;
};

// ---------------------------------------------------------------------------------------
// A launch

struct Launch {
    const ftemu_launch_config* cfg = nullptr;
    const ftemu_kernel_desc* kernel = nullptr;
    bool asan = false;
    unsigned nthreads = 0, nwarps = 0;
    uint3 block_idx{};
    std::vector<Thread> threads;
    std::vector<Warp> warps;
    std::vector<uint64_t> runnable;  // bit per thread
    unsigned live = 0;
    unsigned barrier_arrived = 0;
    ftemu_loc barrier_loc{};
    uint32_t epoch = 0;  // completed block barriers in this block
    uint64_t collective_serial = 0;
    uint64_t switches = 0;  // progress counter for the watchdog
    ftemu_counters* counters = nullptr;  // null unless the caller asked for counters
    uint64_t block_linear = 0;            // x + gx * (y + gy * z) of the running block
    std::map<uintptr_t, MBarrier> mbarriers;  // initialised in the running block
    std::vector<std::vector<NregRequest>> nreg;  // setmaxnreg sequence per warpgroup
    NamedBarrier named[16];                      // bar.sync / bar.arrive ids 1..15

    SmemSpace dyn, stat;
    unsigned char* arena_map = nullptr;  // mmap of guard + arena + guard (non-ASan)
    size_t arena_map_bytes = 0;
    unsigned char* stacks_map = nullptr;
    size_t stacks_map_bytes = 0;

    Context sched;
    Thread* cur = nullptr;
    const void* sched_stack_bottom = nullptr;
    size_t sched_stack_size = 0;
    long os_tid = 0;

    int status = FTEMU_OK;
    std::string message;
    std::string asan_report;  // set by the AddressSanitizer report callback
};

extern Launch* g_launch;

// runtime.cpp
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string where(const Thread& t);
std::string at(ftemu_loc loc);
std::string lane_list(unsigned lanes);
[[noreturn]] void fail(int status, const std::string& message);
// Leaves the current fiber for good and returns control to the scheduler.
[[noreturn]] void abandon_current();
void record_error(int status, const std::string& message);
void check_async_errors();
void make_runnable(Thread& t);
void make_blocked(Thread& t, TState state);
void set_current_op(const char* what);  // named in fault messages while set
void suspend(Thread& me);
void complete_barrier_if_ready();

// faults.cpp
long current_os_tid();
void install_handlers(Launch& L);
void uninstall_handlers(Launch& L);

// shared.cpp
void smem_setup_block(Launch& L);
void smem_check_slack(Launch& L);
void hide(Thread& t);
void unhide(Thread& t);
void publish_all(Launch& L);
void land_all(Thread& t);
// Lands copies of thread `tid` whose completion an mbarrier phase reports, published at once.
void land_published(unsigned tid, const std::vector<Copy>& copies);
// Publishes the words of `r` that thread `tid` holds privately (landed cp.async data).
void publish_region(unsigned tid, const Region& r);
SmemSpace* locate_shared(const void* p);
std::string describe_smem_address(const void* p);
// Checks that an asynchronous copy (cp.async or TMA, named by `kind`) may write the words of
// `c` now (no copy in flight there, no unpublished data of another thread, no unreleased read
// of another warp); `what()` names the call in messages.
void check_async_destination(const Thread& me, const Copy& c, const char* kind,
                             const std::function<std::string()>& what);
// Marks the words of `c` in flight (poison, owned by `me`) until the copy lands.
void start_async_write(const Thread& me, const Copy& c);
// Reads the 16-byte row of an ldmatrix (checked: bounds, alignment, cp.async visibility).
void read_ldmatrix_row(const Thread& reader, const void* addr, const char* what, ftemu_loc loc,
                       uint16_t out[8]);

// counters.cpp (called only while g_launch->counters is set)
void counters_begin_launch(Launch& L);
void count_cp_async(Thread& t, const void* dst, const void* src, int bytes, int src_bytes,
                    ftemu_loc loc);
void count_collective(Launch& L, const Collective& c, unsigned warp);
void counters_end_block(Launch& L);

// warp.cpp: exact 16-bit float decoding (fp16 through a 65536-entry table)
const float* half_table();
float bf16_to_float(uint16_t h);
// The exact values of OCP FP8 codes (src/warp.cpp): e4m3 (bias 7, no infinities, S.1111.111
// NaN) and e5m2 (bias 15, IEEE-style infinities and NaNs).
float e4m3_to_float(uint8_t code);
float e5m2_to_float(uint8_t code);

// wgmma.cpp
void compute_wgmma(const Collective& c, unsigned warp);
void wgmma_on_exit(Thread& t);

// mbarrier.cpp
std::string describe_mbarrier_wait(const Thread& t);
// A TMA load's copies tracked by the barrier at `bar` (they land when its phase completes)
// and its complete-tx of `bytes` (checked: never more bytes than the phase expects).
void mbarrier_track_tma(void* bar, std::vector<Copy>&& copies, int64_t bytes, ftemu_loc loc);
// What a read of word `w` of `sp` hits when a TMA load tracked by an mbarrier is in flight
// there (its issue site, barrier and phase), or "" when none is.
std::string describe_tma_in_flight(const SmemSpace& sp, size_t w);
// The copy in flight at word `w` of `sp` that an mbarrier tracks (its barrier in *bar), or null.
const Copy* tracked_copy(const SmemSpace& sp, size_t w, const void** bar);

// named_barrier.cpp
std::string describe_named_wait(const Thread& t);

// setmaxnreg.cpp
void setmaxnreg_begin_block(Launch& L);
void setmaxnreg_end_block(Launch& L);

// warp.cpp
void on_lane_exit(Thread& t);
// Fails when the exiting thread's copies are still tracked by an uncompleted mbarrier phase.
void mbarrier_on_exit(const Thread& t);
std::string describe_collective(const Collective& c);

}  // namespace ftemu
