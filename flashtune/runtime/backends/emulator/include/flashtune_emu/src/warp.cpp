// Warp collectives: a rendezvous of the lanes named in the mask, computed by the last lane to
// arrive with the exact register layouts of the PTX ISA (reference/ptx-warp-semantics.md).
//
// Each primitive is a `join` (bookkeeping, identical for all) plus a `compute_*` function that
// reads the lanes' operands and writes their results; counting hooks (mma, shuffle and
// ldmatrix counts, bank conflicts of the row addresses) belong in the compute functions and
// do not change results.
#include <cmath>
#include <cstring>
#include <limits>

#include "internal.h"

namespace ftemu {

static const char* op_name(Op op, int kind) {
    switch (op) {
        case Op::Mma:
            return kind == FTEMU_MMA_E4M3   ? "mma_m16n8k32_e4m3"
                   : kind == FTEMU_MMA_E5M2 ? "mma_m16n8k32_e5m2"
                   : kind == FTEMU_MMA_BF16 ? "mma_m16n8k16_bf16"
                                            : "mma_m16n8k16_f16";
        case Op::Ldmatrix: {
            static const char* names[2][5] = {
                {"", "ldmatrix_x1", "ldmatrix_x2", "", "ldmatrix_x4"},
                {"", "ldmatrix_x1_trans", "ldmatrix_x2_trans", "", "ldmatrix_x4_trans"}};
            return names[(kind >> 4) & 1][kind & 7];
        }
        case Op::Shfl: {
            static const char* names[4] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                           "__shfl_xor_sync"};
            return names[kind & 3];
        }
        case Op::Vote: {
            static const char* names[3] = {"__all_sync", "__any_sync", "__ballot_sync"};
            return names[kind % 3];
        }
        case Op::SyncWarp: return "__syncwarp";
        case Op::Wgmma: return "wgmma_mma_async";
    }
    return "?";
}

std::string describe_collective(const Collective& c) {
    return format("%s (mask 0x%08x, lanes %s arrived) at %s", op_name(c.op, c.kind), c.mask,
                  lane_list(c.arrived).c_str(), at(c.loc).c_str());
}

static bool is_aligned_op(Op op) {
    return op == Op::Mma || op == Op::Ldmatrix || op == Op::Wgmma;
}

// ---------------------------------------------------------------------------------------
// 16-bit floating point to float (exact)

static float half_to_float(uint16_t h) {
    uint32_t sign = static_cast<uint32_t>(h >> 15) << 31;
    uint32_t exp = (h >> 10) & 31;
    uint32_t man = h & 1023;
    uint32_t bits;
    if (exp == 0) {
        float v = static_cast<float>(man) * 0x1p-24f;  // zero or subnormal: exact
        return sign ? -v : v;
    }
    if (exp == 31)
        bits = sign | 0x7F800000u | (man << 13);
    else
        bits = sign | ((exp + 112) << 23) | (man << 13);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

float bf16_to_float(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

const float* half_table() {
    static float* table = [] {
        auto* t = new float[65536];
        for (uint32_t i = 0; i < 65536; ++i) t[i] = half_to_float(static_cast<uint16_t>(i));
        return t;
    }();
    return table;
}

// ---------------------------------------------------------------------------------------
// Computations

static void check_poison(const Collective& c, unsigned warp) {
    static const char* names[6] = {"a[0]", "a[1]", "a[2]", "a[3]", "b[0]", "b[1]"};
    for (unsigned lane = 0; lane < 32; ++lane) {
        const auto* a = static_cast<const unsigned*>(c.lanes[lane].in0);
        const auto* b = static_cast<const unsigned*>(c.lanes[lane].in1);
        unsigned regs[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
        for (int r = 0; r < 6; ++r) {
            for (int half = 0; half < 2; ++half) {
                if (static_cast<uint16_t>(regs[r] >> (16 * half)) != kPoisonHalf) continue;
                fail(FTEMU_ERROR, format(
                    "%s at %s: operand %s of lane %u (warp %u) holds the shared-memory poison "
                    "0x%04x in its %s half: it was loaded from shared memory that was never "
                    "written, or before the cp.async filling it completed and a __syncthreads "
                    "published it (out-of-range rows must be zero-filled, e.g. with src_bytes=0)",
                    op_name(c.op, c.kind), at(c.loc).c_str(), names[r], lane, warp, kPoisonHalf,
                    half ? "high" : "low"));
            }
        }
    }
}

// The value of one OCP e4m3 code (exact in float): 4 exponent bits of bias 7, 3 mantissa
// bits, denormals below 2^-6, no infinities, S.1111.111 the only NaNs.
float e4m3_to_float(uint8_t code) {
    const int e = (code >> 3) & 15;
    const int m = code & 7;
    float v;
    if (e == 15 && m == 7)
        v = std::numeric_limits<float>::quiet_NaN();
    else if (e == 0)
        v = std::ldexp(static_cast<float>(m), -9);
    else
        v = std::ldexp(static_cast<float>(8 + m), e - 10);
    return (code & 0x80) ? -v : v;
}

// The value of one OCP e5m2 code (exact in float): 5 exponent bits of bias 15, 2 mantissa
// bits, denormals below 2^-14, S.11111.00 infinities, S.11111.{01,10,11} NaNs.
float e5m2_to_float(uint8_t code) {
    const int e = (code >> 2) & 31;
    const int m = code & 3;
    float v;
    if (e == 31)
        v = m == 0 ? std::numeric_limits<float>::infinity()
                   : std::numeric_limits<float>::quiet_NaN();
    else if (e == 0)
        v = std::ldexp(static_cast<float>(m), -16);
    else
        v = std::ldexp(static_cast<float>(4 + m), e - 17);
    return (code & 0x80) ? -v : v;
}

// D = A B + C of one m16n8kK mma, from the operands gathered into A (16 x K), B (K x 8)
// and C, written to the lanes' D fragments (row g: d0, d1; row g + 8: d2, d3; columns 2 t,
// 2 t + 1). Every product of two 16-bit or two 8-bit floats is exact in double, and so is
// the sum of K of them: the sum is formed in double and rounded to float once.
template <int K>
static void mma_product(const Collective& c, const float (&A)[16][K], const float (&B)[K][8]) {
    float C[16][8];
    for (unsigned lane = 0; lane < 32; ++lane) {
        unsigned g = lane >> 2, t = lane & 3;
        const auto* cc = static_cast<const float*>(c.lanes[lane].in2);
        for (unsigned i = 0; i < 4; ++i) C[g + 8 * (i >> 1)][2 * t + (i & 1)] = cc[i];
    }
    for (unsigned lane = 0; lane < 32; ++lane) {
        unsigned g = lane >> 2, t = lane & 3;
        auto* d = static_cast<float*>(c.lanes[lane].out);
        for (unsigned i = 0; i < 4; ++i) {
            const unsigned row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
            double acc = 0.0;
            for (int k = 0; k < K; ++k)
                acc += static_cast<double>(A[row][k]) * static_cast<double>(B[k][col]);
            d[i] = static_cast<float>(acc + static_cast<double>(C[row][col]));
        }
    }
}

// mma.m16n8k32 with e4m3 or e5m2 A and B (PTX ISA, "matrix fragments for mma.m16n8k32",
// 8-bit types): A register r of a lane holds row g (r even) or g + 8 (r odd), columns
// 4 t + 16 (r / 2) + byte; B register r holds rows (k) 4 t + 16 r + byte of column g. e4m3
// products are multiples of 2^-18 below 2^18, so their sum of 32 is exact in double; e5m2
// products span 2^-32 .. 2^32, so the double sum is exact unless the terms' exponents differ
// by more than double's 53 bits allow (then it is double's rounding, before float's).
static void compute_mma_fp8(const Collective& c, float (*decode)(uint8_t)) {
    float A[16][32], B[32][8];
    for (unsigned lane = 0; lane < 32; ++lane) {
        unsigned g = lane >> 2, t = lane & 3;
        const auto* a = static_cast<const unsigned*>(c.lanes[lane].in0);
        const auto* b = static_cast<const unsigned*>(c.lanes[lane].in1);
        for (unsigned r = 0; r < 4; ++r)
            for (unsigned byte = 0; byte < 4; ++byte)
                A[g + 8 * (r & 1)][4 * t + 16 * (r >> 1) + byte] =
                    decode(static_cast<uint8_t>(a[r] >> (8 * byte)));
        for (unsigned r = 0; r < 2; ++r)
            for (unsigned byte = 0; byte < 4; ++byte)
                B[4 * t + 16 * r + byte][g] =
                    decode(static_cast<uint8_t>(b[r] >> (8 * byte)));
    }
    mma_product<32>(c, A, B);
}

static void compute_mma(const Collective& c, unsigned warp) {
    if (g_launch->cfg->checks & FTEMU_CHECK_POISON_OPERANDS) check_poison(c, warp);
    if (c.kind == FTEMU_MMA_E4M3 || c.kind == FTEMU_MMA_E5M2) {
        compute_mma_fp8(c, c.kind == FTEMU_MMA_E4M3 ? e4m3_to_float : e5m2_to_float);
        return;
    }
    const float* h = half_table();
    bool bf16 = c.kind == FTEMU_MMA_BF16;
    auto cvt = [&](uint16_t v) { return bf16 ? bf16_to_float(v) : h[v]; };
    float A[16][16], B[16][8];
    for (unsigned lane = 0; lane < 32; ++lane) {
        unsigned g = lane >> 2, t = lane & 3;
        const auto* a = static_cast<const unsigned*>(c.lanes[lane].in0);
        const auto* b = static_cast<const unsigned*>(c.lanes[lane].in1);
        const unsigned rows[4] = {g, g + 8, g, g + 8};
        const unsigned cols[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
        for (int r = 0; r < 4; ++r) {
            A[rows[r]][cols[r]] = cvt(static_cast<uint16_t>(a[r]));
            A[rows[r]][cols[r] + 1] = cvt(static_cast<uint16_t>(a[r] >> 16));
        }
        for (int r = 0; r < 2; ++r) {
            B[2 * t + 8 * r][g] = cvt(static_cast<uint16_t>(b[r]));
            B[2 * t + 8 * r + 1][g] = cvt(static_cast<uint16_t>(b[r] >> 16));
        }
    }
    mma_product<16>(c, A, B);
}

static void compute_ldmatrix(const Collective& c, unsigned warp) {
    Launch& L = *g_launch;
    int count = c.kind & 7;
    bool trans = (c.kind >> 4) & 1;
    uint16_t M[4][8][8];
    for (int j = 0; j < count; ++j)
        for (int r = 0; r < 8; ++r) {
            unsigned lane = static_cast<unsigned>(8 * j + r);
            read_ldmatrix_row(L.threads[warp * 32 + lane], c.lanes[lane].in0,
                              op_name(c.op, c.kind), c.loc, M[j][r]);
        }
    for (unsigned lane = 0; lane < 32; ++lane) {
        auto* regs = static_cast<unsigned*>(c.lanes[lane].out);
        unsigned row = lane / 4, col = 2 * (lane % 4);
        for (int j = 0; j < count; ++j) {
            uint16_t lo = trans ? M[j][col][row] : M[j][row][col];
            uint16_t hi = trans ? M[j][col + 1][row] : M[j][row][col + 1];
            regs[j] = static_cast<unsigned>(lo) | static_cast<unsigned>(hi) << 16;
        }
    }
}

static void compute_shfl(const Collective& c, unsigned warp) {
    unsigned width = static_cast<unsigned>(c.width);
    for (unsigned lane = 0; lane < 32; ++lane) {
        if (!(c.arrived >> lane & 1u)) continue;
        const LaneArgs& me = c.lanes[lane];
        unsigned b = static_cast<unsigned>(me.arg) & 31u;
        unsigned seg = lane & ~(width - 1);  // first lane of this lane's segment
        unsigned last = seg + width - 1;
        unsigned src = lane;
        bool in_range = true;
        switch (c.kind) {
            case FTEMU_SHFL_IDX: src = seg | (b & (width - 1)); break;
            case FTEMU_SHFL_UP:
                src = lane - b;
                in_range = lane >= b && src >= seg;
                break;
            case FTEMU_SHFL_DOWN:
                src = lane + b;
                in_range = src <= last;
                break;
            case FTEMU_SHFL_XOR:
                // PTX shfl.bfly: only a source beyond the segment's last lane is out of range;
                // a source in an earlier segment is read (CUDA guide: "each group ... can
                // access elements from earlier groups").
                src = lane ^ b;
                in_range = src <= last;
                break;
        }
        if (!in_range) src = lane;
        if (!(c.arrived >> src & 1u))
            fail(FTEMU_ERROR, format(
                "%s at %s: lane %u (warp %u) reads lane %u, which does not take part (mask "
                "0x%08x; lanes taking part: %s): the value is undefined", op_name(c.op, c.kind),
                at(c.loc).c_str(), lane, warp, src, c.mask, lane_list(c.arrived).c_str()));
        *static_cast<unsigned*>(me.out) = c.lanes[src].value;
    }
}

static void compute_vote(const Collective& c) {
    unsigned ballot = 0;
    for (unsigned lane = 0; lane < 32; ++lane)
        if ((c.arrived >> lane & 1u) && c.lanes[lane].arg) ballot |= 1u << lane;
    unsigned result = c.kind == FTEMU_VOTE_BALLOT ? ballot
                      : c.kind == FTEMU_VOTE_ALL  ? static_cast<unsigned>(ballot == c.arrived)
                                                  : static_cast<unsigned>(ballot != 0);
    for (unsigned lane = 0; lane < 32; ++lane)
        if (c.arrived >> lane & 1u) *static_cast<unsigned*>(c.lanes[lane].out) = result;
}

static void complete(Launch& L, unsigned warp, Collective& c) {
    switch (c.op) {
        case Op::Mma: compute_mma(c, warp); break;
        case Op::Ldmatrix: compute_ldmatrix(c, warp); break;
        case Op::Shfl: compute_shfl(c, warp); break;
        case Op::Vote: compute_vote(c); break;
        case Op::SyncWarp: break;
        case Op::Wgmma: compute_wgmma(c, warp); break;
    }
    if (L.counters) count_collective(L, c, warp);
    c.active = false;
    for (unsigned lane = 0; lane < 32; ++lane) {
        if (!(c.arrived >> lane & 1u)) continue;
        Thread& t = L.threads[warp * 32 + lane];
        t.collective = -1;
        if (&t != L.cur && t.state == TState::InCollective) make_runnable(t);
    }
}

static unsigned required_lanes(const Warp& W, const Collective& c) {
    return is_aligned_op(c.op) ? 0xffffffffu : (c.mask & ~W.exited);
}

// The calling lane takes part in a collective; returns once it is complete.
static void join(Op op, int kind, int width, unsigned mask, ftemu_loc loc, const LaneArgs& args) {
    Launch& L = *g_launch;
    Thread& me = *L.cur;
    check_async_errors();
    Warp& W = L.warps[me.warp];
    unsigned bit = 1u << me.lane;
    const char* name = op_name(op, kind);
    bool aligned = is_aligned_op(op);
    if (aligned) {
        if (W.present != 0xffffffffu)
            fail(FTEMU_ERROR, format(
                "%s at %s needs a full warp, but warp %u has only lanes %s (the block size %u "
                "is not a multiple of 32)", name, at(loc).c_str(), me.warp,
                lane_list(W.present).c_str(), L.nthreads));
        if (W.exited)
            fail(FTEMU_DEADLOCK, format(
                "%s at %s needs all 32 lanes of warp %u, but lanes %s have returned: it can "
                "never complete", name, at(loc).c_str(), me.warp, lane_list(W.exited).c_str()));
    } else {
        if (!(mask & bit))
            fail(FTEMU_ERROR, format("%s at %s: mask 0x%08x does not name the calling lane %u",
                                     name, at(loc).c_str(), mask, me.lane));
        if (mask & ~W.present)
            fail(FTEMU_ERROR, format(
                "%s at %s: mask 0x%08x names lanes %s, which do not exist (the block has %u "
                "threads)", name, at(loc).c_str(), mask, lane_list(mask & ~W.present).c_str(),
                L.nthreads));
        if (op == Op::Shfl && (width < 1 || width > 32 || (width & (width - 1))))
            fail(FTEMU_ERROR, format("%s at %s: width %d is not a power of two in [1, 32]", name,
                                     at(loc).c_str(), width));
    }
    Collective* c = nullptr;
    for (Collective& p : W.pool)
        if (p.active && p.mask == mask && !(p.arrived & bit) && (!c || p.serial < c->serial))
            c = &p;
    if (c) {
        if (c->op != op || c->kind != kind)
            fail(FTEMU_ERROR, format(
                "warp %u diverged at a warp collective: lanes %s wait in %s at %s, while lane %u "
                "reached %s at %s with the same mask 0x%08x; every lane named in the mask must "
                "execute the same operation", me.warp, lane_list(c->arrived).c_str(),
                op_name(c->op, c->kind), at(c->loc).c_str(), me.lane, name, at(loc).c_str(),
                mask));
        if (c->width != width)
            fail(FTEMU_ERROR, format(
                "%s at %s: lane %u uses width %d, but lanes %s use width %d", name,
                at(loc).c_str(), me.lane, width, lane_list(c->arrived).c_str(), c->width));
        if (aligned && (c->loc.line != loc.line ||
                        (c->loc.file != loc.file && std::strcmp(c->loc.file, loc.file) != 0)))
            fail(FTEMU_ERROR, format(
                "%s is .sync.aligned: all 32 lanes must execute the same instruction, but lanes "
                "%s are at %s and lane %u at %s", name, lane_list(c->arrived).c_str(),
                at(c->loc).c_str(), me.lane, at(loc).c_str()));
    } else {
        for (Collective& p : W.pool)
            if (!p.active) {
                c = &p;
                break;
            }
        c->active = true;
        c->op = op;
        c->kind = kind;
        c->width = width;
        c->mask = mask;
        c->arrived = 0;
        c->serial = ++L.collective_serial;
        c->loc = loc;
    }
    c->lanes[me.lane] = args;
    c->arrived |= bit;
    unsigned need = required_lanes(W, *c);
    if ((c->arrived & need) == need) {
        complete(L, me.warp, *c);
        return;
    }
    me.collective = static_cast<int>(c - W.pool.data());
    me.wait_loc = loc;
    make_blocked(me, TState::InCollective);
    suspend(me);
}

void on_lane_exit(Thread& t) {
    wgmma_on_exit(t);
    Launch& L = *g_launch;
    Warp& W = L.warps[t.warp];
    unsigned bit = 1u << t.lane;
    for (Collective& c : W.pool) {
        if (!c.active || !(c.mask & bit)) continue;
        if (is_aligned_op(c.op))
            fail(FTEMU_DEADLOCK, format(
                "lane %u of warp %u returned while lanes %s wait in %s; it needs all 32 lanes, "
                "so it can never complete", t.lane, t.warp, lane_list(c.arrived).c_str(),
                describe_collective(c).c_str()));
        unsigned need = required_lanes(W, c);
        if ((c.arrived & need) == need) complete(L, t.warp, c);
    }
}

}  // namespace ftemu

using namespace ftemu;

extern "C" FTEMU_API void ftemu_mma_m16n8k16(int kind, float* d, const unsigned* a,
                                             const unsigned* b, const float* c, ftemu_loc loc) {
    if (kind != FTEMU_MMA_F16 && kind != FTEMU_MMA_BF16)
        fail(FTEMU_ERROR, format("mma at %s: unknown kind %d", at(loc).c_str(), kind));
    join(Op::Mma, kind, 32, 0xffffffffu, loc, LaneArgs{d, a, b, c, 0, 0});
}

extern "C" FTEMU_API void ftemu_mma_m16n8k32(int kind, float* d, const unsigned* a,
                                             const unsigned* b, const float* c, ftemu_loc loc) {
    if (kind != FTEMU_MMA_E4M3 && kind != FTEMU_MMA_E5M2)
        fail(FTEMU_ERROR, format("mma m16n8k32 at %s: unknown kind %d", at(loc).c_str(), kind));
    join(Op::Mma, kind, 32, 0xffffffffu, loc, LaneArgs{d, a, b, c, 0, 0});
}

extern "C" FTEMU_API void ftemu_ldmatrix(int count, int trans, unsigned* regs,
                                         const void* row_addr, ftemu_loc loc) {
    if (count != 1 && count != 2 && count != 4)
        fail(FTEMU_ERROR, format("ldmatrix at %s: count %d is not 1, 2 or 4", at(loc).c_str(),
                                 count));
    join(Op::Ldmatrix, count | (trans ? 16 : 0), 32, 0xffffffffu, loc,
         LaneArgs{regs, row_addr, nullptr, nullptr, 0, 0});
}

extern "C" FTEMU_API unsigned ftemu_shfl(int mode, unsigned mask, unsigned value, int arg,
                                         int width, ftemu_loc loc) {
    if (mode < FTEMU_SHFL_IDX || mode > FTEMU_SHFL_XOR)
        fail(FTEMU_ERROR, format("shuffle at %s: unknown mode %d", at(loc).c_str(), mode));
    unsigned out = 0;
    join(Op::Shfl, mode, width, mask, loc, LaneArgs{&out, nullptr, nullptr, nullptr, value, arg});
    return out;
}

extern "C" FTEMU_API unsigned ftemu_vote(int mode, unsigned mask, int predicate, ftemu_loc loc) {
    if (mode < FTEMU_VOTE_ALL || mode > FTEMU_VOTE_BALLOT)
        fail(FTEMU_ERROR, format("vote at %s: unknown mode %d", at(loc).c_str(), mode));
    unsigned out = 0;
    join(Op::Vote, mode, 32, mask, loc,
         LaneArgs{&out, nullptr, nullptr, nullptr, 0, predicate != 0});
    return out;
}

extern "C" FTEMU_API void ftemu_syncwarp(unsigned mask, ftemu_loc loc) {
    join(Op::SyncWarp, 0, 32, mask, loc, LaneArgs{nullptr, nullptr, nullptr, nullptr, 0, 0});
}

extern "C" FTEMU_API void ftemu_wgmma(int kind, void* args, ftemu_loc loc) {
    join(Op::Wgmma, kind, 32, 0xffffffffu, loc, LaneArgs{nullptr, args, nullptr, nullptr, 0, 0});
}
