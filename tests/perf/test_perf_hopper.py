"""sm_90a (wgmma) kernels in the profile and the cost model: HGMMA counts and FLOPs per
instruction, the barrier / TMA / mbarrier classes, the loops of a listing with out-of-line
mbarrier retries, and the labelled wgmma prediction path."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
from typer.testing import CliRunner

from flashtune import families
from flashtune.cli import app
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.errors import InvalidConfig
from flashtune.families.hopper import space
from flashtune.perf.model.costmodel import predict, rank
from flashtune.perf.model.gpus import default_gpu_for_arch
from flashtune.perf.model.wgmma import Design, design_of
from flashtune.perf.profile import KernelProfile, profile_kernel, resolve_gpu
from flashtune.perf.sass.loops import main_loop, main_loops
from flashtune.perf.sass.parse import Instruction, categorize, parse_sass

# The shape of NVRTC 13's sm_90a output (compiled fwd90aws ping-pong / fwd90a listings): a loop with
# HGMMAs, wgmma fences, an mbarrier wait whose retry ptxas puts after EXIT and which jumps
# back, named barriers, TMA and setmaxnreg outside the loop.
LISTING = """
\t.target\tsm_90a
.text.kern:
        /*0000*/                   SYNCS.EXCH.64 URZ, [UR12], UR4 ;
        /*0010*/                   FENCE.VIEW.ASYNC.S ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;
        /*0040*/               @P0 BAR.ARV 0x1, 0x100 ;
.L_x_1:
        /*0050*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R5 ;
        /*0060*/              @!P0 BRA `(.L_x_9) ;
.L_x_2:
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING R3, 0x100 ;
        /*0080*/                   WARPGROUP.ARRIVE ;
        /*0090*/                   HGMMA.64x128x16.F32 R88, gdesc[UR16], RZ, !UPT ;
        /*00a0*/                   HGMMA.64x128x16.F32 R88, gdesc[UR16], R88, gsb0 ;
        /*00b0*/                   BAR.ARV R0, 0x100 ;
        /*00c0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*00d0*/                   MUFU.EX2 R9, R9 ;
        /*00e0*/                   HGMMA.64x64x16.F32 R24, R88, gdesc[UR12].tnspB, R24, gsb0 ;
        /*00f0*/                   SYNCS.ARRIVE.TRANS64 RZ, [UR10], RZ ;
        /*0100*/               @P1 BRA `(.L_x_1) ;
        /*0110*/                   USETMAXREG.DEALLOC.CTAPOOL 0x18 ;
        /*0120*/                   UTMACCTL.PF [UR18] ;
        /*0130*/                   UTMALDG.5D [UR8], [UR18] ;
        /*0140*/                   ARRIVES.LDGSTSBAR.64.ARVCNT [UR4] ;
        /*0150*/                   EXIT ;
.L_x_9:
        /*0160*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R5 ;
        /*0170*/              @!P0 BRA `(.L_x_9) ;
        /*0180*/                   BRA `(.L_x_2) ;
.L_x_10:
        /*0190*/                   BRA `(.L_x_10);
"""


def test_hopper_opcodes_have_their_own_classes() -> None:
    expected = {
        "HGMMA.64x128x16.F32": "wgmma", "WARPGROUP.ARRIVE": "wgsync",
        "WARPGROUP.DEPBAR.LE": "wgsync", "SYNCS.EXCH.64": "mbarrier",
        "SYNCS.ARRIVE.TRANS64": "mbarrier", "SYNCS.PHASECHK.TRANS64.TRYWAIT": "mbarrier",
        "ARRIVES.LDGSTSBAR.64.ARVCNT": "mbarrier", "UTMALDG.5D": "tma",
        "UTMACCTL.PF": "tma", "USETMAXREG.DEALLOC.CTAPOOL": "regalloc",
        "FENCE.VIEW.ASYNC.S": "fence", "MEMBAR.ALL.CTA": "fence",
        "BAR.SYNC.DEFER_BLOCKING": "bar", "UIADD3": "int",
    }
    assert {op: categorize(op) for op in expected} == expected
    cta = Instruction(0, "BAR.SYNC.DEFER_BLOCKING", "0x0")
    named = Instruction(0, "BAR.SYNC.DEFER_BLOCKING", "R3, 0x100")
    arrive = Instruction(0, "BAR.ARV", "0x1, 0x100")
    assert (cta.category, named.category, arrive.category) == ("bar", "namedbar", "namedbar")


def test_hgmma_flops_per_instruction_and_per_warp() -> None:
    ins = Instruction(0, "HGMMA.64x128x16.F32", "R88, gdesc[UR16], R88")
    assert ins.tensor_flops == 2 * 64 * 128 * 16  # warpgroup-wide
    assert ins.mma_flops == 2 * 16 * 128 * 16     # one warp's 16 of the 64 rows
    assert Instruction(0, "HGMMA.64x64x16.F32", "").tensor_flops == 2 * 64 * 64 * 16
    assert Instruction(0, "HMMA.16816.F32", "").tensor_flops == 2 * 16 * 8 * 16


def test_listing_loop_mix_and_retry_stub() -> None:
    fn = parse_sass(LISTING).function("kern")
    # The opcode keeps its lower-case shape token.
    assert fn.instructions[9].opcode == "HGMMA.64x128x16.F32"
    # The jump back from the out-of-line retry (0x180 -> 0x70) is backward but its target
    # does not dominate it: the loops are the main loop and the retry's own spin.
    assert [(lp.start, lp.end) for lp in fn.loops()] == [(0x50, 0x100), (0x160, 0x170)]
    loop = main_loop(fn)
    assert loop is not None and (loop.start, loop.end) == (0x50, 0x100)
    mix = fn.mix(loop)
    c = mix.by_category
    assert (c["wgmma"], c["wgsync"], c["mbarrier"], c["namedbar"], c["bar"]) == (3, 2, 2, 2, 0)
    assert mix.wgmma_flops == mix.mma_flops == (2 * 2 * 16 * 128 * 16 + 2 * 16 * 64 * 16)
    ops = {t.opcode: (t.count, t.flops_per_instruction, t.shape, t.scope)
           for t in mix.tensor_ops()}
    assert ops == {"HGMMA.64x128x16.F32": (2, 262144, "64x128x16", "warpgroup"),
                   "HGMMA.64x64x16.F32": (1, 131072, "64x64x16", "warpgroup")}
    # Every non-pipe instruction and each HGMMA takes an issue slot.
    assert mix.issue_only == mix.total - c["mufu"]
    whole = fn.mix().by_category
    assert (whole["tma"], whole["regalloc"], whole["fence"], whole["bar"]) == (2, 2, 1, 1)
    assert whole["mbarrier"] == 5 and whole["namedbar"] == 3


def test_sm90a_reference_gpu() -> None:
    assert default_gpu_for_arch("sm_90a").name == "H100"
    assert resolve_gpu("sm_90a", None).name == "H100"
    assert resolve_gpu("sm_90a", "H200").name == "H200"


def _tile_problem(op: str, head_dim: int, block_m: int, block_n: int
                  ) -> tuple[Problem, KernelConfig]:
    return (Problem(head_dim, DType.FP16, op=op),
            KernelConfig(block_m, block_n, space.warps(block_m), 2))


def test_wgmma_predictions_are_labelled_and_ordered() -> None:
    """Analytic (no SASS) predictions on H100 at head dim 128: the wgmma families beat the
    mma.sync forward, the warp-specialised ones are no slower than the cp.async one, and
    every wgmma prediction names its path, model and assumptions."""
    shape = Shape.square(4, 16, 4096)
    fwd = Problem(128, DType.FP16)
    mma_sync = predict(fwd, KernelConfig(128, 64, 4, 2), shape, "H100")
    assert mma_sync.path == "mma.sync" and not mma_sync.assumptions
    preds = {}
    problem, config = _tile_problem("fwd90aws", 128, 128, 128)
    knob = KernelConfig.from_dict({**config.to_dict(), space.PINGPONG: 1})
    for name, (p, c) in {"fwd90a": _tile_problem("fwd90a", 128, 128, 128),
                         "fwd90aws": (problem, config), "pingpong": (problem, knob)}.items():
        pred = predict(p, c, shape, "H100")
        assert pred.kind == "PREDICTED" and pred.path == "wgmma"
        assert pred.model_version.startswith("fa3-wgmma-1/")
        assert any("uncalibrated" in a for a in pred.assumptions)
        preds[name] = pred.tflops
    assert preds["fwd90a"] > mma_sync.tflops
    assert preds["pingpong"] >= preds["fwd90aws"] >= preds["fwd90a"]
    assert max(preds.values()) < 989.4  # never above the datasheet rate
    # the schedule is read from the config's ping-pong knob
    assert design_of(problem, knob) == Design("fwd90aws", "TMA", 128, True)
    assert design_of(problem, config) == Design("fwd90aws", "TMA", 128, False)
    # a producer that copies with cp.async: its copies are not the consumers' (not charged,
    # said as optimistic), unlike fwd90a's consumer copies
    copying = KernelConfig.from_dict({**config.to_dict(), "loadk": "cpasync"})
    design = design_of(problem, copying)
    assert design == Design("fwd90aws", "cp.async", 128, False) and not design.consumers_copy
    assert design_of(_tile_problem("fwd90a", 128, 128, 128)[0], config) == Design(
        "fwd90a", "cp.async", 0, False)
    said = predict(problem, copying, shape, "H100").assumptions
    assert any("by cp.async from a producer warpgroup" in a and "optimistic" in a
               for a in said), said


@pytest.fixture(scope="module")
def profiles(compile_cubin: Callable[..., bytes]) -> dict[str, KernelProfile]:
    """Two compiled tiles (NVRTC + nvdisasm; skipped without them): the warp-specialised
    family's ping-pong kernel (``pingpong``) at 128 x 128, head dim 128, and the cp.async
    family at 64 x 64, head dim 64."""
    out = {}
    for op, d, bm, bn in (("fwd90aws", 128, 128, 128), ("fwd90a", 64, 64, 64)):
        problem, config = _tile_problem(op, d, bm, bn)
        if op == "fwd90aws":
            config = KernelConfig.from_dict({**config.to_dict(), space.PINGPONG: 1})
        out["pingpong" if op == "fwd90aws" else op] = profile_kernel(
            problem, config, Shape.square(4, 2048 // d, 4096), "sm_90a")
    return out


def test_main_loop_hgmma_count_times_flops_is_the_tile(
        profiles: dict[str, KernelProfile]) -> None:
    for op, prof in profiles.items():
        mix = prof.loop_mix
        assert mix is not None, op
        d, bm, bn = prof.problem.head_dim, prof.config.block_m, prof.config.block_n
        # S = Q K^T: d/16 HGMMA 64 x bn x 16; O += P V: bn/16 HGMMA 64 x d x 16, per warpgroup.
        ops = {t.opcode: (t.count, t.flops_per_instruction) for t in mix.tensor_ops()}
        assert sum(n for n, _ in ops.values()) == d // 16 + bn // 16, (op, ops)
        per_warpgroup = sum(n * f for n, f in ops.values())
        assert per_warpgroup * (bm // 64) == 4 * bm * bn * d, op
        assert prof.tensor_flops_per_iteration == prof.tensor_flops_per_tile == 4 * bm * bn * d
        assert mix.by_category["wgsync"] >= 2 and mix.by_category["mbarrier"] >= 1
        assert mix.by_category["other"] < 0.02 * mix.total, op
        assert prof.prediction is not None and prof.prediction.path == "wgmma", op
    pp, cp = profiles["pingpong"], profiles["fwd90a"]
    # The ping-pong turns are named barriers in its main loop; its producer's TMA and the
    # register hand-over are in the kernel; the cp.async family waits on mbarriers that
    # its own copies arrive on.
    assert pp.loop_mix is not None and pp.loop_mix.by_category["namedbar"] >= 2
    whole = pp.kernel_mix.by_category
    assert whole["tma"] >= 3 and whole["regalloc"] == 2 and whole["ldgsts"] == 0
    assert cp.loop_mix is not None and cp.loop_mix.by_category["ldgsts"] > 0
    assert cp.kernel_mix.by_opcode.get("ARRIVES.LDGSTSBAR.64.ARVCNT", 0) > 0
    # The ws block has a producer warpgroup more than its compute warps.
    assert pp.occupancy.warps_per_block == pp.config.num_warps + 4
    # Descriptors built once per operand buffer and moved by an immediate per k-step: the
    # d128 128 x 128 loop within FlashAttention-3's causal 128 x 128 one (469 instructions,
    # 65 integer/address ones: shared/reference/fa3-sass-facts.md); a descriptor built per
    # HGMMA cost about 6 uniform instructions each and overran both.
    assert pp.loop_mix.total <= 469 and pp.loop_mix.by_category["int"] <= 65, (
        pp.loop_mix.total, pp.loop_mix.by_category["int"])


def test_profile_cli_json_and_table(profiles: dict[str, KernelProfile]) -> None:
    args = ["profile", "--arch", "sm_90a", "--op", "fwd90aws", "--fix", "pingpong=1",
            "--head-dim", "128", "--config", "m128_n128_w8_s2", "--batch", "4", "--heads",
            "16", "--seqlen", "4096"]
    runner = CliRunner()
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    loop = data["sass"]["main_loop"]
    assert loop["tensor_flops_per_iteration"] == loop["tensor_flops_per_tile"] == 4 * 128**3
    assert {t["shape"] for t in loop["tensor_ops"]} == {"64x128x16"}
    assert loop["wgmma_flops"] == loop["mma_flops"] > 0
    assert "WARPGROUP.ARRIVE" in loop["sync_ops"] and loop["by_category"]["namedbar"] >= 2
    pred = data["prediction"]
    assert pred["kind"] == "PREDICTED" and pred["path"] == "wgmma" and pred["assumptions"]
    assert data["gpu"]["name"] == "H100"
    kernels = {p["kernel"]: p for p in data["published"]}
    assert kernels["FlashAttention-3"]["tflops"] == 638
    assert kernels["FlashAttention-3"]["predicted_over_published"] == pytest.approx(
        pred["tflops"] / 638, abs=1e-3)
    table = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    text = " ".join(table.output.split())
    for needle in ("HGMMA.64x128x16.F32 x 262144 FLOP per warpgroup", "named barriers",
                   "wgmma path", "uncalibrated", "published FlashAttention-3 on H100",
                   "predicted / published"):
        assert needle in text, needle
    assert get_arch("sm_90a").arch_specific
    # --fix is checked against the family's declared space: the knob, then its values
    bad = runner.invoke(app, [*args[:6], "pingpong=2"])
    assert bad.exit_code == 2
    assert "its values are [0, 1]" in re.sub(r"[\s│]+", " ", bad.output), bad.output
    unknown = runner.invoke(app, [*args[:6], "ping=1"])
    assert unknown.exit_code == 2
    assert "'ping' is not a knob of the 'fwd90aws' family" in re.sub(r"[\s│]+", " ",
                                                                    unknown.output)


def test_local_memory_in_a_wgmma_chain() -> None:
    """A spill reload of a register-A operand and a spill of an accumulator register past
    the first four (N/2 = 64 f32 registers per thread at N = 128) sit in the chain."""
    listing = """
.text.spill:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDL.64 R88, [R1] ;
        /*0020*/                   HGMMA.64x128x16.F32 R24, R88, gdesc[UR12].tnspB, R24 ;
        /*0030*/                   STL [R1+0x8], R80 ;
        /*0040*/                   STL [R1+0x10], R200 ;
        /*0050*/               @P0 BRA `(.L_x_1) ;
        /*0060*/                   EXIT ;
"""
    loops = main_loops(parse_sass(listing).function("spill"))
    assert loops.unmasked is not None
    local = loops.unmasked.local
    assert (local.loads, local.stores, local.in_mma_chain) == (1, 2, 2)


def test_design_validation() -> None:
    with pytest.raises(InvalidConfig, match="loads='tma'"):
        Design("x", "tma", 128, False)
    with pytest.raises(InvalidConfig, match="multiples of 128"):
        Design("x", "TMA", 96, False)
    with pytest.raises(InvalidConfig, match="producer warpgroup"):
        Design("x", "cp.async", 0, True)


def test_wgmma_operand_reads_bound_narrow_key_tiles() -> None:
    """Each consumer warpgroup reads Q and K (S) and V (P V) from shared memory per K/V
    tile, beside the K/V tile writes: at head dim 512 (V 256) with 128 x 32 tiles that is
    more than the tensor time, so the tile is bound by shared memory and ping-pong buys
    nothing; at head dim 128 with 128 x 128 tiles the tensor time still binds."""
    shape = Shape.square(4, 4, 4096)
    wide = Problem(512, DType.BF16, op="fwd90aws", head_dim_v=256)
    tiles = KernelConfig(128, 32, 8, 2)
    plain = predict(wide, tiles, shape, "H100")
    turns = predict(wide, KernelConfig.from_dict({**tiles.to_dict(), space.PINGPONG: 1}),
                    shape, "H100")
    cycles = plain.cycles.to_dict()
    blocks = plain.occupancy.blocks_per_sm
    reads = 128 * 512 * 2 + 2 * 32 * (512 + 256) * 2  # Q once, K and V per warpgroup
    writes = 32 * (512 + 256) * 2
    assert cycles["smem_round"] == pytest.approx(blocks * (reads + writes) / 128)
    assert cycles["per_tile"] == cycles["smem_round"] > cycles["compute_round"]
    assert turns.tflops == pytest.approx(plain.tflops)  # both wait for shared memory
    assert any("128 B/clk" in a for a in plain.assumptions)
    square = predict(Problem(128, DType.BF16, op="fwd90aws"), KernelConfig(128, 128, 8, 2),
                     shape, "H100").cycles.to_dict()
    assert square["smem_round"] < square["compute_round"] == square["per_tile"]


def test_every_admitted_sm90a_config_is_ranked() -> None:
    """The register estimate of an sm_90a forward stays within its launch bounds (one
    block's share of the register file), so no config the family admits is left out of
    the ranking as one that fits no SM: the cp.async family's 192-row tiles (384 threads)
    are estimated at 168 registers."""
    sm90a = get_arch("sm_90a")
    for op in ("fwd90a", "fwd90aws"):
        for head_dim in (64, 128):
            problem = Problem(head_dim, DType.BF16, op=op)
            admitted = families.of(problem).candidates(problem, sm90a)
            ranked = rank(problem, admitted, Shape.square(4, 16, 4096), "H100")
            assert len(ranked) == len(admitted), (op, head_dim)
    problem = Problem(128, DType.BF16, op="fwd90a")
    tall = next(c for c in families.of(problem).candidates(problem, sm90a) if c.block_m == 192)
    occupancy = predict(problem, tall, Shape.square(4, 16, 4096), "H100").occupancy
    assert occupancy.registers_per_thread == 168
