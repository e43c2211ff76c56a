// setmaxnreg.{inc,dec}.sync.aligned.u32 (sm_90a; reference: the Hopper notes, section 1.1
// and PTX 9.7.19.5): a warpgroup asks for a new per-thread register limit.
//
// The emulator has no register file, so the instruction changes nothing but its rules are
// checked:
//  * the count is a multiple of 8 in 24..256;
//  * .aligned: every thread of the warpgroup (4 consecutive warps) executes the same
//    sequence of setmaxnreg, with the same direction and count at each position (the first
//    thread to reach a position sets it; a thread that differs is an error at once, a thread
//    that skipped one is reported when the block ends);
//  * .inc never lowers and .dec never raises the warpgroup's previous request;
//  * the final requests of the warpgroups that made one fit the 64 Ki registers of the
//    block (count x 128 summed), or an .inc could wait for registers forever on a GPU;
//  * once one warpgroup of a block makes a request, every warpgroup makes one (strictness:
//    a warpgroup without one keeps the launch's allocation, which neither the register
//    split nor the code compiled for its role after the others' requests accounts for).
#include "internal.h"

namespace ftemu {

void setmaxnreg_begin_block(Launch& L) {
    L.nreg.assign((L.nthreads + 127) / 128, {});
}

void setmaxnreg_end_block(Launch& L) {
    unsigned total = 0;
    const size_t none = L.nreg.size();
    size_t asked = none, silent = none;  // a warpgroup with requests, one without
    for (size_t g = 0; g < L.nreg.size(); ++g) {
        const auto& seq = L.nreg[g];
        if (seq.empty()) {
            if (silent == none) silent = g;
            continue;
        }
        if (asked == none) asked = g;
        for (unsigned tid = static_cast<unsigned>(128 * g);
             tid < std::min(L.nthreads, static_cast<unsigned>(128 * (g + 1))); ++tid) {
            const Thread& t = L.threads[tid];
            if (t.nreg_calls != seq.size()) {
                const NregRequest& missed = seq[t.nreg_calls];
                record_error(FTEMU_ERROR, format(
                    "setmaxnreg: thread %u (warp %u) of warpgroup %zu executed %u setmaxnreg "
                    "but thread %u executed %zu (the next one at %s): .sync.aligned requires "
                    "every thread of the warpgroup to execute each setmaxnreg", tid, t.warp, g,
                    t.nreg_calls, missed.tid, seq.size(), at(missed.loc).c_str()));
                return;
            }
        }
        total += seq.back().count * 128;
    }
    if (asked != none && silent != none) {
        const NregRequest& first = L.nreg[asked].front();
        record_error(FTEMU_ERROR, format(
            "setmaxnreg: warpgroup %zu (threads %zu..%zu) executed no setmaxnreg, but "
            "warpgroup %zu did (setmaxnreg.%s %u at %s): in a block that moves registers "
            "between warpgroups every warpgroup states its limit", silent, 128 * silent,
            128 * silent + 127, asked, first.inc ? "inc" : "dec", first.count,
            at(first.loc).c_str()));
        return;
    }
    if (total > 65536)
        record_error(FTEMU_ERROR, format(
            "setmaxnreg: the warpgroups' final requests add up to %u registers (count x 128 "
            "threads each), more than the 65536 of the block: a setmaxnreg.inc would wait for "
            "registers forever", total));
}

}  // namespace ftemu

using namespace ftemu;

extern "C" FTEMU_API void ftemu_setmaxnreg(int inc, unsigned count, ftemu_loc loc) {
    Launch& L = *g_launch;
    Thread& me = *L.cur;
    check_async_errors();
    const char* op = inc ? "setmaxnreg.inc" : "setmaxnreg.dec";
    if (count < 24 || count > 256 || count % 8)
        fail(FTEMU_ERROR, format("%s at %s: count %u must be a multiple of 8 in 24..256", op,
                                 at(loc).c_str(), count));
    if (L.nthreads % 128)
        fail(FTEMU_ERROR, format("%s at %s needs whole warpgroups of 128 threads, but the "
                                 "block has %u threads", op, at(loc).c_str(), L.nthreads));
    auto& seq = L.nreg[me.tid / 128];
    const unsigned k = me.nreg_calls++;
    if (k < seq.size()) {
        const NregRequest& first = seq[k];
        if (first.inc != inc || first.count != count)
            fail(FTEMU_ERROR, format(
                "%s %u at %s: thread %u executed setmaxnreg.%s %u at %s as the same (number %u) "
                "setmaxnreg of warpgroup %u; .sync.aligned requires the same instruction in "
                "every thread of the warpgroup", op, count, at(loc).c_str(), first.tid,
                first.inc ? "inc" : "dec", first.count, at(first.loc).c_str(), k + 1,
                me.tid / 128));
        return;
    }
    if (k > 0) {
        const NregRequest& prev = seq[k - 1];
        if ((inc && count < prev.count) || (!inc && count > prev.count))
            fail(FTEMU_ERROR, format("%s %u at %s: the warpgroup's previous request was %u (at "
                                     "%s); .inc must not lower it and .dec must not raise it",
                                     op, count, at(loc).c_str(), prev.count,
                                     at(prev.loc).c_str()));
    }
    seq.push_back(NregRequest{inc, count, me.tid, loc});
}
