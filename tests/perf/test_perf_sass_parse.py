"""SASS text parsing on hand-written listings in the nvdisasm and cuobjdump formats."""

from __future__ import annotations

import pytest

from flashtune.errors import InvalidInput
from flashtune.perf.sass.loops import main_loop
from flashtune.perf.sass.parse import Instruction, categorize, parse_sass

NVDISASM = """
\t.target\tsm_80
\t.elftype\t@"ET_EXEC"
//--------------------- .text.kern                 --------------------------
\t.section\t.text.kern,"ax",@progbits
\t.sectioninfo\t@"SHI_REGISTERS=40"
        .global         kern
kern:
.text.kern:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128.CONSTANT R4, [R2.64] ;
        /*0020*/                   LDG.E R8, [R2.64+0x10] ;
        /*0030*/                   LDG.E.U16 R9, [R2.64+0x20] ;
.L_x_1:
        /*0040*/                   HMMA.16816.F32 R12, R4, R6, R12 ;
        /*0050*/                   HMMA.16816.F32.BF16 R16, R4, R6, R16 ;
        /*0060*/                   LDSM.16.M88.4 R20, [R21] ;
        /*0070*/              @!PT LDS RZ, [RZ] ;
        /*0080*/                   LDGSTS.E.BYPASS.128 [R21], [R2.64] ;
        /*0090*/                   MUFU.EX2 R9, R9 ;
        /*00a0*/                   FFMA R9, R9, R10, -R11 ;
        /*00b0*/                   SHFL.BFLY PT, R3, R9, 0x1, 0x1f ;
        /*00c0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00d0*/                   STL [R1], R9 ;
        /*00e0*/                   LDL.64 R22, [R1+0x8] ;
        /*00f0*/               @P0 BRA `(.L_x_1) ;
        /*0100*/                   STG.E.128 [R2.64], R4 ;
        /*0110*/                   STG.E.64 [R2.64+0x20], R8 ;
        /*0120*/                   EXIT ;
.L_x_2:
        /*0130*/                   BRA `(.L_x_2);
        /*0140*/                   NOP;
"""

CUOBJDUMP = """
\tcode for sm_90
\t\tFunction : other
\t.headerflags\t@"EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                   /* 0x00000a00ff017b82 */
                                                                    /* 0x000fe40000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                       /* 0x0000000000007919 */
        /*0020*/                   IADD3 R0, R0, 0x1, RZ ;                  /* 0x0000000100007810 */
        /*0030*/                   ISETP.GE.AND P0, PT, R0, 0x8, PT ;       /* 0x000000080000780c */
        /*0040*/              @!P0 BRA 0x20 ;                               /* 0x0000000000008947 */
        /*0050*/                   EXIT ;                                   /* 0x000000000000794d */
"""


def test_nvdisasm_listing_counts_every_category() -> None:
    listing = parse_sass(NVDISASM)
    assert listing.arch == "sm_80"
    fn = listing.function()
    assert fn.name == "kern"
    assert fn.registers == 40
    mix = fn.mix()
    c = mix.by_category
    assert c["mma"] == 2 and c["ldsm"] == 1 and c["ldgsts"] == 1 and c["mufu"] == 1
    assert c["fp32"] == 1 and c["shfl"] == 1 and c["bar"] == 1
    assert c["ldl"] == 1 and c["stl"] == 1 and mix.local_memory == 2
    assert c["lds"] == 0  # the @!PT padding never executes
    assert dict(mix.load_widths) == {16: 1, 32: 1, 128: 1}
    assert dict(mix.store_widths) == {64: 1, 128: 1}
    assert mix.by_opcode["HMMA.16816.F32.BF16"] == 1
    assert mix.mma_flops == 2 * (2 * 16 * 8 * 16)
    assert mix.ldsm_bytes == 512
    assert mix.wide_load_share == pytest.approx(1 / 3)
    # NOP padding is not counted; the self-branch after EXIT is.
    assert mix.total == sum(c.values()) == 19


def test_nvdisasm_loop_is_found_from_the_backward_branch() -> None:
    fn = parse_sass(NVDISASM).function("kern")
    assert fn.labels[".L_x_1"] == 0x40
    loops = fn.loops()
    assert [(lp.start, lp.end) for lp in loops] == [(0x40, 0xF0)]  # not the self-branch
    hot = main_loop(fn)
    assert hot == loops[0]
    body = fn.mix(hot)
    assert body["mma"] == 2 and body["ldg"] == 0 and body["stg"] == 0 and body.total == 11


def test_cuobjdump_listing_with_addresses_and_encodings() -> None:
    listing = parse_sass(CUOBJDUMP)
    assert listing.arch == "sm_90"
    fn = listing.function("other")
    assert [i.offset for i in fn.instructions] == [0, 0x10, 0x20, 0x30, 0x40, 0x50]
    assert fn.instructions[4].predicate == "@!P0"
    assert [(lp.start, lp.end) for lp in fn.loops()] == [(0x20, 0x40)]
    assert fn.mix()["control"] == 2 and fn.mix()["int"] == 3


def test_instruction_properties() -> None:
    ins = Instruction(0x10, "LDG.E.128.CONSTANT", "R4, [R2.64]")
    assert ins.base == "LDG" and ins.modifiers == ("E", "128", "CONSTANT")
    assert ins.width_bits == 128 and ins.category == "ldg"
    assert Instruction(0, "STG.E", "[R2.64], R5").width_bits == 32
    assert Instruction(0, "FFMA", "R1, R2, R3, R4").width_bits is None
    assert Instruction(0, "HMMA.1688.F32", "").mma_flops == 2 * 16 * 8 * 8
    assert categorize("HGMMA.64x128x16.F32") == "wgmma"
    assert categorize("UIADD3") == "int"
    assert categorize("F2FP.BF16.F32.PACK_AB") == "convert"


def test_parse_errors_say_what_was_expected() -> None:
    with pytest.raises(InvalidInput, match="no SASS instruction"):
        parse_sass("hello\nworld\n")
    listing = parse_sass(NVDISASM + CUOBJDUMP)
    with pytest.raises(InvalidInput, match="2 functions"):
        listing.function()
    with pytest.raises(InvalidInput, match="'missing' is not in the listing"):
        listing.function("missing")
