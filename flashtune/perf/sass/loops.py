"""The main loops of a compiled attention kernel, found in its SASS, and what one iteration
of each costs.

How the loops are found (the contract the forward kernel's structure is written to):

- A loop is a backward branch (``SassFunction.loops``). The *main* loops are the innermost
  loops among those with tensor-core work whose body holds the most tensor-core FLOPs: one
  iteration is one K/V tile. A loop of loads inside it (as the sm_90a cp.async kernel has)
  does not make it an outer loop, nor does a tensor-core loop without an exponential
  (``MUFU.EX2``) inside one with it: that is a step over the head dim within the tile's
  softmax loop (the MLA decoding kernel's 576-wide scores), not a tile loop.
- A main loop that writes the constant ``-INF`` (an ``FSEL ..., -INF, P`` that hides a
  score) applies a mask: it is the *masked* loop. The main loop without one is the
  *unmasked* loop. The forward kernel walks its masked tiles first in one loop (or as
  straight-line steps, then there is no masked loop) and its unmasked tiles in another,
  with no mask code and no -inf guard; a kernel that masks inside its only loop has a
  masked loop and no unmasked one.
- Inside a loop, a conditional forward branch whose predicate comes from a warp vote
  (``VOTE``) skips the block that rescales O when no row maximum of the warp changed. The
  instructions executed per iteration then range from the static count less those blocks
  to the static count.

Local memory: an ``LDL`` whose register an MMA reads before anything rewrites it, or an
``STL`` of a register an MMA last wrote, sits in a tensor-core chain (the MMA waits on
local memory). Other local accesses in a loop only take issue slots.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

from flashtune.perf.sass.parse import Instruction, InstructionMix, Loop, SassFunction, wgmma_shape


class LoopKind(str, Enum):
    MASKED = "masked"
    UNMASKED = "unmasked"


_REG = re.compile(r"(?<![\w.])R(\d+)\b")
_PRED = re.compile(r"@(!?)(U?P\d+)")
_MASK_CONSTANT = re.compile(r"(?<![\w.])-INF\b")
_PREDICATE_WRITERS = {"VOTE", "VOTEU", "ISETP", "FSETP", "DSETP", "HSETP2", "PLOP3", "R2P",
                      "UISETP"}


@dataclass(frozen=True)
class SkippedBlock:
    """Instructions [start, end] a vote-guarded forward branch of the loop jumps over."""

    start: int
    end: int
    mix: InstructionMix


@dataclass(frozen=True)
class LocalMemoryUse:
    """LDL / STL of one loop iteration and how many of them sit in a tensor-core chain."""

    loads: int
    stores: int
    in_mma_chain: int

    @property
    def accesses(self) -> int:
        return self.loads + self.stores

    def to_dict(self) -> dict[str, int]:
        return {"loads": self.loads, "stores": self.stores, "in_mma_chain": self.in_mma_chain}


@dataclass(frozen=True)
class MainLoop:
    """One main loop: its kind, range, static mix per iteration (per warp), the blocks a
    warp vote can skip, and its local-memory accesses."""

    kind: LoopKind
    loop: Loop
    mix: InstructionMix
    skipped: tuple[SkippedBlock, ...]
    local: LocalMemoryUse

    @property
    def static(self) -> int:
        """Static instructions per iteration (what the listing holds)."""
        return self.mix.total

    @property
    def executed_min(self) -> int:
        """Instructions an iteration executes when every vote-guarded block is skipped."""
        return self.mix.total - sum(b.mix.total for b in self.skipped)

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind.value,
            "start": self.loop.start,
            "end": self.loop.end,
            "static": self.static,
            "executed_min": self.executed_min,
            "skipped_blocks": [{"start": b.start, "end": b.end, "instructions": b.mix.total}
                               for b in self.skipped],
            "local_memory": self.local.to_dict(),
            **self.mix.to_dict(),
        }


@dataclass(frozen=True)
class MainLoops:
    """The masked and unmasked main loops of a kernel (either may be absent)."""

    masked: MainLoop | None
    unmasked: MainLoop | None

    @property
    def primary(self) -> MainLoop | None:
        """The unmasked loop, else the masked one: where most tiles of a long sequence run,
        and the loop a kernel's per-iteration statistics are read over."""
        return self.unmasked or self.masked

    def __iter__(self) -> Iterator[MainLoop]:
        return iter([lp for lp in (self.masked, self.unmasked) if lp is not None])

    def to_dict(self) -> dict[str, object]:
        return {"masked": None if self.masked is None else self.masked.to_dict(),
                "unmasked": None if self.unmasked is None else self.unmasked.to_dict()}


def _body(fn: SassFunction, loop: Loop) -> list[Instruction]:
    return [i for i in fn.instructions if loop.start <= i.offset <= loop.end]


def _innermost(loops: tuple[Loop, ...]) -> list[Loop]:
    return [lp for lp in loops if not any(lp.encloses(o) for o in loops)]


def _is_masked(body: list[Instruction]) -> bool:
    return any(_MASK_CONSTANT.search(i.operands) for i in body if not i.never_executes)


def _predicate_source(body: list[Instruction], index: int, pred: str) -> Instruction | None:
    """The last instruction before body[index] that writes predicate `pred`."""
    for ins in reversed(body[:index]):
        dests = ins.operands.split(",")
        if ins.base in _PREDICATE_WRITERS and dests and dests[0].strip() == pred:
            return ins
    return None


def _skipped_blocks(fn: SassFunction, loop: Loop, body: list[Instruction]
                    ) -> tuple[SkippedBlock, ...]:
    out = []
    for index, ins in enumerate(body):
        target = fn.branch_target(ins)
        if ins.base != "BRA" or target is None or not (ins.offset < target <= loop.end):
            continue
        m = _PRED.search(ins.predicate)
        if m is None:
            continue
        source = _predicate_source(body, index, m.group(2))
        if source is None or not source.base.startswith("VOTE"):
            continue
        inside = [i for i in body if ins.offset < i.offset < target]
        if inside:
            out.append(SkippedBlock(inside[0].offset, inside[-1].offset,
                                    InstructionMix.of(inside)))
    return tuple(out)


def _regs(token: str, width: int) -> set[int]:
    m = _REG.search(token)
    if m is None:
        return set()
    base = int(m.group(1))
    return set(range(base, base + width))


def _wgmma_operands(ins: Instruction) -> tuple[set[int], set[int]]:
    """(registers a wgmma reads, registers it writes): ``D, [A,] desc-B, C`` with an f32
    accumulator of N/2 registers per thread (N/4 for f16) and, when A comes from registers,
    its 4 registers (HGMMA.64x128x16.F32 R24, R88, gdesc[UR12].tnspB, R24)."""
    shape = wgmma_shape(ins.opcode)
    if shape is None:
        return set(), set()
    n = int(shape.split("x")[1])
    acc = n // 2 if "F32" in ins.modifiers else n // 4
    parts = [p.strip() for p in ins.operands.split(",")]
    if not parts:
        return set(), set()
    reads = set()
    if len(parts) >= 2 and not parts[1].startswith("gdesc"):
        reads |= _regs(parts[1], 4)
    if len(parts) >= 3 and not parts[2].startswith("gdesc"):
        reads |= _regs(parts[2], acc)
    elif len(parts) >= 4:
        reads |= _regs(parts[3], acc)
    return reads, _regs(parts[0], acc)


def _mma_operands(ins: Instruction) -> tuple[set[int], set[int]]:
    """(registers an MMA reads, registers it writes)."""
    if ins.category == "wgmma":
        return _wgmma_operands(ins)
    mods = ins.modifiers
    small = "1688" in mods or "884" in mods
    acc = 2 if "F16" in mods[1:2] else 4
    widths = (acc, 2 if small else 4, 1 if small else 2, acc)
    parts = [p.strip() for p in ins.operands.split(",")]
    if len(parts) < 4:
        return set(), set()
    reads = _regs(parts[1], widths[1]) | _regs(parts[2], widths[2]) | _regs(parts[3], widths[3])
    return reads, _regs(parts[0], widths[0])


def _width(ins: Instruction) -> int:
    bits = ins.width_bits or 32
    return max(1, bits // 32)


_NO_REGISTER_DEST = {"STS", "STG", "STL", "ST", "LDGSTS", "BAR", "BRA", "EXIT", "DEPBAR",
                     "LDGDEPBAR", "BSSY", "BSYNC", "WARPSYNC", "CALL", "RET", "RED", "ATOMS"}


def _written(ins: Instruction, parts: list[str]) -> set[int]:
    """The general registers a non-MMA instruction writes (as far as its text says)."""
    if ins.base in _NO_REGISTER_DEST or not parts:
        return set()
    dest = parts[0]
    if re.fullmatch(r"!?U?P(\d+|T)", dest) and ins.base == "SHFL" and len(parts) > 1:
        dest = parts[1]  # SHFL writes a predicate, then the register
    if ins.base == "LDSM":
        count = next((int(m) for m in reversed(ins.modifiers) if m in ("1", "2", "4")), 4)
        return _regs(dest, count)
    if ins.category in ("lds", "ldg", "ldl"):
        return _regs(dest, _width(ins))
    wide = "WIDE" in ins.modifiers or "64" in ins.modifiers
    return _regs(dest, 2 if wide else 1)


def _local_memory(body: list[Instruction]) -> LocalMemoryUse:
    loads = stores = in_chain = 0
    last_writer: dict[int, str] = {}  # register -> "mma" / "other"
    pending: dict[int, int] = {}      # register -> index of the LDL that loaded it
    chained_loads: set[int] = set()
    for index, ins in enumerate(body):
        if ins.never_executes or ins.base == "NOP":
            continue
        parts = [p.strip() for p in ins.operands.split(",")]
        if ins.base == "LDL":
            loads += 1
            for r in _regs(parts[0], _width(ins)):
                pending[r] = index
                last_writer[r] = "other"
            continue
        if ins.base == "STL":
            stores += 1
            src = parts[-1] if parts else ""
            if any(last_writer.get(r) == "mma" for r in _regs(src, _width(ins))):
                in_chain += 1
            continue
        if ins.category in ("mma", "wgmma"):
            reads, writes = _mma_operands(ins)
            for r in reads:
                if r in pending:
                    chained_loads.add(pending.pop(r))
            for r in writes:
                last_writer[r] = "mma"
                pending.pop(r, None)
            continue
        for r in _written(ins, parts):
            last_writer[r] = "other"
            pending.pop(r, None)
    return LocalMemoryUse(loads, stores, in_chain + len(chained_loads))


def nested_loops(fn: SassFunction, loop: Loop) -> tuple[Loop, ...]:
    """The loops strictly inside ``loop`` (e.g. copy loops ptxas kept rolled inside a main
    loop: a static count takes their bodies once, whatever their trip count)."""
    return tuple(lp for lp in fn.loops() if loop.encloses(lp))


def main_loop(fn: SassFunction, loops: MainLoops | None = None) -> Loop | None:
    """The one loop a kernel's per-iteration statistics are read over: the primary main
    loop (``MainLoops.primary``; ``loops`` when already found) of a kernel with tensor-core
    loops; in a kernel without tensor-core work, its loop with the most instructions (the
    smallest on ties); None without loops."""
    found = main_loops(fn) if loops is None else loops
    if found.primary is not None:
        return found.primary.loop
    every = fn.loops()
    if not every:
        return None
    return max(every, key=lambda lp: (fn.mix(lp).total, -(lp.end - lp.start)))


def main_loops(fn: SassFunction) -> MainLoops:
    """The masked and unmasked main loops of ``fn`` (see the module docstring)."""
    tensor_loops = tuple(lp for lp in fn.loops() if fn.mix(lp).mma_flops > 0)
    softmax = {lp for lp in tensor_loops if any(i.base == "MUFU" and "EX2" in i.modifiers
                                                 for i in _body(fn, lp))}
    steps = {lp for lp in tensor_loops
             if lp not in softmax and any(o.encloses(lp) for o in softmax)}
    candidates = _innermost(tuple(lp for lp in tensor_loops if lp not in steps))
    if not candidates:
        return MainLoops(None, None)
    best = max(fn.mix(lp).mma_flops for lp in candidates)
    found: dict[LoopKind, MainLoop] = {}
    for lp in sorted(candidates, key=lambda x: x.start):
        mix = fn.mix(lp)
        if mix.mma_flops != best:
            continue
        body = _body(fn, lp)
        kind = LoopKind.MASKED if _is_masked(body) else LoopKind.UNMASKED
        if kind in found:
            continue  # a second loop of the same kind: keep the first
        found[kind] = MainLoop(kind, lp, mix, _skipped_blocks(fn, lp, body),
                               _local_memory(body))
    return MainLoops(found.get(LoopKind.MASKED), found.get(LoopKind.UNMASKED))


#: The spill rule of the default configs (``perf.model.default_rule.spill_rule_problems``):
#: at most this many local-memory accesses per iteration of each main loop, none of them in
#: a tensor-core chain. FlashAttention-2's own
#: d128 128 x 64 tile issues 12 per tile with CUDA 13 (reference/fa2-sass-facts.md); a few
#: outside the chains only take issue slots, about 8 is the aim.
MAX_LOCAL_ACCESSES = 8

