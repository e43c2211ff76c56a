// Launch counters: global traffic of cp.async and __ldg, coalescing of cp.async, shared-memory bank conflicts of
// ldmatrix and cp.async writes, mma / shuffle / barrier counts and mma per block.
//
// Called only while the caller asked for counters (one branch on g_launch->counters at each
// hook otherwise). Counting reads the operands the primitives already validated and writes
// only the counters, so results are the same with and without it.
#include <algorithm>
#include <cstring>

#include "internal.h"

namespace ftemu {

static constexpr unsigned kBanks = 32;
static constexpr unsigned kPhaseBytes = 128;  // one shared-memory wavefront

// Wavefronts one phase takes: the largest number of distinct 4-byte words that share a bank
// (words read or written twice count once: a broadcast). `words` holds word addresses.
static unsigned wavefronts(const uintptr_t* words, unsigned n) {
    uintptr_t seen[kBanks][kPhaseBytes / 4];
    unsigned count[kBanks] = {};
    unsigned worst = n ? 1 : 0;
    for (unsigned i = 0; i < n; ++i) {
        unsigned bank = static_cast<unsigned>(words[i] % kBanks);
        unsigned k = 0;
        while (k < count[bank] && seen[bank][k] != words[i]) ++k;
        if (k < count[bank] || count[bank] == kPhaseBytes / 4) continue;
        seen[bank][count[bank]++] = words[i];
        worst = std::max(worst, count[bank]);
    }
    return worst;
}

static ftemu_site_counters* site(Launch& L, ftemu_loc loc, int kind) {
    ftemu_counters& C = *L.counters;
    for (unsigned i = 0; i < C.nsites; ++i) {
        ftemu_site_counters& s = C.sites[i];
        if (s.kind == kind && s.line == loc.line &&
            (s.file == loc.file || (s.file && loc.file && !std::strcmp(s.file, loc.file))))
            return &s;
    }
    if (C.nsites == FTEMU_MAX_SITES) {
        ++C.sites_dropped;
        return nullptr;
    }
    ftemu_site_counters& s = C.sites[C.nsites++];
    s = ftemu_site_counters{};
    s.file = loc.file;
    s.line = loc.line;
    s.kind = kind;
    return &s;
}

void counters_begin_launch(Launch& L) {
    ftemu_counters& C = *L.counters;
    unsigned long long* block_mma = C.block_mma;
    unsigned long long len = C.block_mma_len;
    std::memset(&C, 0, sizeof C);
    C.block_mma = block_mma;
    C.block_mma_len = len;
    if (block_mma) std::fill(block_mma, block_mma + len, 0ull);
}

static void finish_request(Launch& L, const CpRequest& r) {
    ftemu_counters& C = *L.counters;
    // Global side: the distinct 32-byte sectors the lanes' sources touch.
    uintptr_t sectors[64];
    unsigned nsec = 0;
    unsigned long long bytes = 0;
    unsigned max_bytes = 4;
    for (unsigned lane = 0; lane < 32; ++lane) {
        if (!(r.lanes >> lane & 1u)) continue;
        max_bytes = std::max<unsigned>(max_bytes, r.bytes[lane]);
        if (!r.src_bytes[lane]) continue;  // a zero-fill reads no global memory
        bytes += r.src_bytes[lane];
        uintptr_t first = r.src[lane] / 32, last = (r.src[lane] + r.src_bytes[lane] - 1) / 32;
        for (uintptr_t s = first; s <= last; ++s) sectors[nsec++] = s;
    }
    std::sort(sectors, sectors + nsec);
    nsec = static_cast<unsigned>(std::unique(sectors, sectors + nsec) - sectors);
    unsigned long long min_sectors = (bytes + 31) / 32;
    // Shared side: lanes in phases of 128 bytes, by lane index.
    unsigned per_phase = kPhaseBytes / max_bytes;
    unsigned long long phases = 0, waves = 0;
    for (unsigned first = 0; first < 32; first += per_phase) {
        uintptr_t words[kPhaseBytes / 4];
        unsigned n = 0;
        for (unsigned lane = first; lane < first + per_phase; ++lane) {
            if (!(r.lanes >> lane & 1u)) continue;
            for (unsigned w = 0; w < r.bytes[lane] / 4u; ++w) words[n++] = r.dst[lane] / 4 + w;
        }
        if (!n) continue;
        ++phases;
        waves += wavefronts(words, n);
    }
    C.cp_async_requests += 1;
    C.cp_async_bytes += bytes;
    C.cp_async_sectors += nsec;
    C.cp_async_min_sectors += min_sectors;
    C.cp_async_smem_phases += phases;
    C.cp_async_smem_wavefronts += waves;
    if (ftemu_site_counters* s = site(L, r.loc, FTEMU_SITE_CP_ASYNC)) {
        s->requests += 1;
        s->phases += phases;
        s->wavefronts += waves;
        s->global_bytes += bytes;
        s->sectors += nsec;
        s->min_sectors += min_sectors;
    }
}

void count_cp_async(Thread& t, const void* dst, const void* src, int bytes, int src_bytes,
                    ftemu_loc loc) {
    Launch& L = *g_launch;
    ftemu_counters& C = *L.counters;
    C.cp_async_copies += 1;
    C.cp_async_fill_bytes += static_cast<unsigned>(bytes - src_bytes);
    Warp& W = L.warps[t.warp];
    CpRequest& r = W.cp_requests[t.cp_seq++];
    if (!r.lanes) r.loc = loc;
    r.lanes |= 1u << t.lane;
    r.src[t.lane] = reinterpret_cast<uintptr_t>(src);
    r.dst[t.lane] = reinterpret_cast<uintptr_t>(dst);
    r.bytes[t.lane] = static_cast<uint8_t>(bytes);
    r.src_bytes[t.lane] = static_cast<uint8_t>(src_bytes);
    if (r.lanes == W.present) {
        finish_request(L, r);
        W.cp_requests.erase(t.cp_seq - 1);
    }
}

static void count_ldmatrix(Launch& L, const Collective& c) {
    ftemu_counters& C = *L.counters;
    int count = c.kind & 7;
    unsigned long long waves = 0;
    for (int j = 0; j < count; ++j) {  // one phase per 8x8 matrix: 8 rows of 16 bytes
        uintptr_t words[32];
        for (unsigned r = 0; r < 8; ++r) {
            uintptr_t w0 = reinterpret_cast<uintptr_t>(c.lanes[8 * j + r].in0) / 4;
            for (unsigned w = 0; w < 4; ++w) words[4 * r + w] = w0 + w;
        }
        waves += wavefronts(words, 32);
    }
    C.ldmatrix_count += 1;
    C.ldmatrix_phases += static_cast<unsigned>(count);
    C.ldmatrix_wavefronts += waves;
    if (ftemu_site_counters* s = site(L, c.loc, FTEMU_SITE_LDMATRIX)) {
        s->requests += 1;
        s->phases += static_cast<unsigned>(count);
        s->wavefronts += waves;
    }
}

void count_collective(Launch& L, const Collective& c, unsigned) {
    ftemu_counters& C = *L.counters;
    switch (c.op) {
        case Op::Mma:
            C.mma_count += 1;
            if (C.block_mma && L.block_linear < C.block_mma_len) C.block_mma[L.block_linear] += 1;
            break;
        case Op::Ldmatrix: count_ldmatrix(L, c); break;
        case Op::Shfl: C.shfl_count += 1; break;
        case Op::Vote:
        case Op::SyncWarp:
        case Op::Wgmma: break;
    }
}

void counters_end_block(Launch& L) {
    // Requests some lanes never issued (they returned first, or branched around the copy).
    for (Warp& W : L.warps) {
        for (const auto& [seq, r] : W.cp_requests) finish_request(L, r);
        W.cp_requests.clear();
    }
}

}  // namespace ftemu

extern "C" FTEMU_API void ftemu_count_ldg(unsigned bytes) {
    if (ftemu::g_launch && ftemu::g_launch->counters) ftemu::g_launch->counters->ldg_bytes += bytes;
}
