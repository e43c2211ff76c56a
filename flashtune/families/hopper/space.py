"""The search spaces of the sm_90a forward families: legal values and static rules with reasons.

One consumer warpgroup (4 warps) per 64 query rows: block_m 64, 128 or 192 is one, two or
three consumer warpgroups, so num_warps is block_m / 16 (4, 8 or 12) and not a knob of its
own. block_n is the N of Q K^T's wgmma: any multiple of 16 from 64 to 256 (FA3 takes 176 at
head dim 128 and 80 at 256). The stage ring holds num_stages K and V tiles.

The warp-specialised family adds the knobs ``pingpong`` (0/1: its two consumer warpgroups
take turns to issue their GEMMs) and ``overlap`` (0/1: each consumer warpgroup issues the
key tile's Q K^T together with the previous tile's P V and runs the softmax while P V does,
FA3's intra-warpgroup overlap); a knob at its default is left out of a config, so the
default kernel's key carries none. Overlap needs two or more stages (tile j's K lands while
tile j - 1's V is still read) and holds what the plain schedule holds, one S set, P and O;
it combines with ping-pong (a turn then spans P V of tile j - 1 and Q K^T of tile j, as in
FA3) and with one to three consumer warpgroups. The knobs
``loadq``, ``loadk`` and ``loadv`` (``tma`` or ``cpasync``) choose how the producer loads each
operand; any cp.async gives the producer more registers and the consumers fewer
(``WS_REGISTERS``, ``BUDGETS``).

Q/K head dims 512 and 576 (the warp-specialised family, beside V's head dim of at most 256)
have a space of their own, ``WIDE_WS_SPACE``: block_m 64 or 128, block_n 32, 48 or 64 and
the same knobs, since Q's rows and each K stage take 64 or 72 KiB per 64 rows. V's head dim
sizes V's stages and O's accumulators, Q/K's the Q and K tiles.

Rules: the tiles fit the per-block shared memory (227 KiB on sm_90), and the accumulators
(S, O and P) stay within the budget measured for the registers a consumer thread has
(``register_limit``, ``accumulator_budget``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from flashtune.codegen.arch import ArchSpec
from flashtune.codegen.params import Param, ParamSpace, Value
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.families.base import resource_reason

BLOCK_M = (64, 128, 192)
#: Every multiple of 16 from 64 to 256: a P V k-step takes 16 keys, a 128B swizzle pattern
#: 8 rows and a TMA box at most 256.
BLOCK_N = tuple(range(64, 257, 16))
NUM_STAGES = (1, 2, 3)
HEAD_DIMS = (64, 128, 256)
#: The warp-specialised family's head dims up to 256, Q/K's and V's: three panels too
#: (DeepSeek's prefill, Q/K 192 beside V 128).
WS_HEAD_DIMS = (64, 128, 192, 256)
#: Q/K head dims above 256 (spec.WIDE_HEAD_DIMS: Gemma 4's 512, DeepSeek's absorbed 576)
#: beside V's of at most 256, in the warp-specialised family: Q's rows and each K stage
#: are 64 or 72 KiB per 64 rows, so the key tiles are narrow (``WIDE_BLOCK_N``) and the
#: stages few; O's accumulators are V's.
WIDE_HEAD_DIMS = (512, 576)
WIDE_BLOCK_M = (64, 128)
WIDE_BLOCK_N = (32, 48, 64)

PINGPONG = "pingpong"
OVERLAP = "overlap"
#: How the producer loads Q, K and V, each: TMA (one lane issues a box) or cp.async (its 128
#: threads copy 16-byte chunks).
LOAD_KNOBS = ("loadq", "loadk", "loadv")
TMA, CP_ASYNC = "tma", "cpasync"
#: The warp-specialised family's knobs; each one's first value is its default.
WS_KNOBS: tuple[Param, ...] = (Param(PINGPONG, (0, 1)), Param(OVERLAP, (0, 1)),
                               *(Param(name, (TMA, CP_ASYNC)) for name in LOAD_KNOBS))
WS_DEFAULTS: Mapping[str, Value] = {p.name: p.values[0] for p in WS_KNOBS}

SPACE = ParamSpace((Param("block_m", BLOCK_M), Param("block_n", BLOCK_N),
                    Param("num_stages", NUM_STAGES)))
WS_SPACE = ParamSpace((*SPACE.params, *WS_KNOBS))
#: The warp-specialised space of a Q/K head dim of WIDE_HEAD_DIMS.
WIDE_WS_SPACE = ParamSpace((Param("block_m", WIDE_BLOCK_M), Param("block_n", WIDE_BLOCK_N),
                            Param("num_stages", NUM_STAGES), *WS_KNOBS))

#: setmaxnreg registers per thread (producer, consumer) by consumer warpgroups and whether
#: the producer's threads all load (some operand by cp.async): FA3's split (the Hopper notes,
#: section 1.1; 40 / 232 beside two consumers when K/V are not loaded by TMA).
#: templates/hopper_fwd_ws.cuh's WsRegisters holds the same table; the kernel's bindings
#: assert that they agree.
WS_REGISTERS: Mapping[tuple[int, bool], tuple[int, int]] = {
    (1, False): (56, 256), (2, False): (24, 240), (3, False): (32, 160),
    (1, True): (56, 256), (2, True): (40, 232), (3, True): (40, 152)}

class Budget(NamedTuple):
    """The most accumulator registers per thread (``accumulator_registers``) that compile
    without spills: with one stage, with two or more, and with the ``overlap`` knob (it
    needs two or more stages)."""

    one_stage: int
    more_stages: int
    overlap: int


#: How a block loads its tiles, as the budget table tells them apart: every thread copies
#: with cp.async (``fwd90a``), or a producer warpgroup loads by TMA alone or copies some
#: operand with cp.async (``fwd90aws``; its setmaxnreg split differs, WS_REGISTERS).
THREADS_COPY, TMA_PRODUCER, CP_ASYNC_PRODUCER = "threads", "tma", "cpasync"

#: Budgets of Q/K head dims 512 and 576 (WIDE_HEAD_DIMS; the warp-specialised family, one or
#: two consumer warpgroups), by (loader, consumer warpgroups), then Q/K's head dim; V's head
#: dim (64 to 256) only sizes O's accumulators. Measured with NVRTC 13 for sm_90a the same
#: way (bf16 causal, every tile of WIDE_WS_SPACE that fits shared memory, V's head dims 64,
#: 128 and 256). Two or more stages: every tile that fits compiled clean, so the budget is
#: the widest one's accumulators (the next tile exceeds shared memory; at 576 two consumer
#: warpgroups fit one stage only: 0). One stage: the widest clean tile's accumulators, the
#: next spilling (one consumer at 512: 112 clean (64 keys, V 128), 152 spills 628 bytes; at
#: 576: 100 clean, 112 spills 108; two consumers at 512: 100 clean, 112 spills 108; at 576:
#: 88 clean, 100 spills 104); beside a cp.async producer two consumers at 512 spill at every
#: one-stage tile (56: 12 bytes), at 576 hold 80 (88 spills 88 bytes).
WIDE_BUDGETS: Mapping[tuple[str, int], Mapping[int, Budget]] = {
    (TMA_PRODUCER, 1): {512: Budget(112, 164, 164), 576: Budget(100, 152, 152)},
    (TMA_PRODUCER, 2): {512: Budget(100, 152, 152), 576: Budget(88, 0, 0)},
    (CP_ASYNC_PRODUCER, 1): {512: Budget(112, 164, 164), 576: Budget(100, 152, 152)},
    (CP_ASYNC_PRODUCER, 2): {512: Budget(0, 152, 152), 576: Budget(80, 0, 0)},
}

#: Budgets by (loader, consumer warpgroups), then head dim. Measured with NVRTC 13 for
#: sm_90a (``--ptxas-options=-v``, bf16 causal, every block_n of the space; the first
#: spilling tile is 12 registers more, except where the space ends first). Not a fixed share
#: of ``register_limit``: what ptxas needs beside the accumulators grows with the head dim,
#: is larger with one stage, and is smaller where the producer warpgroup does the loads
#: (e.g. 384 cp.async threads at 168 registers spill at 124 accumulators for head dim 128
#: but hold 140 for head dim 64; with setmaxnreg's 160, three consumer warpgroups hold 148
#: at head dim 128). Head dim 256 with one stage has its own rule; three warpgroups at head
#: dim 256 never fit (176 accumulators at the smallest tile).
#:
#: Overlap holds the same accumulators (FA3's order: P of tile j - 1 and S of tile j, no
#: second S set) but keeps more of them live at once. Measured the same way with it on (two
#: stages, the cp.async producer with all three operands by cp.async): the two-stage budget
#: holds for one consumer warpgroup, for two at head dims 128 (TMA) and 256, and for three
#: at head dim 128 by cp.async; elsewhere the widest clean tile's accumulators, the next
#: tile spilling: two consumers at head dim 64, 212 (block_n 240; 256, 224, spills 480) by
#: TMA and 200 (224; 240, 212, spills 320) by cp.async; two at head dim 128 by cp.async, 196
#: (176; 192, 208, spills 184); three at head dim 64, 128 (128; 144, 140, spills 320) by
#: TMA and 116 (112; 128, 128, spills 160) by cp.async; three at head dim 128 by TMA, 124
#: (80; 96, 136, spills 160). ``fwd90a`` has no overlap (0).
#:
#: Head dim 192 (the warp-specialised family only, WS_HEAD_DIMS) was measured the same way
#: (Q, K and V of 192, every block_n up to the first spill or the shared-memory limit): one
#: consumer warpgroup holds 192 (block_n 128) by TMA, one stage 204 spilling 24 bytes (by
#: cp.async of all three operands 204 compiles clean, but a mixed load spills 84 bytes
#: there: 192 for both); two hold 192 with one stage (204 spills 132) but ping-pong spills
#: 16 bytes there, so 180; by cp.async 168 (180 spills 60 bytes with a mixed load, 84 with
#: ping-pong); with two stages two hold 180 (the next tile exceeds shared
#: memory); three spill at the smallest tile (144 accumulators, 200 bytes and more).
#:
#: A cp.async producer (its 128 threads keep 40 registers beside two or three consumer
#: warpgroups, which get 232 or 152), measured with all three operands by cp.async, block_n
#: down from the widest the TMA budget passes until one compiles clean: where the widest
#: already did the TMA budget stands; else the clean tile's accumulators, the next tile's
#: spilling (e.g. two consumers at head dim 128, one stage: 184 clean, 196 spills 40 bytes;
#: three at head dim 64, two stages: 152 clean, 164 spills 40 bytes).
BUDGETS: Mapping[tuple[str, int], Mapping[int, Budget]] = {
    (THREADS_COPY, 1): {64: Budget(188, 224, 0), 128: Budget(172, 220, 0),
                        256: Budget(0, 200, 0)},
    (THREADS_COPY, 2): {64: Budget(188, 224, 0), 128: Budget(172, 220, 0),
                        256: Budget(0, 200, 0)},
    (THREADS_COPY, 3): {64: Budget(128, 140, 0), 128: Budget(112, 112, 0),
                        256: Budget(0, 0, 0)},
    (TMA_PRODUCER, 1): {64: Budget(212, 224, 224), 128: Budget(208, 220, 220),
                        192: Budget(192, 192, 192), 256: Budget(0, 200, 200),
                        **WIDE_BUDGETS[TMA_PRODUCER, 1]},
    (TMA_PRODUCER, 2): {64: Budget(200, 224, 212), 128: Budget(196, 208, 208),
                        192: Budget(180, 180, 180), 256: Budget(0, 188, 188),
                        **WIDE_BUDGETS[TMA_PRODUCER, 2]},
    (TMA_PRODUCER, 3): {64: Budget(152, 164, 128), 128: Budget(136, 148, 124),
                        192: Budget(0, 0, 0), 256: Budget(0, 0, 0)},
    (CP_ASYNC_PRODUCER, 1): {64: Budget(212, 224, 224), 128: Budget(196, 220, 220),
                             192: Budget(192, 192, 192), 256: Budget(0, 200, 200),
                             **WIDE_BUDGETS[CP_ASYNC_PRODUCER, 1]},
    (CP_ASYNC_PRODUCER, 2): {64: Budget(200, 224, 200), 128: Budget(184, 208, 196),
                             192: Budget(168, 180, 180), 256: Budget(0, 188, 188),
                             **WIDE_BUDGETS[CP_ASYNC_PRODUCER, 2]},
    (CP_ASYNC_PRODUCER, 3): {64: Budget(152, 152, 116), 128: Budget(124, 136, 124),
                             192: Budget(0, 0, 0), 256: Budget(0, 0, 0)},
}
#: Registers are allocated to a thread in multiples of this many, at most 255.
_REG_GRANULE = 8
_MAX_REGS = 255

#: The tiles start on a 1024-byte boundary of the shared window (128B swizzle), found at run
#: time: this much slack is allocated.
ALIGN_SLACK = 1024


def warps(block_m: int) -> int:
    """Warps per block (the consumers'): a warpgroup of 4 per 64 query rows."""
    return block_m // 16


def warpgroups(config: KernelConfig) -> int:
    """Consumer warpgroups of a config: one per 64 query rows."""
    return config.block_m // 64


def knob(config: KernelConfig, name: str) -> Value:
    """The value of the warp-specialised knob ``name`` in ``config`` (its default if absent)."""
    return dict(config.extras).get(name, WS_DEFAULTS[name])


def cp_async_producer(config: KernelConfig) -> bool:
    """Whether the producer loads some operand with cp.async (all its threads load)."""
    return any(knob(config, name) == CP_ASYNC for name in LOAD_KNOBS)


def ws_registers(config: KernelConfig) -> tuple[int, int]:
    """setmaxnreg's (producer, consumer) registers per thread for ``config`` (WS_REGISTERS)."""
    return WS_REGISTERS[warpgroups(config), cp_async_producer(config)]


def without_defaults(point: Mapping[str, Value]) -> dict[str, Value]:
    """``point`` minus the knobs at their defaults (the canonical config fields)."""
    return {k: v for k, v in point.items() if k not in WS_DEFAULTS or v != WS_DEFAULTS[k]}


def wide(problem: Problem) -> bool:
    """Whether Q/K's head dim is one of WIDE_HEAD_DIMS (the space WIDE_WS_SPACE)."""
    return problem.head_dim in WIDE_HEAD_DIMS


def smem_bytes(problem: Problem, config: KernelConfig, *, warp_specialized: bool = False) -> int:
    """Q and num_stages K tiles (rows of Q/K's head dim) and V tiles (V's), a full and an
    empty mbarrier per stage (and Q's own when ``warp_specialized``), alignment slack."""
    row = problem.head_dim * problem.dtype.itemsize
    v_row = problem.v_head_dim * problem.dtype.itemsize
    return (row * (config.block_m + config.num_stages * config.block_n)
            + v_row * config.num_stages * config.block_n
            + 16 * config.num_stages + (8 if warp_specialized else 0) + ALIGN_SLACK)


def accumulator_registers(problem: Problem, config: KernelConfig) -> int:
    """Per thread: S (block_n / 2 f32), O (V's head dim / 2 f32) and P (block_n / 4 packed),
    with the ``overlap`` knob on or off (its P V of one tile runs beside the next tile's S).
    Q/K's head dim holds none: Q K^T reads both operands from shared memory."""
    return config.block_n // 2 + problem.v_head_dim // 2 + config.block_n // 4


def register_limit(config: KernelConfig, *, warp_specialized: bool = False) -> int:
    """Registers per consumer thread: setmaxnreg's consumer count in the warp-specialised
    kernel; otherwise the register file shared by the block's threads (the kernels declare
    ``__launch_bounds__(threads, 1)``). At most 255."""
    if warp_specialized:
        return min(_MAX_REGS, ws_registers(config)[1])
    share = 65536 // config.threads // _REG_GRANULE * _REG_GRANULE
    return min(_MAX_REGS, share)


def budget_head_dim(problem: Problem) -> int:
    """The head dim whose BUDGETS entry holds for ``problem``: the wider of Q/K's and V's, as
    what ptxas needs beside the accumulators grows with the head dim (Q/K's of
    WIDE_HEAD_DIMS: WIDE_BUDGETS's own entries)."""
    return max(problem.head_dim, problem.v_head_dim)


def accumulator_budget(problem: Problem, config: KernelConfig, *,
                       warp_specialized: bool = False) -> int:
    """Accumulator registers per thread the config's kernel holds without spilling
    (BUDGETS)."""
    loader = (THREADS_COPY if not warp_specialized
              else CP_ASYNC_PRODUCER if cp_async_producer(config) else TMA_PRODUCER)
    budget = BUDGETS[loader, warpgroups(config)][budget_head_dim(problem)]
    if warp_specialized and knob(config, OVERLAP):
        return budget.overlap
    return budget.one_stage if config.num_stages == 1 else budget.more_stages


def static_check(problem: Problem, config: KernelConfig, arch: ArchSpec, *,
                 warp_specialized: bool = False) -> str | None:
    """Why ``config`` cannot run ``problem`` on ``arch``, or None when it may (knobs the
    family does not declare are refused before: ``KernelFamily.static_check``)."""
    if wide(problem):
        if config.block_m not in WIDE_BLOCK_M or config.block_n not in WIDE_BLOCK_N:
            return (f"block_m={config.block_m}, block_n={config.block_n}: at Q/K head dim "
                    f"{problem.head_dim} the sm_90a forward takes block_m in {WIDE_BLOCK_M} "
                    f"and block_n in {WIDE_BLOCK_N} (Q's rows and each K stage fill shared "
                    "memory)")
    elif config.block_m not in BLOCK_M or config.block_n not in BLOCK_N:
        return (f"block_m={config.block_m}, block_n={config.block_n}: the sm_90a forward "
                f"takes block_m in {BLOCK_M} (warpgroups of 64 rows) and block_n a multiple "
                "of 16 in 64..256 (the N of its wgmma)")
    if config.num_warps != warps(config.block_m):
        return (f"num_warps={config.num_warps}: the sm_90a forward runs one warpgroup per 64 "
                f"query rows, {warps(config.block_m)} warps for block_m={config.block_m}")
    if config.num_stages not in NUM_STAGES:
        return f"num_stages={config.num_stages}: expected one of {NUM_STAGES}"
    if budget_head_dim(problem) == 256 and config.num_stages == 1 and not wide(problem):
        # Measured: NVRTC 13 for sm_90a gives these kernels 255 registers and 12 bytes of
        # spills (with two stages the same tile needs 251 and does not spill).
        return ("head_dim 256 with one stage spills registers (255 + 12 bytes of spills with "
                "NVRTC 13 for sm_90a); use two or more stages")
    why = resource_reason(smem_bytes(problem, config, warp_specialized=warp_specialized), 0,
                          arch, 0)
    if why is not None:
        return why
    limit = register_limit(config, warp_specialized=warp_specialized)
    held = accumulator_registers(problem, config)
    budget = accumulator_budget(problem, config, warp_specialized=warp_specialized)
    if held > budget:
        producer = " beside a cp.async producer" if cp_async_producer(config) else ""
        source = (f"setmaxnreg's count for {warpgroups(config)} consumer warpgroups{producer}"
                  if warp_specialized else f"64 Ki registers shared by {config.threads} threads")
        stages = ("one stage" if config.num_stages == 1 else "overlap" if knob(config, OVERLAP)
                  else "two or more stages")
        return (f"accumulators need {held} registers per thread (S, O and P), over the "
                f"{budget} that compile without spills (NVRTC 13) in a consumer thread's "
                f"{limit} registers ({source}) at head dim {problem.head_dim} with {stages}")
    return None


def ws_check(problem: Problem, config: KernelConfig, arch: ArchSpec) -> str | None:
    """``static_check`` of the warp-specialised family, with the rules of its knobs."""
    for param in WS_KNOBS:
        value = knob(config, param.name)
        if value not in param.values:
            return f"{param.name}={value!r}: expected one of {param.values}"
    if knob(config, PINGPONG) and warpgroups(config) != 2:
        return (f"pingpong=1 with block_m={config.block_m}: ping-pong takes turns between "
                "exactly two consumer warpgroups (block_m 128)")
    if knob(config, OVERLAP) and config.num_stages < 2:
        return ("overlap=1 with num_stages=1: the next key tile's K must land in another stage "
                "while this tile's is read; use two or more stages")
    return static_check(problem, config, arch, warp_specialized=True)
