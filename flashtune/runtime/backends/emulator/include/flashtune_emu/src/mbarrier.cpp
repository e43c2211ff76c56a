// mbarrier objects (reference: the Hopper notes, section 6.3): an 8-byte object in shared
// memory with a phase, an expected and a pending arrival count and a transaction count. A
// phase completes when its pending arrivals and its transaction count are both zero; then
// the phase advances and the pending count is reset to the init count.
//
// The model and its checks:
//  * init writes the object; another thread may use it only after a __syncthreads (the
//    init is not visible to it before). A plain store or a copy into the 8 bytes is caught
//    at the next operation on the barrier (the emulator keeps its own image of them).
//  * cp.async.mbarrier.arrive.noinc takes the calling thread's cp.async copies in flight
//    into the barrier's current phase: they land, already visible to every thread, when the
//    phase completes (not before: reading them earlier reads in-flight data, an error for
//    ldmatrix and wgmma and poison for plain loads), then the arrival counts.
//  * a plain arrive releases the thread's landed, not yet published cp.async data: it becomes
//    visible to every thread when the phase completes. Reads of shared memory made by the
//    warps that arrived stop counting as write-after-read hazards for later copies.
//  * try_wait.parity returns at once when the phase of that parity is the one just completed
//    (the current phase has the other parity); otherwise the thread blocks until the phase
//    completes. A barrier that completed two phases while a thread waited on the first of
//    them is an error (the waiter fell a phase behind: it would miss its phase on a GPU).
//  * no runnable thread while some wait: a deadlock, named by barrier, phase and counts.
//  * a thread that exits while cp.async copies it issued are tracked by a phase that has not
//    completed is an error: its deferred arrival (cp.async.mbarrier.arrive.noinc) and its
//    writes would still be pending after it is gone (wait first, e.g. until the consumers
//    released every stage).
//  * an arrival beyond the init count, a transaction count outside +-(2^20 - 1), a count
//    outside 1 .. 2^20 - 1 and a misaligned or non-shared object are errors.
#include <cstring>

#include "internal.h"

namespace ftemu {

namespace {

constexpr int64_t kMaxTx = (1 << 20) - 1;

uint64_t image_of(const MBarrier& b) {
    // A recognisable encoding of the state (the GPU's bit layout is opaque).
    return 0xB0ull << 56 | (b.phase & 0xFFFFFF) << 32 | static_cast<uint64_t>(b.pending) << 12 |
           (b.expected & 0xFFF);
}

std::string name_of(const void* bar) { return "the mbarrier at " + describe_smem_address(bar); }

void store_image(const void* bar, MBarrier& b) {
    b.image = image_of(b);
    std::memcpy(const_cast<void*>(bar), &b.image, 8);
}

void check_object(const void* bar, const char* op, ftemu_loc loc) {
    if (reinterpret_cast<uintptr_t>(bar) % 8)
        fail(FTEMU_ERROR, format("%s at %s: %s is not 8-byte aligned", op, at(loc).c_str(),
                                 name_of(bar).c_str()));
    SmemSpace* sp = locate_shared(bar);
    if (!sp || static_cast<const unsigned char*>(bar) + 8 > sp->base + sp->size)
        fail(FTEMU_ERROR, format("%s at %s: the object at %s is not inside the block's shared "
                                 "memory", op, at(loc).c_str(), describe_smem_address(bar).c_str()));
}

// The initialised barrier at `bar`, after the checks every operation shares.
MBarrier& lookup(const void* bar, const char* op, ftemu_loc loc) {
    Launch& L = *g_launch;
    check_async_errors();
    check_object(bar, op, loc);
    auto it = L.mbarriers.find(reinterpret_cast<uintptr_t>(bar));
    if (it == L.mbarriers.end())
        fail(FTEMU_ERROR, format("%s at %s: %s was never initialised in this block (call "
                                 "mbarrier_init first)", op, at(loc).c_str(),
                                 name_of(bar).c_str()));
    MBarrier& b = it->second;
    const Thread& me = *L.cur;
    if (me.tid != b.init_tid && L.epoch == b.init_epoch)
        fail(FTEMU_ERROR, format(
            "%s at %s: %s was initialised by thread %u at %s and no __syncthreads since then "
            "has made the init visible to thread %u", op, at(loc).c_str(), name_of(bar).c_str(),
            b.init_tid, at(b.init_loc).c_str(), me.tid));
    uint64_t now;
    std::memcpy(&now, bar, 8);
    if (now != b.image)
        fail(FTEMU_ERROR, format(
            "%s at %s: the 8 bytes of %s were overwritten (0x%016llx, expected 0x%016llx): "
            "only mbarrier operations may touch an initialised barrier", op, at(loc).c_str(),
            name_of(bar).c_str(), static_cast<unsigned long long>(now),
            static_cast<unsigned long long>(b.image)));
    return b;
}

// Clears the read records of the warps that arrived: their reads happened before their
// arrivals, so copies issued after a wait on this phase do not race with them.
void release_reads(Launch& L, uint32_t warps) {
    for (SmemSpace* sp : {&L.dyn, &L.stat})
        for (size_t w = 0; w < sp->read_epoch.size(); ++w)
            if (sp->read_epoch[w] == L.epoch + 1 && (warps >> sp->reader_warp[w] & 1u))
                sp->read_epoch[w] = 0;
}

void complete_if_ready(const void* bar, MBarrier& b) {
    if (b.pending != 0 || b.tx != 0) return;
    Launch& L = *g_launch;
    std::vector<Copy> copies;
    copies.swap(b.copies);
    // Copies are grouped by issuing thread (owner recorded per word at issue).
    std::map<unsigned, std::vector<Copy>> by_thread;
    for (const Copy& c : copies) by_thread[c.space->owner[c.word]].push_back(c);
    for (const auto& [tid, list] : by_thread) land_published(tid, list);
    for (const auto& [tid, region] : b.released) publish_region(tid, region);
    b.released.clear();
    release_reads(L, b.arrived_warps);
    b.arrived_warps = 0;
    ++b.phase;
    b.pending = b.expected;
    store_image(bar, b);
    for (Thread& t : L.threads)
        if (t.state == TState::AtMbarrier && t.wait_bar == bar) make_runnable(t);
}

void arrive(const void* bar, MBarrier& b, const char* op, ftemu_loc loc) {
    Thread& me = *g_launch->cur;
    if (b.pending == 0)
        fail(FTEMU_ERROR, format(
            "%s at %s: thread %u arrives on %s in phase %llu, whose %u arrivals have all been "
            "made (it waits for %lld transaction bytes): more arrivals than the init count",
            op, at(loc).c_str(), me.tid, name_of(bar).c_str(),
            static_cast<unsigned long long>(b.phase), b.expected, static_cast<long long>(b.tx)));
    --b.pending;
    b.arrived_warps |= 1u << (me.warp % 32);
    for (const Region& r : me.priv) b.released.emplace_back(me.tid, r);
    store_image(bar, b);
    complete_if_ready(bar, b);
}

void add_tx(const void* bar, MBarrier& b, int64_t delta, const char* op, ftemu_loc loc) {
    int64_t tx = b.tx + delta;
    if (tx > kMaxTx || tx < -kMaxTx)
        fail(FTEMU_ERROR, format("%s at %s: the transaction count of %s would become %lld, "
                                 "outside +-(2^20 - 1)", op, at(loc).c_str(),
                                 name_of(bar).c_str(), static_cast<long long>(tx)));
    b.tx = tx;
}

}  // namespace

void mbarrier_on_exit(const Thread& t) {
    const Launch& L = *g_launch;
    for (const auto& [addr, b] : L.mbarriers)
        for (const Copy& c : b.copies)
            if (!c.tma && c.space->owner[c.word] == t.tid)
                fail(FTEMU_ERROR, format(
                    "thread %u returned with cp.async copies in flight (the one at %s), tracked "
                    "by cp.async_mbarrier_arrive on %s, whose phase %llu has not completed: the "
                    "thread must not exit before its copies land (wait on that barrier, or "
                    "until every stage it filled is released)", t.tid, at(c.loc).c_str(),
                    name_of(reinterpret_cast<const void*>(addr)).c_str(),
                    static_cast<unsigned long long>(b.phase)));
}

void mbarrier_track_tma(void* bar, std::vector<Copy>&& copies, int64_t bytes, ftemu_loc loc) {
    MBarrier& b = lookup(bar, "tma_load", loc);
    for (Copy& c : copies) b.copies.push_back(c);
    add_tx(bar, b, -bytes, "tma_load", loc);
    if (b.pending == 0 && b.tx < 0)
        fail(FTEMU_ERROR, format(
            "tma_load at %s: the %lld bytes of the box complete %lld more transaction bytes "
            "than phase %llu of %s expects (all %u arrivals made): the expect-tx count must "
            "equal the bytes of the boxes loaded into the stage (out-of-bounds elements "
            "included)", at(loc).c_str(), static_cast<long long>(bytes),
            static_cast<long long>(-b.tx), static_cast<unsigned long long>(b.phase),
            name_of(bar).c_str(), b.expected));
    store_image(bar, b);
    complete_if_ready(bar, b);
}

const Copy* tracked_copy(const SmemSpace& sp, size_t w, const void** bar) {
    for (const auto& [key, b] : g_launch->mbarriers)
        for (const Copy& c : b.copies)
            if (c.space == &sp && w >= c.word && w < c.word + c.nwords) {
                *bar = reinterpret_cast<const void*>(key);
                return &c;
            }
    return nullptr;
}

std::string describe_tma_in_flight(const SmemSpace& sp, size_t w) {
    const void* bar = nullptr;
    const Copy* c = tracked_copy(sp, w, &bar);
    if (!c) return "";
    const MBarrier& b = g_launch->mbarriers.at(reinterpret_cast<uintptr_t>(bar));
    return format(
                    "whose asynchronous copy (issued by thread %u at %s) lands only when phase "
                    "%llu of %s completes, and it has not: the reader did not wait for that "
                    "phase (a wait on the wrong parity, or a phase that completed before the "
                    "copy's bytes were expected: a missing expect-tx)", sp.owner[w],
                    at(c->loc).c_str(), static_cast<unsigned long long>(b.phase),
                    name_of(bar).c_str());
}

std::string describe_mbarrier_wait(const Thread& t) {
    const Launch& L = *g_launch;
    auto it = L.mbarriers.find(reinterpret_cast<uintptr_t>(t.wait_bar));
    std::string where_ = "mbarrier_try_wait at " + at(t.wait_loc);
    if (it == L.mbarriers.end()) return "wait in " + where_ + " on a barrier no longer known";
    const MBarrier& b = it->second;
    return format("wait in %s on %s (initialised at %s) for phase %llu (parity %llu) to "
                  "complete: %u of %u arrivals missing, transaction count %lld",
                  where_.c_str(), name_of(t.wait_bar).c_str(), at(b.init_loc).c_str(),
                  static_cast<unsigned long long>(t.wait_phase),
                  static_cast<unsigned long long>(t.wait_phase & 1), b.pending, b.expected,
                  static_cast<long long>(b.tx));
}

}  // namespace ftemu

using namespace ftemu;

extern "C" FTEMU_API void ftemu_mbarrier_init(void* bar, unsigned count, ftemu_loc loc) {
    Launch& L = *g_launch;
    check_async_errors();
    check_object(bar, "mbarrier_init", loc);
    if (count < 1 || count > kMaxTx)
        fail(FTEMU_ERROR, format("mbarrier_init at %s: count %u is outside 1 .. 2^20 - 1",
                                 at(loc).c_str(), count));
    auto key = reinterpret_cast<uintptr_t>(bar);
    auto it = L.mbarriers.find(key);
    if (it != L.mbarriers.end()) {
        for (const Thread& t : L.threads)
            if (t.state == TState::AtMbarrier && t.wait_bar == bar)
                fail(FTEMU_ERROR, format("mbarrier_init at %s: %s is re-initialised while "
                                         "thread %u waits on it", at(loc).c_str(),
                                         name_of(bar).c_str(), t.tid));
    }
    MBarrier b;
    b.expected = b.pending = count;
    b.init_tid = L.cur->tid;
    b.init_epoch = L.epoch;
    b.init_loc = loc;
    MBarrier& stored = L.mbarriers[key] = b;
    store_image(bar, stored);
}

extern "C" FTEMU_API void ftemu_mbarrier_arrive(void* bar, unsigned expect_tx, ftemu_loc loc) {
    const char* op = expect_tx ? "mbarrier_arrive_expect_tx" : "mbarrier_arrive";
    MBarrier& b = lookup(bar, op, loc);
    add_tx(bar, b, expect_tx, op, loc);
    if (b.pending == 1 && b.tx < 0)
        fail(FTEMU_ERROR, format(
            "%s at %s: the last arrival of phase %llu on %s leaves %lld transaction bytes "
            "completed beyond those expected (expect-tx %u): the expect-tx count must equal "
            "the bytes of the boxes loaded into the stage", op, at(loc).c_str(),
            static_cast<unsigned long long>(b.phase), name_of(bar).c_str(),
            static_cast<long long>(-b.tx), expect_tx));
    arrive(bar, b, op, loc);
}

extern "C" FTEMU_API void ftemu_mbarrier_complete_tx(void* bar, unsigned tx, ftemu_loc loc) {
    MBarrier& b = lookup(bar, "mbarrier_complete_tx", loc);
    add_tx(bar, b, -static_cast<int64_t>(tx), "mbarrier_complete_tx", loc);
    complete_if_ready(bar, b);
}

extern "C" FTEMU_API void ftemu_mbarrier_cp_async_arrive(void* bar, ftemu_loc loc) {
    Thread& me = *g_launch->cur;
    MBarrier& b = lookup(bar, "cp_async_mbarrier_arrive", loc);
    // Every cp.async this thread has issued and not waited for is tracked by this arrival;
    // its groups stay (empty), so wait_group counts are unchanged.
    for (Copy& c : me.uncommitted) b.copies.push_back(c);
    me.uncommitted.clear();
    for (auto& g : me.groups) {
        for (Copy& c : g) b.copies.push_back(c);
        g.clear();
    }
    arrive(bar, b, "cp_async_mbarrier_arrive", loc);
}

extern "C" FTEMU_API int ftemu_mbarrier_try_wait_parity(void* bar, unsigned parity,
                                                        ftemu_loc loc) {
    Launch& L = *g_launch;
    Thread& me = *L.cur;
    MBarrier& b = lookup(bar, "mbarrier_try_wait", loc);
    if (parity > 1)
        fail(FTEMU_ERROR, format("mbarrier_try_wait at %s: parity %u is not 0 or 1",
                                 at(loc).c_str(), parity));
    if ((b.phase & 1) != parity) return 1;  // the phase of this parity is the one completed
    const uint64_t waited = b.phase;
    me.wait_bar = bar;
    me.wait_phase = waited;
    me.wait_loc = loc;
    make_blocked(me, TState::AtMbarrier);
    suspend(me);
    me.wait_bar = nullptr;
    MBarrier& now = lookup(bar, "mbarrier_try_wait", loc);
    if (now.phase > waited + 1)
        fail(FTEMU_ERROR, format(
            "mbarrier_try_wait at %s: thread %u waited for phase %llu of %s, which completed "
            "phase %llu as well before the thread ran again: the waiter fell a phase behind "
            "(on a GPU its parity would name the phase in progress; a stage is reused before "
            "every consumer released it)", at(loc).c_str(), me.tid,
            static_cast<unsigned long long>(waited), name_of(bar).c_str(),
            static_cast<unsigned long long>(waited + 1)));
    return 1;
}
