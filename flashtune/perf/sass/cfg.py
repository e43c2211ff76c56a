"""The control-flow graph of a SASS function and its back edges (the loops).

A backward branch is a loop only when its target dominates it (every path from the entry
to the branch passes the target). ptxas places the retry of an ``mbarrier.try_wait``
(``SYNCS.PHASECHK.TRANS64.TRYWAIT``) out of line after the function's EXIT: a forward
branch into a stub that ends with a jump back to the wait. That jump is backward but not a
loop, and counting it would make one "loop" of most of the kernel; its target does not
dominate it, so it is not a back edge here.

A branch with a condition operand is conditional without a predicate guard: ``BRA.DIV UR7,
target`` (taken only when the warp has diverged, into an out-of-line shuffle that jumps
back) and ``BRA P4, target`` fall through. Taking them as unconditional would leave the
code after them unreachable from the loop's head, so that the head no longer dominated the
loop's own back edge (the MLA decoding kernel's tile loop was lost that way).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


class Instruction(Protocol):
    """What the graph reads of an instruction (perf.sass.parse.Instruction has it)."""

    @property
    def offset(self) -> int: ...
    @property
    def base(self) -> str: ...
    @property
    def predicate(self) -> str: ...
    @property
    def operands(self) -> str: ...


Ins = TypeVar("Ins", bound=Instruction)

#: Opcodes (base) after which control does not fall through when unpredicated.
_NO_FALLTHROUGH = {"BRA", "EXIT", "RET", "JMP", "KILL"}
#: Opcodes that end a basic block.
_BLOCK_END = {"BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "CALL", "KILL"}


@dataclass(frozen=True)
class BackEdge:
    """A branch at ``source`` (byte offset) back to ``target``, which dominates it."""

    source: int
    target: int


def _unconditional(ins: Instruction) -> bool:
    """No predicate guard and, for a branch, no condition operand before its target."""
    guarded = ins.predicate.replace(" ", "") not in ("", "@PT")
    return not guarded and not (ins.base == "BRA" and "," in ins.operands)


def back_edges(instructions: Sequence[Ins],
               branch_target: Callable[[Ins], int | None]) -> list[BackEdge]:
    """Every branch whose target is at or before it and dominates it.

    Blocks no edge reaches (a subroutine entered by CALL) are roots of their own, so loops
    inside them are found too.
    """
    if not instructions:
        return []
    index = {ins.offset: i for i, ins in enumerate(instructions)}
    leaders = {0}
    for i, ins in enumerate(instructions):
        target = branch_target(ins)
        if target is not None and target in index:
            leaders.add(index[target])
        if ins.base in _BLOCK_END and i + 1 < len(instructions):
            leaders.add(i + 1)
    starts = sorted(leaders)
    lasts = [nxt - 1 for nxt in starts[1:]] + [len(instructions) - 1]
    block_of = {}
    for b, (start, last) in enumerate(zip(starts, lasts, strict=True)):
        for i in range(start, last + 1):
            block_of[i] = b
    succ: list[set[int]] = [set() for _ in starts]
    for b, last in enumerate(lasts):
        ins = instructions[last]
        target = branch_target(ins)
        if target is not None and target in index:
            succ[b].add(block_of[index[target]])
        falls = not (ins.base in _NO_FALLTHROUGH and _unconditional(ins))
        if falls and last + 1 < len(instructions):
            succ[b].add(b + 1)
    dom = _dominators(succ)
    out = []
    for b, last in enumerate(lasts):
        ins = instructions[last]
        target = branch_target(ins)
        if target is None or target not in index or target > ins.offset:
            continue
        if dom[b] >> block_of[index[target]] & 1:
            out.append(BackEdge(ins.offset, target))
    return out


def _dominators(succ: list[set[int]]) -> list[int]:
    """Dominator sets (bit b set: block b dominates) of every block; blocks without a
    predecessor are roots."""
    n = len(succ)
    preds: list[list[int]] = [[] for _ in range(n)]
    for b, targets in enumerate(succ):
        for t in targets:
            preds[t].append(b)
    everything = (1 << n) - 1
    dom = [(1 << b) if not preds[b] or b == 0 else everything for b in range(n)]
    changed = True
    while changed:
        changed = False
        for b in range(n):
            if b == 0 or not preds[b]:
                continue
            meet = everything
            for p in preds[b]:
                meet &= dom[p]
            new = meet | (1 << b)
            if new != dom[b]:
                dom[b] = new
                changed = True
    return dom
