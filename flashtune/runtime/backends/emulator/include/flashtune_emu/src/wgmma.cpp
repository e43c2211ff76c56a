// wgmma.mma_async (sm_90a): the warpgroup matrix multiply-accumulate, its matrix descriptors
// and its asynchronous completion (reference: the Hopper notes, section 6.1-6.2).
//
// Shapes: m64nNk16 with f16/bf16 operands and m64nNk32 with e4m3/e5m2 operands. Either way a
// row of K elements is 32 bytes, two 16-byte chunks, so descriptors address 8-bit operands
// through the same chunk arithmetic and swizzles; 8-bit operands must be K-major (the PTX ISA
// allows the transpose flags for 16-bit types only).
//
// The m64 shapes over a warpgroup (4 consecutive warps) splits into 4 independent warp parts: warp
// w of the group owns rows 16w..16w+15 of A and of D, and reads all of B. Each warp is a
// collective of its 32 lanes (the same rendezvous as mma.sync); the result is computed at
// issue from shared memory as it is then, and held per thread until the wgmma_wait that
// covers its commit group writes it into the accumulator registers. Until then those
// registers hold the poison NaN, so reading an accumulator before its wait shows up as NaN,
// as reading cp.async data too early does; a thread that returns with results never waited
// for, a wgmma without a wgmma_fence since the accumulators were last handed back, reserved
// descriptor bits, lanes that disagree on a descriptor and a wgmma_fence_operands (the point
// where the kernel reads accumulators) on registers a wgmma in flight still writes are errors.
#include <cstring>

#include "internal.h"

namespace ftemu {

namespace {

constexpr uint32_t kPoisonF32 = 0x7FF0A5A5u;  // a NaN no arithmetic produces

struct Desc {
    uint32_t start, lbo, sbo;  // byte addresses / offsets in the shared window
    unsigned base_offset;
    unsigned layout;           // 0 none, 1 = 128B, 2 = 64B, 3 = 32B swizzle
};

Desc decode(unsigned long long d, const char* operand, ftemu_loc loc) {
    // Fields: [13:0] start >> 4, [29:16] LBO >> 4, [45:32] SBO >> 4, [51:49] base offset,
    // [63:62] layout type; every other bit is reserved and must be zero.
    constexpr unsigned long long kUsed = 0x3FFFull | 0x3FFFull << 16 | 0x3FFFull << 32 |
                                         7ull << 49 | 3ull << 62;
    if (d & ~kUsed)
        fail(FTEMU_ERROR, format(
            "wgmma at %s: the %s descriptor 0x%016llx sets reserved bits 0x%016llx (fields: "
            "start [13:0], LBO [29:16], SBO [45:32], base offset [51:49], swizzle [63:62])",
            at(loc).c_str(), operand, d, d & ~kUsed));
    Desc out{static_cast<uint32_t>(d & 0x3FFF) << 4, static_cast<uint32_t>(d >> 16 & 0x3FFF) << 4,
             static_cast<uint32_t>(d >> 32 & 0x3FFF) << 4, static_cast<unsigned>(d >> 49 & 7),
             static_cast<unsigned>(d >> 62 & 3)};
    if (out.base_offset != 0)
        fail(FTEMU_ERROR, format(
            "wgmma at %s: the %s descriptor 0x%016llx has base offset %u; the emulator models "
            "swizzle patterns that start on their repeat boundary (base offset 0) only",
            at(loc).c_str(), operand, d, out.base_offset));
    return out;
}

// Bytes of one swizzled row (the pitch between consecutive rows of an 8-row core group).
unsigned row_bytes(unsigned layout) {
    static const unsigned bytes[4] = {16, 128, 64, 32};
    return bytes[layout];
}

// The 128/64/32-byte swizzle on an absolute shared-window address: the 16-byte chunk bits
// [6:4] (fewer for 64B/32B) are XORed with bits [9:7].
uint32_t swizzle(uint32_t addr, unsigned layout) {
    static const uint32_t mask[4] = {0, 7, 3, 1};
    return addr ^ (((addr >> 7) & mask[layout]) << 4);
}

// The window address of the 16-byte chunk holding elements (mn, 8c..8c+7) of a K-major
// operand, or (8c..8c+7, k) of an MN-major one (c: the chunk index along the contiguous dim).
uint32_t chunk_address(const Desc& d, bool mn_major, unsigned mn, unsigned k) {
    unsigned w = row_bytes(d.layout);
    uint32_t a;
    if (!mn_major) {  // element (mn, k): rows of K; k-chunks 16 B apart within a swizzled row
        a = d.start + (mn % 8) * w + (mn / 8) * d.sbo + (k / 8) * (d.layout ? 16 : d.lbo);
    } else {          // element (k, mn): rows of MN; w/2 elements per row, panels LBO apart
        unsigned per_row = w / 2;
        a = d.start + (k % 8) * w + (k / 8) * d.sbo + (mn % per_row) * 2 + (mn / per_row) * d.lbo;
    }
    return swizzle(a, d.layout);
}

const void* window_pointer(uint32_t addr, const char* operand, ftemu_loc loc) {
    Launch& L = *g_launch;
    size_t dyn_start = (L.stat.size + 127) / 128 * 128;
    if (addr < L.stat.size) return L.stat.base + addr;
    if (addr >= dyn_start && addr - dyn_start < L.dyn.size) return L.dyn.base + (addr - dyn_start);
    fail(FTEMU_ERROR, format(
        "wgmma at %s: the %s descriptor addresses shared-window byte 0x%x, outside the block's "
        "shared memory (static 0..0x%zx, dynamic 0x%zx..0x%zx)", at(loc).c_str(), operand, addr,
        L.stat.size, dyn_start, dyn_start + L.dyn.size));
}

// The element format of a wgmma's A and B, from its kind bits.
enum class Elem { F16, BF16, E4M3, E5M2 };

Elem elem_of(int kind) {
    if (kind & FTEMU_WGMMA_E4M3) return Elem::E4M3;
    if (kind & FTEMU_WGMMA_E5M2) return Elem::E5M2;
    return kind & FTEMU_WGMMA_BF16 ? Elem::BF16 : Elem::F16;
}

bool is_fp8(Elem e) { return e == Elem::E4M3 || e == Elem::E5M2; }

// Elements along K of one wgmma: 16 (16-bit types) or 32 (8-bit types), 32 bytes either way.
unsigned k_of(Elem e) { return is_fp8(e) ? 32 : 16; }

// The exact float values of one 16-byte chunk: 8 16-bit or 16 8-bit elements; returns their
// count.
unsigned decode_chunk(Elem e, const uint16_t (&chunk)[8], float* out) {
    if (is_fp8(e)) {
        unsigned char bytes[16];
        std::memcpy(bytes, chunk, 16);  // little-endian: element 2i is the low byte of chunk[i]
        for (unsigned i = 0; i < 16; ++i)
            out[i] = e == Elem::E4M3 ? e4m3_to_float(bytes[i]) : e5m2_to_float(bytes[i]);
        return 16;
    }
    const float* h = half_table();
    for (unsigned i = 0; i < 8; ++i) out[i] = e == Elem::BF16 ? bf16_to_float(chunk[i]) : h[chunk[i]];
    return 8;
}

// operand[mn][k] (rows x K) as floats, read chunk by chunk with the shared-memory checks.
// K-major rows hold two 16-byte chunks (k 0..K/2-1, K/2..K-1); MN-major operands (16-bit
// only) hold 8 MN-consecutive elements per chunk.
void read_operand(const Thread& reader, const Desc& d, bool mn_major, unsigned mn0, unsigned rows,
                  Elem elem, const char* operand, ftemu_loc loc, std::vector<float>& out) {
    const unsigned K = k_of(elem);
    out.assign(static_cast<size_t>(rows) * K, 0.0f);
    uint16_t chunk[8];
    float values[16];
    char what[64];
    std::snprintf(what, sizeof what, "wgmma_mma_async (%s operand)", operand);
    if (!mn_major) {
        for (unsigned r = 0; r < rows; ++r)
            for (unsigned c = 0; c < 2; ++c) {
                // chunk_address counts K-major chunks in 8-element steps of k
                read_ldmatrix_row(reader, window_pointer(chunk_address(d, false, mn0 + r, 8 * c),
                                                         operand, loc), what, loc, chunk);
                const unsigned per = decode_chunk(elem, chunk, values);
                for (unsigned e = 0; e < per; ++e) out[r * K + per * c + e] = values[e];
            }
    } else {
        for (unsigned k = 0; k < K; ++k)
            for (unsigned c = 0; c < rows / 8; ++c) {
                read_ldmatrix_row(reader, window_pointer(chunk_address(d, true, mn0 + 8 * c, k),
                                                         operand, loc), what, loc, chunk);
                decode_chunk(elem, chunk, values);
                for (unsigned e = 0; e < 8; ++e) out[(8 * c + e) * K + k] = values[e];
            }
    }
}

// Accumulator element v of lane L (rows of this warp's 16-row slice): the m16n8 C pattern
// repeated over N/8 column blocks.
unsigned acc_row(unsigned lane, unsigned v) { return lane / 4 + 8 * ((v >> 1) & 1); }
unsigned acc_col(unsigned lane, unsigned v) { return 8 * (v >> 2) + 2 * (lane % 4) + (v & 1); }

// The (row, k) of element i of lane L's A fragment from registers (K / 2 elements in 4
// registers). 16-bit types (m64nNk16): the accumulator map with N = 16, element i in half
// i % 2 of register i / 2. 8-bit types (m64nNk32, the PTX ISA's A fragment for .e4m3/.e5m2,
// as mma.m16n8k32's): element i is byte i % 4 of register r = i / 4, at row L/4 + 8 (r % 2),
// k = 4 (L % 4) + 16 (r / 2) + i % 4.
void a_fragment_coords(bool fp8, unsigned lane, unsigned i, unsigned& row, unsigned& k) {
    if (!fp8) {
        row = acc_row(lane, i);
        k = acc_col(lane, i);
        return;
    }
    const unsigned r = i / 4;
    row = lane / 4 + 8 * (r % 2);
    k = 4 * (lane % 4) + 16 * (r / 2) + i % 4;
}

// The newest in-flight value of accumulator array `d`, or null.
const Thread::WgmmaResult* in_flight(const Thread& t, const float* d) {
    for (auto it = t.wg_uncommitted.rbegin(); it != t.wg_uncommitted.rend(); ++it)
        if (it->d == d) return &*it;
    for (auto g = t.wg_groups.rbegin(); g != t.wg_groups.rend(); ++g)
        for (auto it = g->rbegin(); it != g->rend(); ++it)
            if (it->d == d) return &*it;
    return nullptr;
}

void poison(float* d, unsigned count) {
    for (unsigned i = 0; i < count; ++i) std::memcpy(&d[i], &kPoisonF32, 4);
}

}  // namespace

void compute_wgmma(const Collective& c, unsigned warp) {
    Launch& L = *g_launch;
    const unsigned n = static_cast<unsigned>(c.kind) >> 8;
    const Elem elem = elem_of(c.kind);
    const unsigned K = k_of(elem);
    const bool rs = c.kind & FTEMU_WGMMA_RS;
    const bool trans_a = c.kind & FTEMU_WGMMA_TRANS_A, trans_b = c.kind & FTEMU_WGMMA_TRANS_B;
    if (L.nthreads % 128 != 0)
        fail(FTEMU_ERROR, format("wgmma at %s needs whole warpgroups of 128 threads, but the block "
                                 "has %u threads", at(c.loc).c_str(), L.nthreads));
    if (is_fp8(elem) && (trans_a || trans_b))
        fail(FTEMU_ERROR, format(
            "wgmma at %s: an m64nNk32 %s wgmma with imm-trans-%s = 1; 8-bit operands must be "
            "K-major (transpose the operand in shared memory first, e.g. V with "
            "ldmatrix.trans / stmatrix)", at(c.loc).c_str(),
            elem == Elem::E4M3 ? "e4m3" : "e5m2", trans_a ? "a" : "b"));
    const auto* first = static_cast<const ftemu_wgmma_args*>(c.lanes[0].in0);
    for (unsigned lane = 1; lane < 32; ++lane) {
        const auto* a = static_cast<const ftemu_wgmma_args*>(c.lanes[lane].in0);
        if (a->b_desc != first->b_desc || (!rs && a->a_desc != first->a_desc) ||
            (a->scale_d != 0) != (first->scale_d != 0))
            fail(FTEMU_ERROR, format(
                "wgmma at %s: lane %u of warp %u passes descriptors A 0x%016llx B 0x%016llx "
                "scale-d %d, lane 0 passes A 0x%016llx B 0x%016llx scale-d %d; they must be the "
                "same in every thread of the warpgroup", at(c.loc).c_str(), lane, warp,
                a->a_desc, a->b_desc, a->scale_d, first->a_desc, first->b_desc, first->scale_d));
    }
    const unsigned part = warp % 4;  // this warp's 16-row slice of the 64 rows
    const Thread& reader = L.threads[warp * 32];
    std::vector<float> A, B;
    Desc bd = decode(first->b_desc, "B", c.loc);
    read_operand(reader, bd, trans_b, 0, n, elem, "B", c.loc, B);  // B as [n][k]
    if (rs) {
        A.assign(16 * K, 0.0f);
        const float* h = half_table();
        for (unsigned lane = 0; lane < 32; ++lane) {
            const auto* a = static_cast<const ftemu_wgmma_args*>(c.lanes[lane].in0);
            for (unsigned i = 0; i < K / 2; ++i) {
                unsigned row, k;
                a_fragment_coords(is_fp8(elem), lane, i, row, k);
                float v;
                if (is_fp8(elem)) {
                    const auto byte = static_cast<uint8_t>(a->a[i / 4] >> (8 * (i % 4)));
                    v = elem == Elem::E4M3 ? e4m3_to_float(byte) : e5m2_to_float(byte);
                } else {
                    const auto bits = static_cast<uint16_t>(a->a[i / 2] >> (16 * (i & 1)));
                    v = elem == Elem::BF16 ? bf16_to_float(bits) : h[bits];
                }
                A[row * K + k] = v;
            }
        }
    } else {
        read_operand(reader, decode(first->a_desc, "A", c.loc), trans_a, 16 * part, 16, elem, "A",
                     c.loc, A);
    }
    for (unsigned lane = 0; lane < 32; ++lane) {
        Thread& t = L.threads[warp * 32 + lane];
        const auto* a = static_cast<const ftemu_wgmma_args*>(c.lanes[lane].in0);
        if (!t.wg_fenced)
            fail(FTEMU_ERROR, format(
                "wgmma at %s: thread %u issues a wgmma without a wgmma_fence since the "
                "accumulators were last handed back (the start of the kernel or a wgmma_wait); "
                "wgmma.fence must order earlier register accesses before the wgmma",
                at(c.loc).c_str(), t.tid));
        Thread::WgmmaResult r{a->d, std::vector<float>(n / 2), c.loc};
        const Thread::WgmmaResult* prev = a->scale_d ? in_flight(t, a->d) : nullptr;
        for (unsigned v = 0; v < n / 2; ++v) {
            unsigned row = acc_row(lane, v), col = acc_col(lane, v);
            // Products of two 16-bit or two e4m3 floats are exact in double, and so is their
            // sum (as mma.sync m16n8k32 in warp.cpp): formed in double, rounded to float once.
            double acc = 0.0;
            for (unsigned k = 0; k < K; ++k)
                acc += static_cast<double>(A[row * K + k]) * static_cast<double>(B[col * K + k]);
            if (a->scale_d) acc += static_cast<double>(prev ? prev->values[v] : a->d[v]);
            r.values[v] = static_cast<float>(acc);
        }
        poison(a->d, n / 2);
        t.wg_uncommitted.push_back(std::move(r));
    }
}

void wgmma_on_exit(Thread& t) {
    if (t.wg_uncommitted.empty() && t.wg_groups.empty()) return;
    const auto& r = t.wg_uncommitted.empty() ? t.wg_groups.front().front() : t.wg_uncommitted.front();
    fail(FTEMU_ERROR, format(
        "thread %u returned with wgmma results never waited for (the wgmma at %s): every "
        "wgmma must be committed and covered by a wgmma_wait before its accumulators are used "
        "or the thread exits", t.tid, at(r.loc).c_str()));
}

}  // namespace ftemu

using namespace ftemu;

extern "C" FTEMU_API void ftemu_wgmma_fence(ftemu_loc) {
    check_async_errors();
    g_launch->cur->wg_fenced = true;
}

extern "C" FTEMU_API void ftemu_wgmma_commit(ftemu_loc) {
    Thread& me = *g_launch->cur;
    check_async_errors();
    me.wg_groups.push_back(std::move(me.wg_uncommitted));
    me.wg_uncommitted.clear();
}

extern "C" FTEMU_API void ftemu_wgmma_wait(int pending, ftemu_loc loc) {
    Thread& me = *g_launch->cur;
    check_async_errors();
    if (pending < 0 || pending > 7)
        fail(FTEMU_ERROR, format("wgmma_wait<%d> at %s: N must be in 0..7", pending,
                                 at(loc).c_str()));
    while (me.wg_groups.size() > static_cast<size_t>(pending)) {
        std::vector<Thread::WgmmaResult> done = std::move(me.wg_groups.front());
        me.wg_groups.pop_front();
        for (const auto& r : done) {
            std::memcpy(r.d, r.values.data(), r.values.size() * sizeof(float));
            if (in_flight(me, r.d)) poison(r.d, static_cast<unsigned>(r.values.size()));
        }
    }
    me.wg_fenced = false;
}

extern "C" FTEMU_API void ftemu_wgmma_fence_operands(const float* d, int count, ftemu_loc loc) {
    Thread& me = *g_launch->cur;
    check_async_errors();
    // Byte ranges as integers: the arrays are distinct objects.
    const auto lo = reinterpret_cast<uintptr_t>(d);
    const uintptr_t hi = lo + static_cast<uintptr_t>(count) * sizeof(float);
    auto overlaps = [&](const Thread::WgmmaResult& r) {
        const auto r_lo = reinterpret_cast<uintptr_t>(r.d);
        return r_lo < hi && lo < r_lo + r.values.size() * sizeof(float);
    };
    auto report = [&](const Thread::WgmmaResult& r, const char* state) {
        fail(FTEMU_ERROR, format(
            "wgmma_fence_operands at %s: thread %u reads accumulators that the wgmma at %s still "
            "writes (%s; %zu committed groups pending): wait for its group (wgmma_wait<N> with "
            "at most N groups committed after it) before the accumulators are read",
            at(loc).c_str(), me.tid, at(r.loc).c_str(), state, me.wg_groups.size()));
    };
    for (const auto& r : me.wg_uncommitted)
        if (overlaps(r)) report(r, "not committed");
    size_t newer = me.wg_groups.size();
    for (const auto& g : me.wg_groups) {
        --newer;
        for (const auto& r : g)
            if (overlaps(r))
                report(r, format("its group has %zu committed after it", newer).c_str());
    }
}

// fence.proxy.async: the emulator has one proxy (wgmma reads shared memory at issue through
// the same checks as ldmatrix), so the fence orders nothing more here.
extern "C" FTEMU_API void ftemu_fence_proxy_async(ftemu_loc) { check_async_errors(); }
