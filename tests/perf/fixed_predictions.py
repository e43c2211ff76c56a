"""A fixed set of cost-model predictions (mma.sync and wgmma paths; analytic, with compiled
resources, with a loop's instruction mix, with a whole SASS function, with counters, with
measured local accesses), recorded in ``fixed_predictions.json`` from the model before its
sm_90a path became a strategy object, and recorded again when the wgmma path began to
charge its operand reads from shared memory (which moved the smem round of every wgmma
case, and the time of those it bounds). ``test_perf_fixed_predictions.py`` holds the model
to them; ``python tests/perf/fixed_predictions.py`` prints the current figures as JSON (to
compare by eye, never to overwrite the record after a change that should not move them)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from flashtune.codegen.spec import DType, KernelConfig, Problem, Shape
from flashtune.perf.model.costmodel import TrafficCounters, predict
from flashtune.perf.sass.parse import InstructionMix, SassFunction, parse_sass

#: An mma.sync kernel: a masked loop (.L_x_1), an unmasked one (.L_x_3) with local-memory
#: accesses and a vote-guarded rescale, and a smaller tensor-core loop (.L_x_5).
MMA_SYNC_LISTING = """
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
        /*00c0*/                   MUFU.EX2 R9, R9 ;
        /*00d0*/                   SHFL.BFLY PT, R8, R9, 0x1, 0x1f ;
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

#: An sm_90a kernel: a loop of HGMMAs, wgmma fences and an mbarrier wait whose retry ptxas
#: puts after EXIT.
WGMMA_LISTING = """
\t.target\tsm_90a
.text.kern:
        /*0000*/                   SYNCS.EXCH.64 URZ, [UR12], UR4 ;
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_1:
        /*0050*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R5 ;
        /*0060*/              @!P0 BRA `(.L_x_9) ;
.L_x_2:
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING R3, 0x100 ;
        /*0080*/                   WARPGROUP.ARRIVE ;
        /*0090*/                   HGMMA.64x128x16.F32 R88, gdesc[UR16], RZ, !UPT ;
        /*00a0*/                   HGMMA.64x128x16.F32 R88, gdesc[UR16], R88, gsb0 ;
        /*00b0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*00c0*/                   MUFU.EX2 R9, R9 ;
        /*00d0*/                   FMUL R10, R9, R11 ;
        /*00e0*/                   HGMMA.64x128x16.F32 R24, R88, gdesc[UR12].tnspB, R24, gsb0 ;
        /*00f0*/                   SYNCS.ARRIVE.TRANS64 RZ, [UR10], RZ ;
        /*0100*/               @P1 BRA `(.L_x_1) ;
        /*0150*/                   EXIT ;
.L_x_9:
        /*0160*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R5 ;
        /*0170*/              @!P0 BRA `(.L_x_9) ;
        /*0180*/                   BRA `(.L_x_2) ;
"""


@dataclass(frozen=True)
class Resources:
    """Compiled resource usage (the cost model's ResourcesLike)."""

    registers: int
    spill_stores: int = 0
    spill_loads: int = 0
    static_smem: int = 0
    dynamic_smem: int = 0


def _function(listing: str) -> SassFunction:
    return parse_sass(listing).function()


def _loop_mix(listing: str) -> InstructionMix:
    fn = _function(listing)
    loop = fn.loops()[0]
    return fn.mix(loop)


SHAPES = {"square": Shape.square(4, 16, 4096), "small": Shape(2, 8, 2, 1000, 1500),
          "decode": Shape(8, 32, 8, 64, 8192)}


def cases() -> list[tuple[str, Problem, KernelConfig, str, str, dict[str, object]]]:
    """(name, problem, config, shape name, gpu, predict keywords) of every recorded case."""
    out: list[tuple[str, Problem, KernelConfig, str, str, dict[str, object]]] = []
    mma = _function(MMA_SYNC_LISTING)
    wg = _function(WGMMA_LISTING)
    for head_dim in (64, 128):
        for causal in (False, True):
            for dtype in (DType.FP16, DType.BF16) if head_dim == 128 else (DType.BF16,):
                p = Problem(head_dim, dtype, causal=causal)
                for cfg in (KernelConfig(128, 64, 4, 2), KernelConfig(64, 64, 4, 3),
                            KernelConfig(128, 128, 8, 1)):
                    for shape in ("square", "small"):
                        for gpu in ("A100", "H100"):
                            tag = f"fwd d{head_dim} c{int(causal)} {dtype.value} {cfg.key()}"
                            out.append((f"{tag} {shape} {gpu}", p, cfg, shape, gpu, {}))
                    out.append((f"{tag} res", p, cfg, "square", "H100",
                                {"resources": Resources(168, 0, 0, 0, 49152)}))
                    out.append((f"{tag} spill", p, cfg, "square", "A100",
                                {"resources": Resources(255, 64, 96, 0, 49152)}))
                    out.append((f"{tag} local", p, cfg, "small", "H100",
                                {"local_per_tile": 12.0}))
                    out.append((f"{tag} mix", p, cfg, "square", "H100",
                                {"sass": _loop_mix(MMA_SYNC_LISTING)}))
                    out.append((f"{tag} fn", p, cfg, "small", "H100", {"sass": mma}))
                    out.append((f"{tag} fn-res", p, cfg, "decode", "A100",
                                {"sass": mma, "resources": Resources(128, 0, 0, 0, 32768)}))
                    out.append((f"{tag} counters", p, cfg, "square", "H200",
                                {"counters": TrafficCounters(10**9, None, 1.5)}))
    for op in ("fwd90a", "fwd90aws"):
        for head_dim in (64, 128, 256):
            for causal in (False, True):
                p = Problem(head_dim, DType.FP16, causal=causal, op=op)
                configs = [KernelConfig(128, 64 if head_dim > 128 else 128, 8, 2),
                           KernelConfig(64, 64, 4, 3)]
                if op == "fwd90aws":
                    # Ping-pong (``--fix pingpong=1``) on the same tiles, then one more.
                    configs += [KernelConfig.from_dict({**c.to_dict(), "pingpong": 1})
                                for c in configs]
                    configs += [KernelConfig(128, 128, 8, 2, extras=(("pingpong", 1),)),
                                KernelConfig(128, 64, 8, 2, extras=(("loadk", "cpasync"),))]
                    configs = list(dict.fromkeys(configs))
                for cfg in configs:
                    tag = f"{op} d{head_dim} c{int(causal)} {cfg.key()}"
                    for shape in ("square", "small"):
                        out.append((f"{tag} {shape}", p, cfg, shape, "H100", {}))
                    out.append((f"{tag} res", p, cfg, "square", "H100",
                                {"resources": Resources(168, 0, 0, 0, 90000)}))
                    out.append((f"{tag} fn", p, cfg, "square", "H200", {"sass": wg}))
                    out.append((f"{tag} mma-fn", p, cfg, "small", "H100", {"sass": mma}))
    return out


#: The fields of a prediction the record keeps (the figures, its labels and its notes).
KEPT = ("time_ms", "tflops", "bound", "model_version", "path", "assumptions", "notes",
        "cycles_per_tile", "waves", "utilisation", "dram_ms", "l2_ms")


def record() -> dict[str, object]:
    """The figures of every case that the model predicts (an error's type otherwise)."""
    out: dict[str, object] = {}
    for name, problem, config, shape, gpu, kwargs in cases():
        try:
            pred = predict(problem, config, SHAPES[shape], gpu, **kwargs)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - the record names what was raised
            out[name] = {"error": type(exc).__name__}
            continue
        full = pred.to_dict()
        out[name] = {k: full[k] for k in KEPT}
    return out


def dumps(figures: dict[str, object]) -> str:
    """The record as JSON text, one case a line."""
    lines = [f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}"
             for k, v in sorted(figures.items())]
    return "{\n" + ",\n".join(lines) + "\n}\n"


if __name__ == "__main__":
    print(dumps(record()), end="")
