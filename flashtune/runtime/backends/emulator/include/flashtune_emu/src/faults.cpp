// Faults of emulated code (SIGSEGV, SIGBUS, SIGFPE, SIGILL), the no-progress watchdog and
// the AddressSanitizer report hook. A fault in a fiber is recorded with the thread, the
// kind of memory it hit (a thread stack's guard page, the guard pages around dynamic shared
// memory, anything else) and the faulting function, and the fiber is abandoned: the launch
// ends with an error instead of taking the process down.
#include <dlfcn.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

namespace ftemu {

static const int kFaultSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
static struct sigaction g_old_actions[65];
static struct sigaction g_old_watchdog;
static stack_t g_old_altstack;
static unsigned char* g_altstack = nullptr;
static constexpr size_t kAltStackBytes = 1 << 16;
static constexpr double kWatchdogPeriodS = 0.1;
static timer_t g_timer;
static bool g_timer_armed = false;
static uint64_t g_watchdog_seen = 0;
static unsigned g_watchdog_still = 0;
static const char* g_current_op = nullptr;  // set around runtime reads of kernel pointers

long current_os_tid() { return syscall(SYS_gettid); }

void set_current_op(const char* what) { g_current_op = what; }

#if defined(__SANITIZE_ADDRESS__)
static void on_asan_report(const char* report) {
    if (g_launch && current_os_tid() == g_launch->os_tid) g_launch->asan_report += report;
}
#endif

static std::string describe_fault(const Launch& L, int sig, const void* addr) {
    auto* a = static_cast<const unsigned char*>(addr);
    if (sig == SIGFPE) return "arithmetic exception (SIGFPE: integer division by zero?)";
    if (sig == SIGILL) return "illegal instruction (SIGILL)";
    if (L.stacks_map && a >= L.stacks_map && a < L.stacks_map + L.stacks_map_bytes)
        return format("stack overflow of the emulated thread (stack of %llu bytes; use a "
                      "larger stack_bytes when launching)", L.cfg->stack_bytes);
    if (L.arena_map && a >= L.arena_map && a < L.arena_map + L.arena_map_bytes) {
        long long off = a - L.dyn.base;
        return format("shared memory access out of bounds: byte offset %lld of the %zu-byte "
                      "dynamic shared memory", off, L.dyn.size);
    }
    std::string what = format("invalid memory access at address %p (%s): a global pointer out "
                              "of bounds, null or dangling", addr,
                              sig == SIGBUS ? "SIGBUS" : "SIGSEGV");
    if (g_current_op) what += format(" while %s", g_current_op);
    return what;
}

static std::string code_location(const void* pc) {
    Dl_info info;
    if (pc && dladdr(pc, &info) && info.dli_sname)
        return format(" in %s+0x%lx", info.dli_sname,
                      static_cast<unsigned long>(static_cast<const char*>(pc) -
                                                 static_cast<const char*>(info.dli_saddr)));
    return "";
}

static const void* fault_pc(void* uctx) {
#if defined(__x86_64__)
    return reinterpret_cast<const void*>(
        static_cast<ucontext_t*>(uctx)->uc_mcontext.gregs[REG_RIP]);
#else
    (void)uctx;
    return nullptr;
#endif
}

static void on_fault(int sig, siginfo_t* info, void* uctx) {
    Launch* L = g_launch;
    if (L && L->cur && current_os_tid() == L->os_tid) {
        Thread& me = *L->cur;
        record_error(FTEMU_ERROR, where(me) + ": " + describe_fault(*L, sig, info->si_addr) +
                                      code_location(fault_pc(uctx)));
        abandon_current();
    }
    // Not a fault of emulated code: restore the previous disposition and let the faulting
    // instruction run again under it.
    sigaction(sig, &g_old_actions[sig], nullptr);
}

static bool in_kernel_code(const Launch& L, const void* pc) {
    Dl_info kinfo, pinfo;
    if (!pc || !dladdr(reinterpret_cast<const void*>(L.kernel->body), &kinfo)) return false;
    return dladdr(pc, &pinfo) && pinfo.dli_fbase == kinfo.dli_fbase;
}

static void on_watchdog(int, siginfo_t*, void* uctx) {
    Launch* L = g_launch;
    if (!L || !L->cur || current_os_tid() != L->os_tid) return;
    if (L->switches != g_watchdog_seen) {
        g_watchdog_seen = L->switches;
        g_watchdog_still = 0;
        return;
    }
    if (++g_watchdog_still * kWatchdogPeriodS < L->cfg->hang_timeout_s) return;
    // Abandon the thread only while it runs kernel code: inside libc or the runtime it may
    // hold a lock (malloc) that the rest of the launch needs.
    if (!in_kernel_code(*L, fault_pc(uctx))) return;
    Thread& me = *L->cur;
    record_error(FTEMU_DEADLOCK,
                 where(me) + format(": no progress for %.1f s: the thread runs without reaching "
                                    "a barrier, a warp collective or its end (endless loop?)",
                                    L->cfg->hang_timeout_s) +
                     code_location(fault_pc(uctx)));
    abandon_current();
}

void install_handlers(Launch& L) {
#if defined(__SANITIZE_ADDRESS__)
    __asan_set_error_report_callback(on_asan_report);
#endif
    g_altstack = static_cast<unsigned char*>(
        mmap(nullptr, kAltStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    stack_t ss{};
    ss.ss_sp = g_altstack;
    ss.ss_size = kAltStackBytes;
    sigaltstack(&ss, &g_old_altstack);
    struct sigaction sa{};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    for (int sig : kFaultSignals) sigaction(sig, &sa, &g_old_actions[sig]);

    g_timer_armed = false;
    if (L.cfg->hang_timeout_s > 0) {
        struct sigaction wa{};
        wa.sa_sigaction = on_watchdog;
        wa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER | SA_RESTART;
        sigemptyset(&wa.sa_mask);
        sigaction(SIGRTMIN + 5, &wa, &g_old_watchdog);
        struct sigevent sev{};
        sev.sigev_notify = SIGEV_THREAD_ID;
        sev.sigev_signo = SIGRTMIN + 5;
        sev._sigev_un._tid = static_cast<pid_t>(L.os_tid);
        if (timer_create(CLOCK_MONOTONIC, &sev, &g_timer) == 0) {
            struct itimerspec its{};
            its.it_interval.tv_nsec = static_cast<long>(kWatchdogPeriodS * 1e9);
            its.it_value = its.it_interval;
            timer_settime(g_timer, 0, &its, nullptr);
            g_timer_armed = true;
        }
        g_watchdog_seen = 0;
        g_watchdog_still = 0;
    }
}

void uninstall_handlers(Launch& L) {
#if defined(__SANITIZE_ADDRESS__)
    __asan_set_error_report_callback(nullptr);
#endif
    if (g_timer_armed) {
        timer_delete(g_timer);
        g_timer_armed = false;
    }
    if (L.cfg->hang_timeout_s > 0) sigaction(SIGRTMIN + 5, &g_old_watchdog, nullptr);
    for (int sig : kFaultSignals) sigaction(sig, &g_old_actions[sig], nullptr);
    stack_t cur{};
    sigaltstack(&g_old_altstack, &cur);
    munmap(g_altstack, kAltStackBytes);
    g_altstack = nullptr;
}


}  // namespace ftemu
