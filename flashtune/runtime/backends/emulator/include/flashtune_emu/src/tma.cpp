// TMA tile loads (cp.async.bulk.tensor ... .mbarrier::complete_tx::bytes) from the emulator's
// tensor maps (abi.h ftemu_tensor_map; reference: the Hopper notes, sections 3.4 and 6.4).
//
// The model:
//  * the map is checked as cuTensorMapEncodeTiled checks its arguments (rank 1..5, box dims
//    1..256, inner box bytes a multiple of 16 and within the swizzle span, 16-byte aligned
//    address and strides) plus what the emulator models (element strides 1, no interleave);
//  * the box is read at issue: element (i0, .., i4) comes from coordinate coords + i, or is
//    the fill (zero; all-ones, a NaN, for the NaN-request mode) when any coordinate is out of
//    [0, dim); it is laid out densely in shared memory, innermost dim fastest, and the 16-byte
//    chunks of each 128/64/32-byte row are XOR-swizzled on the absolute shared-window address
//    (bits [6:4] with bits [9:7], as wgmma's descriptors read it);
//  * the destination is in flight (poison; reading it is an error for wgmma and ldmatrix)
//    until the phase of `bar` that receives the bytes completes; then the data is visible to
//    every thread. The full box counts as transaction bytes, out-of-bounds elements included;
//    a phase that receives more bytes than it expects is an error, fewer is a deadlock named
//    by the barrier and phase;
//  * the destination must be 128-byte aligned, inside the block's shared memory and free of
//    copies in flight, unpublished data and reads not yet released by a barrier phase.
#include <cstring>

#include "internal.h"

namespace ftemu {

namespace {

const char* const kSwizzleNames[4] = {"none", "32B", "64B", "128B"};

const ftemu_tensor_map& decode(const void* map, const char* op, ftemu_loc loc) {
    if (reinterpret_cast<uintptr_t>(map) % 64)
        fail(FTEMU_ERROR, format("%s at %s: the tensor map at %p is not 64-byte aligned", op,
                                 at(loc).c_str(), map));
    const auto& m = *static_cast<const ftemu_tensor_map*>(map);
    if (m.magic != FTEMU_TMAP_MAGIC)
        fail(FTEMU_ERROR, format(
            "%s at %s: the tensor map at %p is not an emulator tensor map (first word "
            "0x%016llx): under the emulator the launch passes flashtune.runtime.tma's emulator "
            "encoding; a driver-encoded CUtensorMap is opaque and cannot be decoded", op,
            at(loc).c_str(), map, m.magic));
    auto bad = [&](const std::string& what) {
        fail(FTEMU_ERROR, format("%s at %s: invalid tensor map: %s", op, at(loc).c_str(),
                                 what.c_str()));
    };
    if (m.rank < 1 || m.rank > 5) bad(format("rank %u is outside 1..5", m.rank));
    if (m.elem_bytes != 1 && m.elem_bytes != 2 && m.elem_bytes != 4 && m.elem_bytes != 8)
        bad(format("element size %u is not 1, 2, 4 or 8 bytes", m.elem_bytes));
    if (m.swizzle > 3)
        bad(format("swizzle mode %u is not modelled (none, 32B, 64B, 128B: 0..3)", m.swizzle));
    if (m.oob_fill > 1) bad(format("OOB fill mode %u is not 0 or 1", m.oob_fill));
    if (m.address % 16) bad(format("global address 0x%llx is not 16-byte aligned", m.address));
    for (unsigned d = 0; d < m.rank; ++d) {
        if (m.dims[d] < 1 || m.dims[d] > (1ull << 32))
            bad(format("dim %u is %llu elements; expected 1..2^32", d, m.dims[d]));
        if (m.box[d] < 1 || m.box[d] > 256)
            bad(format("box dim %u is %u elements; expected 1..256", d, m.box[d]));
        if (m.elem_strides[d] != 1)
            bad(format("element stride %u of dim %u: the emulator models 1 only",
                       m.elem_strides[d], d));
        if (d > 0 && (m.strides[d - 1] % 16 || m.strides[d - 1] >= (1ull << 40)))
            bad(format("stride of dim %u is %llu bytes; expected a multiple of 16 below 2^40", d,
                       m.strides[d - 1]));
    }
    const unsigned inner = m.box[0] * m.elem_bytes;
    if (inner % 16)
        bad(format("the inner box dim is %u bytes (%u elements of %u bytes); it must be a "
                   "multiple of 16 bytes", inner, m.box[0], m.elem_bytes));
    static const unsigned span[4] = {0, 32, 64, 128};
    if (m.swizzle && inner > span[m.swizzle])
        bad(format("the inner box dim is %u bytes, more than the %s swizzle span of %u bytes",
                   inner, kSwizzleNames[m.swizzle], span[m.swizzle]));
    if (m.swizzle && inner != span[m.swizzle])
        bad(format("the inner box dim is %u bytes; with %s swizzle the emulator models boxes "
                   "whose rows fill the span (%u bytes) only", inner, kSwizzleNames[m.swizzle],
                   span[m.swizzle]));
    return m;
}

uint32_t swizzle(uint32_t addr, unsigned mode) {
    static const uint32_t mask[4] = {0, 1, 3, 7};
    return addr ^ (((addr >> 7) & mask[mode]) << 4);
}

}  // namespace

}  // namespace ftemu

using namespace ftemu;

extern "C" FTEMU_API void ftemu_prefetch_tensormap(const void* map, ftemu_loc loc) {
    check_async_errors();
    decode(map, "prefetch_tensormap", loc);
}

extern "C" FTEMU_API void ftemu_tma_load(void* dst, const void* map, int rank, const int* coords,
                                         void* bar, ftemu_loc loc) {
    Launch& L = *g_launch;
    Thread& me = *L.cur;
    check_async_errors();
    const ftemu_tensor_map& m = decode(map, "tma_load", loc);
    if (rank != m.rank)
        fail(FTEMU_ERROR, format("tma_load at %s: a %dd load of a rank-%u tensor map", at(loc).c_str(),
                                 rank, m.rank));
    unsigned long long elems = 1;
    for (unsigned d = 0; d < m.rank; ++d) elems *= m.box[d];
    const unsigned long long bytes = elems * m.elem_bytes;
    if (reinterpret_cast<uintptr_t>(dst) % 128)
        fail(FTEMU_ERROR, format("tma_load at %s: the shared-memory destination %s is not "
                                 "128-byte aligned", at(loc).c_str(),
                                 describe_smem_address(dst).c_str()));
    SmemSpace* sp = locate_shared(dst);
    auto* d0 = static_cast<unsigned char*>(dst);
    if (!sp || d0 + bytes > sp->base + sp->size)
        fail(FTEMU_ERROR, format("tma_load at %s: the %llu-byte box at %s does not fit in the "
                                 "block's shared memory", at(loc).c_str(), bytes,
                                 describe_smem_address(dst).c_str()));
    const uint32_t window = ftemu_cvta_shared(dst, loc);
    const unsigned inner = m.box[0] * m.elem_bytes;
    const unsigned long long rows = elems / m.box[0];
    std::vector<Copy> copies;
    copies.reserve(bytes / 16);
    set_current_op("reading the global source of a tma_load");
    for (unsigned long long row = 0; row < rows; ++row) {
        // Coordinates of dims 1.. for this row (dim 1 fastest).
        long long base = 0;
        bool row_in = true;
        unsigned long long rest = row;
        for (unsigned d = 1; d < m.rank; ++d) {
            long long c = static_cast<long long>(coords[d]) + static_cast<long long>(rest % m.box[d]);
            rest /= m.box[d];
            if (c < 0 || c >= static_cast<long long>(m.dims[d])) row_in = false;
            base += c * static_cast<long long>(m.strides[d - 1]);
        }
        for (unsigned chunk = 0; chunk < inner / 16; ++chunk) {
            const uint32_t linear = static_cast<uint32_t>(row * inner + chunk * 16);
            unsigned char* to = d0 + (swizzle(window + linear, m.swizzle) - window);
            Copy c{};
            c.space = sp;
            c.word = static_cast<uint32_t>(sp->word_of(to));
            c.nwords = 4;
            c.loc = loc;
            c.tma = true;
            auto* out = reinterpret_cast<unsigned char*>(c.data);
            const unsigned per = 16 / m.elem_bytes;
            for (unsigned e = 0; e < per; ++e) {
                long long x = static_cast<long long>(coords[0]) + chunk * per + e;
                unsigned char* o = out + e * m.elem_bytes;
                if (row_in && x >= 0 && x < static_cast<long long>(m.dims[0]))
                    std::memcpy(o, reinterpret_cast<const unsigned char*>(m.address) + base +
                                       x * m.elem_bytes, m.elem_bytes);
                else
                    std::memset(o, m.oob_fill ? 0xFF : 0x00, m.elem_bytes);
            }
            copies.push_back(c);
        }
    }
    set_current_op(nullptr);
    for (const Copy& c : copies)
        check_async_destination(me, c, "TMA load", [&] {
            return format("tma_load at %s", at(loc).c_str());
        });
    for (const Copy& c : copies) start_async_write(me, c);
    mbarrier_track_tma(bar, std::move(copies), static_cast<int64_t>(bytes), loc);
}
