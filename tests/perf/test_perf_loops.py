"""Main-loop analysis (perf.sass.loops) on hand-written SASS: which loop is masked, what a warp
vote can skip, and which local-memory accesses sit in a tensor-core chain."""

from __future__ import annotations

from flashtune.perf.sass.loops import LoopKind, main_loops
from flashtune.perf.sass.parse import parse_sass

# A masked loop (.L_x_1) and an unmasked one (.L_x_3) of one tile each (two HMMAs), a
# smaller tensor-core loop that is not a main loop (.L_x_5), and in the unmasked loop a
# rescale block that a vote lets the warp skip.
TWO_LOOPS = """
\t.target\tsm_90
.text.kern:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HMMA.16816.F32.BF16 R12, R4, R6, R12 ;
        /*0020*/                   ISETP.GE.AND P1, PT, R2, 0x3, PT ;
        /*0030*/                   FSEL R12, R12, -INF , !P1 ;
        /*0040*/                   HMMA.16816.F32.BF16 R16, R4, R6, R16 ;
        /*0050*/               @P0 BRA `(.L_x_1) ;
.L_x_3:
        /*0060*/                   LDL R30, [R1] ;
        /*0070*/                   LDL R4, [R1+0x4] ;
        /*0080*/                   HMMA.16816.F32.BF16 R12, R4, R6, R12 ;
        /*0090*/                   LDL R6, [R1+0x8] ;
        /*00a0*/                   LDSM.16.M88.4 R4, [R21] ;
        /*00b0*/                   HMMA.16816.F32.BF16 R16, R4, R6, R16 ;
        /*00c0*/                   STL [R1+0xc], R19 ;
        /*00d0*/                   STL [R1+0x10], R30 ;
        /*00e0*/                   FSETP.NEU.AND P2, PT, R30, R31, PT ;
        /*00f0*/                   VOTE.ANY P2, P2 ;
        /*0100*/              @!P2 BRA `(.L_x_4) ;
        /*0110*/                   FMUL R12, R12, R30 ;
        /*0120*/                   FMUL R13, R13, R30 ;
        /*0130*/                   FMUL R14, R14, R30 ;
.L_x_4:
        /*0140*/                   ISETP.GE.AND P0, PT, R2, 0x1, PT ;
        /*0150*/               @P0 BRA `(.L_x_3) ;
.L_x_5:
        /*0160*/                   HMMA.16816.F32.BF16 R12, R4, R6, R12 ;
        /*0170*/               @P0 BRA `(.L_x_5) ;
        /*0180*/                   EXIT ;
"""


def test_masked_and_unmasked_loops_by_structure() -> None:
    loops = main_loops(parse_sass(TWO_LOOPS).function())
    assert loops.masked is not None and loops.unmasked is not None
    assert loops.masked.kind is LoopKind.MASKED
    assert (loops.masked.loop.start, loops.masked.loop.end) == (0x10, 0x50)
    assert (loops.unmasked.loop.start, loops.unmasked.loop.end) == (0x60, 0x150)
    assert [lp.kind for lp in loops] == [LoopKind.MASKED, LoopKind.UNMASKED]


def test_vote_guarded_block_is_what_an_iteration_can_skip() -> None:
    unmasked = main_loops(parse_sass(TWO_LOOPS).function()).unmasked
    assert unmasked is not None
    assert unmasked.static == 16
    assert [(b.start, b.end) for b in unmasked.skipped] == [(0x110, 0x130)]
    assert unmasked.executed_min == 16 - 3
    # The masked loop's conditional branch is its back edge, not a skip.
    masked = main_loops(parse_sass(TWO_LOOPS).function()).masked
    assert masked is not None and masked.skipped == () and masked.executed_min == masked.static


def test_local_memory_in_a_tensor_core_chain() -> None:
    local = main_loops(parse_sass(TWO_LOOPS).function()).unmasked
    assert local is not None
    use = local.local
    assert (use.loads, use.stores, use.accesses) == (3, 2, 5)
    # R4 (loaded, then an MMA operand) and R19 (an MMA result, then stored) are in a chain.
    # R6's load is overwritten by the LDSM (R4-R7) before the second MMA reads R6, and R30
    # feeds only the FMULs and is stored unchanged: neither is in a chain.
    assert use.in_mma_chain == 2


def test_kernel_without_tensor_cores_has_no_main_loop() -> None:
    listing = parse_sass("""
.text.k:
        /*0000*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0010*/               @P0 BRA `(.L_x_0) ;
.L_x_0:
        /*0020*/                   EXIT ;
""")
    loops = main_loops(listing.function())
    assert loops.masked is None and loops.unmasked is None and list(loops) == []


# The shape of the MLA decoding kernel's tile loop (.L_x_1): an inner tensor-core loop over
# the head dim (.L_x_2, no exponential), the softmax's MUFU.EX2, and a shuffle that ptxas
# guards with BRA.DIV (taken only when the warp has diverged) into an out-of-line stub
# after EXIT that jumps back into the loop.
TILE_LOOP_WITH_STEPS = """
.text.mla:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDSM.16.M88.4 R4, [R21] ;
.L_x_2:
        /*0020*/                   HMMA.16816.F32.BF16 R12, R4, R6, R12 ;
        /*0030*/                   HMMA.16816.F32.BF16 R16, R4, R6, R16 ;
        /*0040*/               @P1 BRA `(.L_x_2) ;
        /*0050*/                   MUFU.EX2 R9, R9 ;
        /*0060*/                   BRA.DIV UR7, `(.L_x_9) ;
        /*0070*/                   SHFL.BFLY PT, R8, R9, 0x1, 0x1f ;
.L_x_3:
        /*0080*/                   HMMA.16816.F32.BF16 R24, R4, R6, R24 ;
        /*0090*/                   HMMA.16816.F32.BF16 R28, R4, R6, R28 ;
        /*00a0*/                   HMMA.16816.F32.BF16 R32, R4, R6, R32 ;
        /*00b0*/               @P0 BRA `(.L_x_1) ;
        /*00c0*/                   EXIT ;
.L_x_9:
        /*00d0*/                   WARPSYNC.COLLECTIVE R2, `(.L_x_10) ;
.L_x_10:
        /*00e0*/                   SHFL.BFLY P2, R8, R9, 0x1, 0x1f ;
        /*00f0*/                   BRA `(.L_x_3) ;
"""


def test_a_divergence_guard_falls_through_so_the_tile_loop_is_a_loop() -> None:
    """BRA.DIV has no predicate but is conditional: the loop head still dominates the back
    edge, and the stub's jump back into the loop is not a loop."""
    fn = parse_sass(TILE_LOOP_WITH_STEPS).function()
    assert [(lp.start, lp.end) for lp in fn.loops()] == [(0x10, 0xB0), (0x20, 0x40)]


def test_a_tensor_core_step_loop_inside_the_softmax_loop_is_not_the_main_loop() -> None:
    loops = main_loops(parse_sass(TILE_LOOP_WITH_STEPS).function())
    assert loops.masked is None and loops.unmasked is not None
    assert (loops.unmasked.loop.start, loops.unmasked.loop.end) == (0x10, 0xB0)
    assert loops.unmasked.mix.mma_flops == 5 * 4096  # the step loop's body counted once
