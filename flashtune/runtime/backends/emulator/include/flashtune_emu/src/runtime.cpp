// The emulator runtime: launches, the fiber scheduler, block barriers, errors and faults.
#include <pthread.h>
#include <sys/mman.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>

#include "internal.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define FTEMU_ASAN 1
#else
#define FTEMU_ASAN 0
#endif

extern "C" {
FTEMU_API ftemu_thread_ctx* ftemu_current = nullptr;
}

namespace ftemu {

Launch* g_launch = nullptr;
static std::mutex g_run_mutex;  // one launch at a time per process (global fiber state)

// ---------------------------------------------------------------------------------------
// Messages

std::string format(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    va_list ap2;
    va_copy(ap2, ap);
    int n = std::vsnprintf(nullptr, 0, fmt, ap);
    va_end(ap);
    std::string out(n > 0 ? static_cast<size_t>(n) : 0, '\0');
    if (n > 0) std::vsnprintf(out.data(), out.size() + 1, fmt, ap2);
    va_end(ap2);
    return out;
}

std::string at(ftemu_loc loc) {
    if (!loc.file) return "<unknown location>";
    const char* base = std::strrchr(loc.file, '/');
    return format("%s:%u", base ? base + 1 : loc.file, loc.line);
}

std::string lane_list(unsigned lanes) {
    std::string out;
    for (int i = 0; i < 32;) {
        if (!(lanes >> i & 1u)) {
            ++i;
            continue;
        }
        int j = i;
        while (j + 1 < 32 && (lanes >> (j + 1) & 1u)) ++j;
        if (!out.empty()) out += ",";
        out += i == j ? format("%d", i) : format("%d-%d", i, j);
        i = j + 1;
    }
    return out.empty() ? "none" : out;
}

std::string where(const Thread& t) {
    const ftemu_thread_ctx& c = t.ctx;
    return format("block (%u,%u,%u), thread (%u,%u,%u) [warp %u, lane %u]", c.block_idx.x,
                  c.block_idx.y, c.block_idx.z, c.thread_idx.x, c.thread_idx.y, c.thread_idx.z,
                  t.warp, t.lane);
}

void record_error(int status, const std::string& message) {
    Launch& L = *g_launch;
    if (L.status != FTEMU_OK) return;  // the first fault explains the launch
    L.status = status;
    L.message = format("kernel %s: ", L.kernel->name) + message;
}

#if FTEMU_ASAN
static void asan_start(void** fake_save, const void* bottom, size_t size) {
    __sanitizer_start_switch_fiber(fake_save, bottom, size);
}
static void asan_finish(void* fake_save) {
    __sanitizer_finish_switch_fiber(fake_save, nullptr, nullptr);
}
#else
static void asan_start(void**, const void*, size_t) {}
static void asan_finish(void*) {}
#endif

void abandon_current() {
    Launch& L = *g_launch;
    Thread* me = L.cur;
    L.cur = nullptr;
    ftemu_current = nullptr;
    asan_start(nullptr, L.sched_stack_bottom, L.sched_stack_size);
    context_switch(&me->context, &L.sched);
    __builtin_trap();  // an abandoned fiber is never resumed
}

void fail(int status, const std::string& message) {
    Launch& L = *g_launch;
    record_error(status, (L.cur ? where(*L.cur) + ": " : std::string()) + message);
    abandon_current();
}

// The part of an AddressSanitizer report that explains it (the shadow-byte dump is noise).
static std::string trim_report(const std::string& report) {
    size_t cut = report.find("Shadow bytes around");
    return cut == std::string::npos ? report : report.substr(0, cut);
}

void check_async_errors() {
    Launch& L = *g_launch;
    if (!L.asan_report.empty()) {
        std::string report;
        report.swap(L.asan_report);
        fail(FTEMU_ERROR, "AddressSanitizer reported a bad memory access (global memory out "
                          "of bounds or a dangling pointer):\n" + trim_report(report));
    }
}

// ---------------------------------------------------------------------------------------
// Scheduling

void make_runnable(Thread& t) {
    Launch& L = *g_launch;
    t.state = TState::Runnable;
    L.runnable[t.tid / 64] |= uint64_t{1} << (t.tid % 64);
}

void make_blocked(Thread& t, TState state) {
    Launch& L = *g_launch;
    t.state = state;
    L.runnable[t.tid / 64] &= ~(uint64_t{1} << (t.tid % 64));
}

static Thread* pick_next(Launch& L) {
    if (L.cfg->schedule == FTEMU_SCHEDULE_REVERSE) {
        for (size_t i = L.runnable.size(); i-- > 0;)
            if (L.runnable[i]) return &L.threads[i * 64 + 63 - __builtin_clzll(L.runnable[i])];
    } else {
        for (size_t i = 0; i < L.runnable.size(); ++i)
            if (L.runnable[i]) return &L.threads[i * 64 + __builtin_ctzll(L.runnable[i])];
    }
    return nullptr;
}

// Switches from `me` to the next runnable thread (or the scheduler when none is left);
// returns when some thread resumes `me`. `fake_save` is null when `me` will never resume.
static void switch_away(Thread& me, void** fake_save) {
    Launch& L = *g_launch;
    Thread* next = pick_next(L);
    hide(me);
    ++L.switches;
    if (next) {
        unhide(*next);
        L.cur = next;
        ftemu_current = &next->ctx;
        asan_start(fake_save, next->stack_lo, next->stack_size);
        context_switch(&me.context, &next->context);
    } else {
        L.cur = nullptr;
        ftemu_current = nullptr;
        asan_start(fake_save, L.sched_stack_bottom, L.sched_stack_size);
        context_switch(&me.context, &L.sched);
    }
    asan_finish(me.asan_fake_stack);
}

void suspend(Thread& me) {
    switch_away(me, &me.asan_fake_stack);
    check_async_errors();
}

// ---------------------------------------------------------------------------------------
// Block barrier

static bool same_loc(ftemu_loc a, ftemu_loc b) {
    return a.line == b.line && (a.file == b.file || (a.file && b.file && !std::strcmp(a.file, b.file)));
}

static void complete_barrier(Launch& L) {
    if (L.counters) ++L.counters->barrier_count;
    publish_all(L);
    ++L.epoch;
    L.barrier_arrived = 0;
    for (Thread& t : L.threads)
        if (t.state == TState::AtBarrier) make_runnable(t);
}

void complete_barrier_if_ready() {
    Launch& L = *g_launch;
    if (L.barrier_arrived > 0 && L.barrier_arrived == L.live) complete_barrier(L);
}

static std::string threads_at_barrier(const Launch& L) {
    std::string out;
    for (unsigned w = 0; w < L.nwarps; ++w) {
        unsigned lanes = 0;
        for (unsigned l = 0; l < 32 && w * 32 + l < L.nthreads; ++l)
            if (L.threads[w * 32 + l].state == TState::AtBarrier) lanes |= 1u << l;
        if (lanes) out += format("%swarp %u lanes %s", out.empty() ? "" : "; ", w,
                                 lane_list(lanes).c_str());
    }
    return out;
}

// ---------------------------------------------------------------------------------------
// Thread life cycle

[[noreturn]] static void thread_exit(Thread& me) {
    Launch& L = *g_launch;
    check_async_errors();
    mbarrier_on_exit(me);
    land_all(me);  // copies never waited for still complete; published by the next barrier
    make_blocked(me, TState::Exited);
    --L.live;
    L.warps[me.warp].exited |= 1u << me.lane;
    on_lane_exit(me);
    complete_barrier_if_ready();
    switch_away(me, nullptr);
    __builtin_trap();
}

static void fiber_main() {
    Launch& L = *g_launch;
#if FTEMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    Thread& me = *L.cur;
    // An exception must not unwind past the fiber's first frame (there is no caller).
    try {
        L.kernel->body(L.kernel->closure);
    } catch (const std::exception& exc) {
        fail(FTEMU_ERROR, format("C++ exception escaped the kernel: %s", exc.what()));
    } catch (...) {
        fail(FTEMU_ERROR, "C++ exception of unknown type escaped the kernel");
    }
    thread_exit(me);
}

// ---------------------------------------------------------------------------------------
// Deadlock report

static std::string lane_status(const Launch& L, const Thread& t) {
    switch (t.state) {
        case TState::Exited: return "returned";
        case TState::AtBarrier: return "wait at __syncthreads (" + at(t.wait_loc) + ")";
        case TState::InCollective:
            return "wait in " + describe_collective(L.warps[t.warp].pool[t.collective]);
        case TState::AtMbarrier: return describe_mbarrier_wait(t);
        case TState::AtNamedBarrier: return describe_named_wait(t);
        case TState::Runnable: break;
    }
    return "runnable";
}

static std::string deadlock_report(const Launch& L) {
    std::string out = format(
        "block (%u,%u,%u): deadlock, no thread can make progress (%u of %u threads have not "
        "returned):", L.block_idx.x, L.block_idx.y, L.block_idx.z, L.live, L.nthreads);
    for (unsigned w = 0; w < L.nwarps; ++w) {
        const Warp& W = L.warps[w];
        if ((W.exited & W.present) == W.present) continue;
        out += format("\n  warp %u:", w);
        unsigned done = 0;
        for (unsigned l = 0; l < 32; ++l) {
            if (!(W.present >> l & 1u) || (done >> l & 1u)) continue;
            std::string status = lane_status(L, L.threads[w * 32 + l]);
            unsigned lanes = 0;
            for (unsigned m = l; m < 32; ++m)
                if ((W.present >> m & 1u) && lane_status(L, L.threads[w * 32 + m]) == status)
                    lanes |= 1u << m;
            done |= lanes;
            out += format(" lanes %s %s;", lane_list(lanes).c_str(), status.c_str());
        }
        out.pop_back();
    }
    out += "\n  (a warp collective needs every lane named in its mask, mma and ldmatrix all 32; "
           "__syncthreads needs every thread that has not returned; an mbarrier phase needs its "
           "init count of arrivals and a zero transaction count; a named barrier its count of "
           "threads)";
    return out;
}

// ---------------------------------------------------------------------------------------
// Launch

static constexpr size_t kPage = 4096;
static size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

static std::string validate(const ftemu_launch_config& c, const ftemu_kernel_desc& k) {
    const unsigned* g = c.grid;
    const unsigned* b = c.block;
    if (!g[0] || !g[1] || !g[2] || g[1] > 65535 || g[2] > 65535 || g[0] > 0x7fffffffu)
        return format("grid (%u,%u,%u) is invalid: each dimension must be >= 1, y and z "
                      "<= 65535", g[0], g[1], g[2]);
    unsigned long long n = 1ull * b[0] * b[1] * b[2];
    if (!b[0] || !b[1] || !b[2] || b[2] > 64 || n > 1024)
        return format("block (%u,%u,%u) is invalid: each dimension must be >= 1, z <= 64 and "
                      "at most 1024 threads in all", b[0], b[1], b[2]);
    if (c.dyn_smem_bytes + k.static_smem_bytes > c.smem_limit_bytes)
        return format("shared memory %llu bytes (%llu dynamic + %llu static) exceeds the limit "
                      "of %llu bytes per block", c.dyn_smem_bytes + k.static_smem_bytes,
                      c.dyn_smem_bytes, k.static_smem_bytes, c.smem_limit_bytes);
    if (c.stack_bytes < 16384 || c.stack_bytes > (1ull << 26))
        return format("stack_bytes=%llu is invalid; expected 16 KiB .. 64 MiB", c.stack_bytes);
    if (c.schedule != FTEMU_SCHEDULE_FORWARD && c.schedule != FTEMU_SCHEDULE_REVERSE)
        return format("schedule=%d is invalid; expected 0 (forward) or 1 (reverse)", c.schedule);
    if (c.block_order != FTEMU_BLOCK_ORDER_LINEAR && c.block_order != FTEMU_BLOCK_ORDER_SHUFFLED)
        return format("block_order=%d is invalid; expected 0 (linear) or 1 (shuffled)",
                      c.block_order);
    return "";
}

static bool allocate(Launch& L) {
    const ftemu_launch_config& c = *L.cfg;
    size_t stack = round_up(c.stack_bytes, kPage);
    L.stacks_map_bytes = L.nthreads * (stack + kPage);
    void* m = mmap(nullptr, L.stacks_map_bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return false;
    L.stacks_map = static_cast<unsigned char*>(m);
    for (unsigned i = 0; i < L.nthreads; ++i) {
        unsigned char* guard = L.stacks_map + i * (stack + kPage);
        mprotect(guard, kPage, PROT_NONE);  // stacks grow down into their guard page
        L.threads[i].stack_lo = guard + kPage;
        L.threads[i].stack_size = stack;
    }
    size_t dyn = c.dyn_smem_bytes;
    if (L.asan) {
        // Exactly `dyn` bytes from the (ASan) allocator: its red zones catch overruns.
        void* p = nullptr;
        if (posix_memalign(&p, 128, dyn ? dyn : 1)) return false;
        L.dyn.assign("dynamic", static_cast<unsigned char*>(p), dyn);
    } else {
        // guard page | slack | arena (128-byte aligned, ending within 127 bytes of) | guard
        size_t body = round_up(round_up(dyn, 128) + 1, kPage);
        L.arena_map_bytes = body + 2 * kPage;
        m = mmap(nullptr, L.arena_map_bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return false;
        L.arena_map = static_cast<unsigned char*>(m);
        mprotect(L.arena_map, kPage, PROT_NONE);
        mprotect(L.arena_map + kPage + body, kPage, PROT_NONE);
        L.dyn.assign("dynamic", L.arena_map + kPage + body - round_up(dyn, 128), dyn);
    }
    L.stat.assign("static", L.kernel->static_smem,
                  L.kernel->static_smem ? L.kernel->static_smem_bytes : 0);
    return true;
}

static void release(Launch& L) {
#if FTEMU_ASAN
    // The fibers' frames that never returned leave red zones in the stacks' shadow (and the
    // arena may hold poisoned slack); the process may map these pages again for anything
    // (the interpreter's allocator, say), whose writes would then be reported as
    // stack-buffer-underflows, so the shadow is cleared before the pages go back.
    if (L.stacks_map) __asan_unpoison_memory_region(L.stacks_map, L.stacks_map_bytes);
    if (L.arena_map) __asan_unpoison_memory_region(L.arena_map, L.arena_map_bytes);
#endif
    if (L.stacks_map) munmap(L.stacks_map, L.stacks_map_bytes);
    if (L.arena_map) munmap(L.arena_map, L.arena_map_bytes);
    else if (L.asan) std::free(L.dyn.base);
    for (Thread& t : L.threads) context_release(&t.context);
    context_release(&L.sched);
}

// splitmix64: a small, fully specified generator, so a seed names the same block order on
// every platform and standard library (std::shuffle's algorithm is unspecified).
static unsigned long long splitmix64(unsigned long long& state) {
    unsigned long long z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The linear block indices 0 .. n-1 in the order of a Fisher-Yates shuffle seeded by `seed`.
static std::vector<unsigned long long> shuffled_order(unsigned long long n,
                                                      unsigned long long seed) {
    std::vector<unsigned long long> order(n);
    for (unsigned long long i = 0; i < n; ++i) order[i] = i;
    unsigned long long state = seed;
    for (unsigned long long i = n; i > 1; --i) {
        // Uniform in [0, i) by rejection (no modulo bias).
        const unsigned long long limit = ~0ull - (~0ull % i);
        unsigned long long r;
        do r = splitmix64(state); while (r >= limit);
        std::swap(order[i - 1], order[r % i]);
    }
    return order;
}

static void run_block(Launch& L, unsigned bx, unsigned by, unsigned bz) {
    const ftemu_launch_config& c = *L.cfg;
    L.block_idx = uint3{bx, by, bz};
    L.block_linear = bx + 1ull * c.grid[0] * (by + 1ull * c.grid[1] * bz);
    for (unsigned i = 0; i < L.nthreads; ++i) {
        Thread& t = L.threads[i];
        t.ctx.thread_idx = uint3{i % c.block[0], i / c.block[0] % c.block[1],
                                 i / (c.block[0] * c.block[1])};
        t.ctx.block_idx = L.block_idx;
        t.ctx.block_dim = dim3(c.block[0], c.block[1], c.block[2]);
        t.ctx.grid_dim = dim3(c.grid[0], c.grid[1], c.grid[2]);
        t.ctx.dyn_smem = L.dyn.base;
        t.tid = i;
        t.warp = i / 32;
        t.lane = i % 32;
        t.collective = -1;
        t.uncommitted.clear();
        t.groups.clear();
        t.priv.clear();
        t.hidden = false;
        t.asan_fake_stack = nullptr;
        t.cp_seq = 0;
        t.nreg_calls = 0;
        context_init(&t.context, t.stack_lo, t.stack_size, fiber_main);
        make_runnable(t);
    }
    for (unsigned w = 0; w < L.nwarps; ++w) {
        Warp& W = L.warps[w];
        unsigned n = std::min(32u, L.nthreads - w * 32);
        W.present = n == 32 ? 0xffffffffu : (1u << n) - 1;
        W.exited = 0;
        for (Collective& col : W.pool) col.active = false;
    }
    L.live = L.nthreads;
    L.mbarriers.clear();
    setmaxnreg_begin_block(L);
    for (NamedBarrier& nb : L.named) nb = NamedBarrier{};
    L.barrier_arrived = 0;
    L.epoch = 0;
    smem_setup_block(L);

    void* sched_fake = nullptr;
    while (Thread* next = pick_next(L)) {
        unhide(*next);
        L.cur = next;
        ftemu_current = &next->ctx;
        ++L.switches;
        asan_start(&sched_fake, next->stack_lo, next->stack_size);
        context_switch(&L.sched, &next->context);
        asan_finish(sched_fake);
        if (L.status != FTEMU_OK) return;
    }
    if (L.live > 0) {
        record_error(FTEMU_DEADLOCK, deadlock_report(L));
        return;
    }
    setmaxnreg_end_block(L);
    if (L.status != FTEMU_OK) return;
    if (L.counters) counters_end_block(L);
    smem_check_slack(L);
}

static void sched_stack_bounds(Launch& L) {
    pthread_attr_t attr;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
        void* addr = nullptr;
        size_t size = 0;
        pthread_attr_getstack(&attr, &addr, &size);
        L.sched_stack_bottom = addr;
        L.sched_stack_size = size;
        pthread_attr_destroy(&attr);
    }
}

}  // namespace ftemu

using namespace ftemu;

extern "C" FTEMU_API const char* ftemu_runtime_version(void) {
    return FTEMU_ASAN ? "flashtune-emulator abi 3 asan" : "flashtune-emulator abi 3";
}

static int run_launch(const ftemu_launch_config* config, const ftemu_kernel_desc* kernel,
                      char* message, unsigned long long message_bytes) {
    auto report = [&](int status, const std::string& text) {
        if (message && message_bytes) std::snprintf(message, message_bytes, "%s", text.c_str());
        return status;
    };
    std::string bad = validate(*config, *kernel);
    if (!bad.empty()) return report(FTEMU_BAD_LAUNCH, format("kernel %s: ", kernel->name) + bad);

    Launch L;
    // Whatever happens below, the process gets its signal handlers and memory back.
    struct Cleanup {
        Launch& L;
        bool installed = false;
        ~Cleanup() {
            if (installed) uninstall_handlers(L);
            g_launch = nullptr;
            ftemu_current = nullptr;
            release(L);
        }
    } cleanup{L};
    L.cfg = config;
    L.kernel = kernel;
    L.asan = FTEMU_ASAN;
    L.counters = config->counters;
    if (L.counters) counters_begin_launch(L);
    L.nthreads = config->block[0] * config->block[1] * config->block[2];
    L.nwarps = (L.nthreads + 31) / 32;
    L.threads.resize(L.nthreads);
    L.warps.resize(L.nwarps);
    for (Warp& w : L.warps) w.pool.resize(32);
    L.runnable.assign((L.nthreads + 63) / 64, 0);
    L.os_tid = current_os_tid();
    if (!allocate(L)) {
        return report(FTEMU_BAD_LAUNCH, format("kernel %s: cannot allocate %u thread stacks of "
                                               "%llu bytes and the shared memory", kernel->name,
                                               L.nthreads, config->stack_bytes));
    }
    sched_stack_bounds(L);
    g_launch = &L;
    install_handlers(L);
    cleanup.installed = true;
    const unsigned long long gx = config->grid[0], gy = config->grid[1];
    const unsigned long long nblocks = gx * gy * config->grid[2];
    if (config->block_order == FTEMU_BLOCK_ORDER_LINEAR) {
        for (unsigned long long b = 0; b < nblocks && L.status == FTEMU_OK; ++b)
            run_block(L, b % gx, b / gx % gy, b / (gx * gy));
    } else {
        std::vector<unsigned long long> order = shuffled_order(nblocks,
                                                               config->block_order_seed);
        for (unsigned long long i = 0; i < nblocks && L.status == FTEMU_OK; ++i) {
            const unsigned long long b = order[i];
            run_block(L, b % gx, b / gx % gy, b / (gx * gy));
        }
    }
    if (L.status == FTEMU_OK && !L.asan_report.empty())
        record_error(FTEMU_ERROR, "AddressSanitizer reported a bad memory access:\n" +
                                      trim_report(L.asan_report));
    return report(L.status, L.message);
}

extern "C" FTEMU_API int ftemu_run(const ftemu_launch_config* config,
                                   const ftemu_kernel_desc* kernel, char* message,
                                   unsigned long long message_bytes) {
    std::lock_guard<std::mutex> lock(g_run_mutex);
    try {
        return run_launch(config, kernel, message, message_bytes);
    } catch (const std::exception& exc) {  // e.g. std::bad_alloc for a huge launch
        if (message && message_bytes)
            std::snprintf(message, message_bytes, "kernel %s: the emulator failed: %s",
                          kernel->name, exc.what());
        return FTEMU_BAD_LAUNCH;
    }
}

extern "C" FTEMU_API void ftemu_syncthreads(ftemu_loc loc) {
    Launch& L = *g_launch;
    Thread& me = *L.cur;
    check_async_errors();
    if ((L.cfg->checks & FTEMU_CHECK_BARRIER_SITE) && L.barrier_arrived > 0 &&
        !same_loc(loc, L.barrier_loc))
        fail(FTEMU_ERROR,
             format("__syncthreads at %s, while the threads already waiting (%s) reached the "
                    "one at %s: every thread of the block must reach the same __syncthreads "
                    "(a barrier in divergent code is undefined behaviour)",
                    at(loc).c_str(), threads_at_barrier(L).c_str(), at(L.barrier_loc).c_str()));
    if (L.barrier_arrived == 0) L.barrier_loc = loc;
    ++L.barrier_arrived;
    if (L.barrier_arrived == L.live) {
        complete_barrier(L);
        return;
    }
    me.wait_loc = loc;
    make_blocked(me, TState::AtBarrier);
    suspend(me);
}

extern "C" FTEMU_API void ftemu_fail(const char* message, ftemu_loc loc) {
    fail(FTEMU_ERROR, std::string(message) + " (at " + at(loc) + ")");
}
