// Named barriers: bar.sync id, count and bar.arrive id, count (PTX 9.7.13.1; the Hopper
// notes, section 1.4: ping-pong scheduling of consumer warpgroups).
//
// Ids 1..15 are the block's named barriers (0 is the one __syncthreads uses). A phase
// completes when `count` threads have arrived, by bar.sync (which waits for the completion)
// or bar.arrive (which does not); then the waiting threads run on and the next phase starts.
// Checked: the id, a count that is a non-zero multiple of 32 not above the block's threads,
// every arrival of a phase naming the same count; a phase that cannot complete is a deadlock
// that names the barrier, its phase and its arrivals. Shared memory is not published by a
// named barrier (ordering cp.async data needs __syncthreads or an mbarrier).
#include "internal.h"

namespace ftemu {

std::string describe_named_wait(const Thread& t) {
    const NamedBarrier& nb = g_launch->named[t.named_id];
    return format("wait in bar.sync at %s on named barrier %u for phase %llu to complete: %u "
                  "of %u threads arrived", at(t.wait_loc).c_str(), t.named_id,
                  static_cast<unsigned long long>(t.named_phase), nb.arrived, nb.count);
}

}  // namespace ftemu

using namespace ftemu;

extern "C" FTEMU_API void ftemu_named_barrier(int sync, unsigned id, unsigned count,
                                              ftemu_loc loc) {
    Launch& L = *g_launch;
    Thread& me = *L.cur;
    check_async_errors();
    const char* op = sync ? "bar.sync" : "bar.arrive";
    if (id < 1 || id > 15)
        fail(FTEMU_ERROR, format("%s %u at %s: the named barrier id must be in 1..15 (0 is "
                                 "__syncthreads')", op, id, at(loc).c_str()));
    if (count == 0 || count % 32 || count > L.nthreads)
        fail(FTEMU_ERROR, format("%s %u, %u at %s: the thread count must be a non-zero multiple "
                                 "of 32 not above the block's %u threads", op, id, count,
                                 at(loc).c_str(), L.nthreads));
    NamedBarrier& nb = L.named[id];
    if (nb.arrived == 0) {
        nb.count = count;
        nb.first_tid = me.tid;
        nb.first_loc = loc;
    } else if (nb.count != count) {
        fail(FTEMU_ERROR, format(
            "%s %u, %u at %s: phase %llu of named barrier %u was started with a count of %u "
            "threads (thread %u at %s); every arrival of a phase must name the same count", op,
            id, count, at(loc).c_str(), static_cast<unsigned long long>(nb.phase), id, nb.count,
            nb.first_tid, at(nb.first_loc).c_str()));
    }
    if (++nb.arrived == nb.count) {
        const uint64_t done = nb.phase++;
        nb.arrived = 0;
        nb.count = 0;
        for (Thread& t : L.threads)
            if (t.state == TState::AtNamedBarrier && t.named_id == id && t.named_phase == done)
                make_runnable(t);
        return;
    }
    if (!sync) return;
    me.named_id = id;
    me.named_phase = nb.phase;
    me.wait_loc = loc;
    make_blocked(me, TState::AtNamedBarrier);
    suspend(me);
}
