// Shared memory: poison, bounds, and the visibility rules of cp.async.
//
// What is detected, and how:
//  * Shared memory (dynamic and static __shared__) holds poison (kPoisonWord) at block
//    start, so a read of never-written shared memory yields NaN.
//  * A cp.async poisons its destination at issue and its data lands only when a
//    cp_async_wait covers its group. Until then the destination word is Pending: an ldmatrix
//    that reads it is an error, a plain read sees poison (NaN).
//  * Landed data is private to the issuing thread until the next __syncthreads: the word is
//    PrivateVisible while the owner runs and PrivateHidden (poison in memory, data saved
//    aside) whenever the owner is switched out, so another thread's plain read sees poison
//    and its ldmatrix read is an error. The barrier publishes every private word.
//  * A cp.async into a word that is in flight, or private to another thread, or that a
//    different warp read with ldmatrix since the last barrier (write-after-read race), is an
//    error; so is memory that changed while it was hidden or in flight (another thread
//    stored to it: a race).
//  * ldmatrix rows and cp.async destinations must be aligned and lie inside the block's
//    shared memory. Plain stores and loads past the dynamic allocation hit a guard page
//    (caught as a fault) or, within the 128-byte alignment slack, are caught at block end
//    (stores) or read poison (loads). With AddressSanitizer the allocation is exact.
#include <cstring>
#include <functional>

#include "internal.h"

namespace ftemu {

static uint8_t poison_byte(uintptr_t addr) { return (addr & 1) ? 0xFF : 0xA5; }

static void fill_poison(unsigned char* p, size_t n) {
    size_t i = 0;
    for (; i < n && (reinterpret_cast<uintptr_t>(p + i) & 3); ++i)
        p[i] = poison_byte(reinterpret_cast<uintptr_t>(p + i));
    for (; i + 4 <= n; i += 4) std::memcpy(p + i, &kPoisonWord, 4);
    for (; i < n; ++i) p[i] = poison_byte(reinterpret_cast<uintptr_t>(p + i));
}

static size_t first_changed(const unsigned char* p, size_t n) {
    for (size_t i = 0; i < n; ++i)
        if (p[i] != poison_byte(reinterpret_cast<uintptr_t>(p + i))) return i;
    return n;
}

void SmemSpace::assign(const char* space_name, unsigned char* p, size_t bytes) {
    name = space_name;
    base = p;
    size = bytes;
    size_t words = (bytes + 3) / 4;
    state.assign(words, Word::Clean);
    owner.assign(words, 0);
    saved.assign(words, 0);
    read_epoch.assign(words, 0);
    reader_warp.assign(words, 0);
    reader_loc.assign(words, ftemu_loc{});
}

void SmemSpace::reset() {
    std::fill(state.begin(), state.end(), Word::Clean);
    std::fill(read_epoch.begin(), read_epoch.end(), 0u);
}

uint32_t SmemSpace::load(size_t w) const {
    uint32_t v;
    std::memcpy(&v, base + 4 * w, 4);
    return v;
}

void SmemSpace::store(size_t w, uint32_t v) { std::memcpy(base + 4 * w, &v, 4); }

void smem_setup_block(Launch& L) {
    if (L.arena_map) {
        size_t page = 4096;
        fill_poison(L.arena_map + page, L.arena_map_bytes - 2 * page);
    } else {
        fill_poison(L.dyn.base, L.dyn.size);
    }
    fill_poison(L.stat.base, L.stat.size);
    L.dyn.reset();
    L.stat.reset();
}

void smem_check_slack(Launch& L) {
    if (!L.arena_map) return;
    unsigned char* lo = L.arena_map + 4096;
    unsigned char* hi = L.arena_map + L.arena_map_bytes - 4096;
    unsigned char* end = L.dyn.base + L.dyn.size;
    size_t before = first_changed(lo, static_cast<size_t>(L.dyn.base - lo));
    if (before < static_cast<size_t>(L.dyn.base - lo)) {
        record_error(FTEMU_ERROR, format(
            "block (%u,%u,%u): a thread stored to shared memory out of bounds, at byte offset "
            "%lld of the %zu-byte dynamic shared memory", L.block_idx.x, L.block_idx.y,
            L.block_idx.z, static_cast<long long>(lo + before - L.dyn.base), L.dyn.size));
        return;
    }
    size_t after = first_changed(end, static_cast<size_t>(hi - end));
    if (after < static_cast<size_t>(hi - end))
        record_error(FTEMU_ERROR, format(
            "block (%u,%u,%u): a thread stored to shared memory out of bounds, at byte offset "
            "%zu of the %zu-byte dynamic shared memory", L.block_idx.x, L.block_idx.y,
            L.block_idx.z, L.dyn.size + after, L.dyn.size));
}

// ---------------------------------------------------------------------------------------
// Addresses

SmemSpace* locate_shared(const void* p) {
    Launch& L = *g_launch;
    if (L.dyn.contains(p)) return &L.dyn;
    if (L.stat.contains(p)) return &L.stat;
    return nullptr;
}

std::string describe_smem_address(const void* p) {
    Launch& L = *g_launch;
    auto* c = static_cast<const unsigned char*>(p);
    if (L.dyn.contains(p))
        return format("dynamic shared memory offset %zu", static_cast<size_t>(c - L.dyn.base));
    if (L.stat.contains(p))
        return format("static __shared__ offset %zu", static_cast<size_t>(c - L.stat.base));
    if (c >= L.dyn.base - 65536 && c < L.dyn.base + L.dyn.size + 65536)
        return format("%p, byte offset %lld of the %zu-byte dynamic shared memory (out of "
                      "bounds)", p, static_cast<long long>(c - L.dyn.base), L.dyn.size);
    return format("%p, which is not in this block's shared memory (dynamic: %zu bytes at %p; "
                  "static __shared__: %zu bytes at %p)", p, L.dyn.size,
                  static_cast<void*>(L.dyn.base), L.stat.size, static_cast<void*>(L.stat.base));
}

// The space holding [p, p + n), after checking alignment and bounds; fails otherwise.
// `what()` names the access in the message (built only on failure).
template <class What>
static SmemSpace& checked_range(const void* p, size_t n, size_t align, What&& what) {
    if (reinterpret_cast<uintptr_t>(p) % align)
        fail(FTEMU_ERROR, format("%s %s is not %zu-byte aligned", what().c_str(),
                                 describe_smem_address(p).c_str(), align));
    SmemSpace* sp = locate_shared(p);
    auto* c = static_cast<const unsigned char*>(p);
    if (!sp || c + n > sp->base + sp->size)
        fail(FTEMU_ERROR, format("%s %s: the %zu bytes are not inside the block's shared "
                                 "memory", what().c_str(), describe_smem_address(p).c_str(), n));
    return *sp;
}

static std::string thread_name(unsigned tid) {
    return format("thread %u (warp %u, lane %u)", tid, tid / 32, tid % 32);
}

static ftemu_loc issue_loc(const Thread& t, const SmemSpace& sp, size_t w) {
    auto covers = [&](const Copy& c) {
        return c.space == &sp && w >= c.word && w < c.word + c.nwords;
    };
    for (const Copy& c : t.uncommitted)
        if (covers(c)) return c.loc;
    for (const auto& g : t.groups)
        for (const Copy& c : g)
            if (covers(c)) return c.loc;
    const void* bar = nullptr;  // a copy an mbarrier tracks (TMA, cp.async.mbarrier.arrive)
    if (const Copy* c = tracked_copy(sp, w, &bar)) return c->loc;
    return ftemu_loc{};
}

// ---------------------------------------------------------------------------------------
// Visibility of landed copies

void hide(Thread& t) {
    if (t.hidden || t.priv.empty()) return;
    for (const Region& r : t.priv) {
        SmemSpace& sp = *r.space;
        for (size_t w = r.word; w < r.word + r.nwords; ++w) {
            if (sp.state[w] != Word::PrivateVisible || sp.owner[w] != t.tid) continue;
            sp.saved[w] = sp.load(w);
            sp.store(w, kPoisonWord);
            sp.state[w] = Word::PrivateHidden;
        }
    }
    t.hidden = true;
}

static void restore(SmemSpace& sp, size_t w, unsigned tid) {
    if (sp.load(w) != kPoisonWord)
        fail(FTEMU_ERROR, format(
            "race: shared memory at %s was stored to by a thread other than %s, whose completed "
            "cp.async wrote it, before a __syncthreads ordered the two",
            describe_smem_address(sp.base + 4 * w).c_str(), thread_name(tid).c_str()));
    sp.store(w, sp.saved[w]);
}

void unhide(Thread& t) {
    if (!t.hidden) return;
    t.hidden = false;
    for (const Region& r : t.priv) {
        SmemSpace& sp = *r.space;
        for (size_t w = r.word; w < r.word + r.nwords; ++w) {
            if (sp.state[w] != Word::PrivateHidden || sp.owner[w] != t.tid) continue;
            restore(sp, w, t.tid);
            sp.state[w] = Word::PrivateVisible;
        }
    }
}

void publish_region(unsigned tid, const Region& r) {
    SmemSpace& sp = *r.space;
    for (size_t w = r.word; w < r.word + r.nwords; ++w) {
        if (sp.owner[w] != tid) continue;
        if (sp.state[w] == Word::PrivateHidden) restore(sp, w, tid);
        if (sp.state[w] == Word::PrivateHidden || sp.state[w] == Word::PrivateVisible)
            sp.state[w] = Word::Clean;
    }
}

void publish_all(Launch& L) {
    for (Thread& t : L.threads) {
        for (const Region& r : t.priv) publish_region(t.tid, r);
        t.priv.clear();
        t.hidden = false;
    }
}

static void land(Thread& t, const std::vector<Copy>& group) {
    for (const Copy& c : group) {
        SmemSpace& sp = *c.space;
        for (uint32_t i = 0; i < c.nwords; ++i) {
            size_t w = c.word + i;
            if (sp.load(w) != kPoisonWord)
                fail(FTEMU_ERROR, format(
                    "race: shared memory at %s was stored to while the cp.async into it (issued "
                    "at %s) was in flight; wait for the copy (and __syncthreads) before "
                    "touching its destination", describe_smem_address(sp.base + 4 * w).c_str(),
                    at(c.loc).c_str()));
            sp.store(w, c.data[i]);
            sp.state[w] = Word::PrivateVisible;
            sp.owner[w] = static_cast<uint16_t>(t.tid);
        }
        if (!t.priv.empty() && t.priv.back().space == c.space &&
            t.priv.back().word + t.priv.back().nwords == c.word)
            t.priv.back().nwords += c.nwords;
        else
            t.priv.push_back(Region{c.space, c.word, c.nwords});
    }
}

void land_published(unsigned tid, const std::vector<Copy>& copies) {
    Thread& t = g_launch->threads[tid];
    std::vector<Region> held;  // the thread's own private regions stay as they are
    held.swap(t.priv);
    land(t, copies);
    for (const Region& r : t.priv) publish_region(tid, r);
    t.priv.swap(held);
}

void land_all(Thread& t) {
    if (!t.uncommitted.empty()) {
        t.groups.push_back(std::move(t.uncommitted));
        t.uncommitted.clear();
    }
    while (!t.groups.empty()) {
        land(t, t.groups.front());
        t.groups.pop_front();
    }
}

// ---------------------------------------------------------------------------------------
// ldmatrix rows

void read_ldmatrix_row(const Thread& reader, const void* addr, const char* what, ftemu_loc loc,
                       uint16_t out[8]) {
    Launch& L = *g_launch;
    SmemSpace& sp = checked_range(addr, 16, 16, [&] {
        return format("%s at %s: row address of lane %u (warp %u), at", what, at(loc).c_str(),
                      reader.lane, reader.warp);
    });
    size_t w0 = sp.word_of(addr);
    uint32_t words[4];
    for (size_t i = 0; i < 4; ++i) {
        size_t w = w0 + i;
        Word s = sp.state[w];
        if (s == Word::Pending) {
            const Thread& issuer = L.threads[sp.owner[w]];
            const std::string tma = describe_tma_in_flight(sp, w);
            if (!tma.empty())
                fail(FTEMU_ERROR, format(
                    "%s at %s: lane %u (warp %u) reads %s, %s", what, at(loc).c_str(),
                    reader.lane, reader.warp, describe_smem_address(sp.base + 4 * w).c_str(),
                    tma.c_str()));
            fail(FTEMU_ERROR, format(
                "%s at %s: lane %u (warp %u) reads %s, whose cp.async (issued by %s at %s) has "
                "not completed: no cp_async_wait covering its group was executed (wait_group "
                "N leaves the newest N groups in flight)", what, at(loc).c_str(), reader.lane,
                reader.warp, describe_smem_address(sp.base + 4 * w).c_str(),
                thread_name(issuer.tid).c_str(), at(issue_loc(issuer, sp, w)).c_str()));
        }
        if ((s == Word::PrivateVisible || s == Word::PrivateHidden) && sp.owner[w] != reader.tid)
            fail(FTEMU_ERROR, format(
                "%s at %s: lane %u (warp %u) reads %s, which %s copied with cp.async and waited "
                "for, but no __syncthreads since that wait has made it visible to other threads",
                what, at(loc).c_str(), reader.lane, reader.warp,
                describe_smem_address(sp.base + 4 * w).c_str(), thread_name(sp.owner[w]).c_str()));
        words[i] = s == Word::PrivateHidden ? sp.saved[w] : sp.load(w);
        sp.read_epoch[w] = L.epoch + 1;
        sp.reader_warp[w] = static_cast<uint16_t>(reader.warp);
        sp.reader_loc[w] = loc;
    }
    std::memcpy(out, words, 16);
}

// ---------------------------------------------------------------------------------------
// Destinations of asynchronous copies (cp.async and TMA)

void check_async_destination(const Thread& me, const Copy& c, const char* kind,
                             const std::function<std::string()>& what) {
    Launch& L = *g_launch;
    SmemSpace& sp = *c.space;
    for (uint32_t i = 0; i < c.nwords; ++i) {
        size_t w = c.word + i;
        Word s = sp.state[w];
        if (s == Word::Pending)
            fail(FTEMU_ERROR, format(
                "%s: destination %s is already the destination of a %s in flight (issued by %s "
                "at %s)", what().c_str(), describe_smem_address(sp.base + 4 * w).c_str(), kind,
                thread_name(sp.owner[w]).c_str(),
                at(issue_loc(L.threads[sp.owner[w]], sp, w)).c_str()));
        if ((s == Word::PrivateVisible || s == Word::PrivateHidden) && sp.owner[w] != me.tid)
            fail(FTEMU_ERROR, format(
                "%s: destination %s holds data that %s copied and no __syncthreads has "
                "published yet (a write-write race)", what().c_str(),
                describe_smem_address(sp.base + 4 * w).c_str(), thread_name(sp.owner[w]).c_str()));
        if (sp.read_epoch[w] == L.epoch + 1 && sp.reader_warp[w] != me.warp)
            fail(FTEMU_ERROR, format(
                "%s: destination %s was read by warp %u (ldmatrix or wgmma at %s) since the "
                "last __syncthreads and no barrier phase released that read; overwriting it now "
                "races with it (a write-after-read race: order the reads before the next copy "
                "into the buffer, e.g. with an mbarrier the readers arrive on)", what().c_str(),
                describe_smem_address(sp.base + 4 * w).c_str(), sp.reader_warp[w],
                at(sp.reader_loc[w]).c_str()));
    }
}

void start_async_write(const Thread& me, const Copy& c) {
    SmemSpace& sp = *c.space;
    for (uint32_t i = 0; i < c.nwords; ++i) {
        sp.state[c.word + i] = Word::Pending;
        sp.owner[c.word + i] = static_cast<uint16_t>(me.tid);
        sp.store(c.word + i, kPoisonWord);
    }
}

}  // namespace ftemu

using namespace ftemu;

extern "C" FTEMU_API void ftemu_cp_async(void* dst, const void* src, int bytes, int src_bytes,
                                         ftemu_loc loc) {
    Launch& L = *g_launch;
    Thread& me = *L.cur;
    check_async_errors();
    if (bytes != 4 && bytes != 8 && bytes != 16)
        fail(FTEMU_ERROR, format("cp_async at %s: size %d is invalid; expected 4, 8 or 16",
                                 at(loc).c_str(), bytes));
    if (src_bytes < 0 || src_bytes > bytes)
        fail(FTEMU_ERROR, format("cp_async<%d> at %s: src_bytes=%d is outside [0, %d]", bytes,
                                 at(loc).c_str(), src_bytes, bytes));
    SmemSpace& sp = checked_range(dst, static_cast<size_t>(bytes), static_cast<size_t>(bytes),
                                  [&] { return format("cp_async<%d> at %s: destination", bytes,
                                                      at(loc).c_str()); });
    if (src_bytes > 0 && reinterpret_cast<uintptr_t>(src) % static_cast<uintptr_t>(bytes))
        fail(FTEMU_ERROR, format("cp_async<%d> at %s: global source %p is not %d-byte aligned",
                                 bytes, at(loc).c_str(), src, bytes));
    Copy c{};
    c.space = &sp;
    c.word = static_cast<uint32_t>(sp.word_of(dst));
    c.nwords = static_cast<uint32_t>(bytes / 4);
    c.loc = loc;
    if (src_bytes > 0) {
        set_current_op("reading the global source of a cp_async");
        std::memcpy(c.data, src, static_cast<size_t>(src_bytes));
        set_current_op(nullptr);
    }
    check_async_destination(me, c, "cp.async", [&] { return format("cp_async<%d> at %s", bytes,
                                                       at(loc).c_str()); });
    if (L.counters) count_cp_async(me, dst, src, bytes, src_bytes, loc);
    start_async_write(me, c);
    me.uncommitted.push_back(c);
}

extern "C" FTEMU_API void ftemu_cp_async_commit(ftemu_loc) {
    Thread& me = *g_launch->cur;
    check_async_errors();
    me.groups.push_back(std::move(me.uncommitted));  // an empty group is complete at once
    me.uncommitted.clear();
}

extern "C" FTEMU_API void ftemu_cp_async_wait(int pending, ftemu_loc loc) {
    Thread& me = *g_launch->cur;
    check_async_errors();
    if (pending < 0)
        fail(FTEMU_ERROR, format("cp_async_wait<%d> at %s: N must be >= 0", pending,
                                 at(loc).c_str()));
    while (me.groups.size() > static_cast<size_t>(pending)) {
        land(me, me.groups.front());
        me.groups.pop_front();
    }
}

extern "C" FTEMU_API void ftemu_cp_async_wait_all(ftemu_loc loc) {
    ftemu_cp_async_commit(loc);
    ftemu_cp_async_wait(0, loc);
}

extern "C" FTEMU_API unsigned ftemu_cvta_shared(const void* ptr, ftemu_loc loc) {
    Launch& L = *g_launch;
    check_async_errors();
    auto* c = static_cast<const unsigned char*>(ptr);
    // The shared window holds the static __shared__ variables first, then dynamic memory.
    if (L.stat.contains(ptr)) return static_cast<unsigned>(c - L.stat.base);
    if (L.dyn.contains(ptr) || c == L.dyn.base + L.dyn.size)
        return static_cast<unsigned>((L.stat.size + 127) / 128 * 128 + (c - L.dyn.base));
    fail(FTEMU_ERROR, format("__cvta_generic_to_shared at %s: %s", at(loc).c_str(),
                             describe_smem_address(ptr).c_str()));
}
