"""Parse SASS listings (nvdisasm or cuobjdump text) and count the instruction mix that
matters for attention kernels.

A listing line looks like ``/*01f0*/  @!P0 LDG.E.128 R4, [R2.64] ;`` optionally followed by
the encoding in a comment; functions start at ``.text.<name>:`` (nvdisasm) or
``Function : <name>`` (cuobjdump); branch targets are labels (``.L_x_3``) or addresses.
Counts are static (instructions in the code, not executions); ``SassFunction.hot_loop``
finds the loop that holds the most tensor-core instructions, whose body is what one
iteration of a kernel's main loop issues.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from flashtune.errors import InvalidInput

#: Categories an instruction is counted under (besides its full opcode).
CATEGORIES: tuple[str, ...] = (
    "mma", "wgmma", "ldsm", "ldgsts", "ldg", "stg", "lds", "sts", "ldl", "stl", "bar",
    "mufu", "fp32", "convert", "shfl", "int", "control", "other",
)
_MMA = {"HMMA", "IMMA", "DMMA", "BMMA"}
_FP32 = {"FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "FSETP", "FSET", "FCHK", "FSWZADD",
         "HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSETP2"}
_CONVERT = {"F2F", "F2FP", "F2I", "I2F", "I2FP", "F2IP", "FRND"}
_INT = {"IADD3", "IMAD", "IMUL", "LOP3", "SHF", "LEA", "ISETP", "SEL", "MOV", "IABS", "IMNMX",
        "POPC", "FLO", "BREV", "PRMT", "LOP", "IADD", "SHL", "SHR", "BMSK", "SGXT", "VIADD",
        "VIMNMX", "P2R", "R2P", "PLOP3", "CS2R", "S2R", "S2UR", "R2UR"}
_CONTROL = {"BRA", "EXIT", "BSSY", "BSYNC", "WARPSYNC", "DEPBAR", "LDGDEPBAR", "CALL", "RET",
            "BREAK", "JMP", "JMX", "BRX", "YIELD", "NANOSLEEP", "BPT", "KILL", "ELECT",
            "VOTE", "VOTEU", "ARRIVES", "SYNCS"}
_MEM_WIDTH = {"ldg", "stg", "lds", "sts", "ldl", "stl", "ldgsts"}
_WIDTH_TOKENS = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "32": 32, "64": 64, "128": 128,
                 "256": 256}
#: Bytes one warp-wide ldmatrix moves, by its matrix count suffix (.1/.2/.4 x 8x8 x 16 bit).
LDSM_BYTES = {"1": 128, "2": 256, "4": 512}
#: FLOPs of one warp-wide HMMA by shape token.
HMMA_FLOPS = {"16816": 2 * 16 * 8 * 16, "1688": 2 * 16 * 8 * 8, "884": 2 * 8 * 8 * 4}

_LINE = re.compile(
    r"^\s*/\*(?P<off>[0-9a-fA-F]{4,})\*/\s+(?P<pred>@!?U?P(?:T|\d+)\s+)?"
    r"(?P<op>[A-Z][A-Z0-9_.]*)(?P<rest>[^;]*);"
)
_NVDISASM_FUNC = re.compile(r"^\s*\.text\.(?P<name>[\w$.]+):\s*$")
_CUOBJDUMP_FUNC = re.compile(r"^\s*Function\s*:\s*(?P<name>[\w$.]+)\s*$")
_LABEL = re.compile(r"^\s*(?P<label>\.L[\w$.]+):\s*$")
_TARGET_DIRECTIVE = re.compile(r"^\s*\.target\s+(?P<arch>sm_\d+[af]?)\b")
_CUOBJDUMP_ARCH = re.compile(r"(?:arch\s*=\s*|code for\s+)(?P<arch>sm_\d+[af]?)")
_REGISTERS = re.compile(r"SHI_REGISTERS=(\d+)")
_BRANCH_LABEL = re.compile(r"`?\(?(?P<label>\.L[\w$.]+)\)?")
_BRANCH_ADDR = re.compile(r"(?:^|[\s(`])(?P<addr>0x[0-9a-fA-F]+)\b")
_BRANCHES = {"BRA", "BRX", "JMP", "CALL"}


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction: byte offset, guard predicate, full opcode and operand text."""

    offset: int
    opcode: str
    operands: str = ""
    predicate: str = ""

    @property
    def base(self) -> str:
        """The opcode without modifiers ('LDG' of 'LDG.E.128.CONSTANT')."""
        return self.opcode.split(".", 1)[0]

    @property
    def modifiers(self) -> tuple[str, ...]:
        return tuple(self.opcode.split(".")[1:])

    @property
    def never_executes(self) -> bool:
        """Guarded by the always-false predicate (``@!PT``), as ptxas pads some sequences."""
        return self.predicate.replace(" ", "") == "@!PT"

    @property
    def category(self) -> str:
        return categorize(self.opcode)

    @property
    def width_bits(self) -> int | None:
        """Access width of a memory instruction (32 when no width modifier), else None."""
        if self.category not in _MEM_WIDTH:
            return None
        widths = [_WIDTH_TOKENS[m] for m in self.modifiers if m in _WIDTH_TOKENS]
        return widths[-1] if widths else 32

    @property
    def mma_flops(self) -> int:
        """FLOPs of a warp-wide HMMA (0 for anything else or an unknown shape)."""
        if self.base != "HMMA":
            return 0
        return next((HMMA_FLOPS[m] for m in self.modifiers if m in HMMA_FLOPS), 0)


def categorize(opcode: str) -> str:
    """The mix category of a SASS opcode (one of CATEGORIES)."""
    base = opcode.split(".", 1)[0]
    if base in _MMA:
        return "mma"
    if base in ("HGMMA", "IGMMA", "QGMMA", "BGMMA"):
        return "wgmma"
    simple = {"LDSM": "ldsm", "LDGSTS": "ldgsts", "LDG": "ldg", "STG": "stg", "LDS": "lds",
              "STS": "sts", "LDL": "ldl", "STL": "stl", "BAR": "bar", "MUFU": "mufu",
              "SHFL": "shfl"}
    if base in simple:
        return simple[base]
    if base in _CONVERT:
        return "convert"
    if base in _FP32:
        return "fp32"
    if base in _INT or base.startswith("U"):
        return "int"
    if base in _CONTROL:
        return "control"
    return "other"


@dataclass(frozen=True)
class InstructionMix:
    """Static counts of a range of instructions (NOPs and never-executed ones excluded)."""

    by_category: Mapping[str, int]
    by_opcode: Mapping[str, int]
    load_widths: Mapping[int, int]   # LDG by access width in bits
    store_widths: Mapping[int, int]  # STG by access width in bits
    mma_flops: int                   # sum of warp-wide HMMA FLOPs
    ldsm_bytes: int                  # sum of warp-wide ldmatrix bytes

    @classmethod
    def of(cls, instructions: Iterable[Instruction]) -> InstructionMix:
        cats: Counter[str] = Counter()
        ops: Counter[str] = Counter()
        loads: Counter[int] = Counter()
        stores: Counter[int] = Counter()
        flops = 0
        ldsm_bytes = 0
        for ins in instructions:
            if ins.base == "NOP" or ins.never_executes:
                continue
            cat = ins.category
            cats[cat] += 1
            ops[ins.opcode] += 1
            flops += ins.mma_flops
            if cat == "ldsm":
                ldsm_bytes += next((LDSM_BYTES[m] for m in reversed(ins.modifiers)
                                    if m in LDSM_BYTES), 512)
            elif cat == "ldg":
                loads[ins.width_bits or 32] += 1
            elif cat == "stg":
                stores[ins.width_bits or 32] += 1
        return cls({c: cats.get(c, 0) for c in CATEGORIES}, dict(sorted(ops.items())),
                   dict(sorted(loads.items())), dict(sorted(stores.items())), flops, ldsm_bytes)

    def __getitem__(self, category: str) -> int:
        if category not in self.by_category:
            raise KeyError(f"unknown category {category!r}; expected one of {CATEGORIES}")
        return self.by_category[category]

    @property
    def total(self) -> int:
        return sum(self.by_category.values())

    @property
    def local_memory(self) -> int:
        """LDL + STL: register spills or dynamically indexed per-thread arrays."""
        return self["ldl"] + self["stl"]

    @property
    def wide_load_share(self) -> float:
        """Share of global loads that are 128-bit (1.0 when there are none)."""
        n = sum(self.load_widths.values())
        return self.load_widths.get(128, 0) / n if n else 1.0

    def to_dict(self) -> dict[str, object]:
        return {
            "total": self.total,
            "by_category": dict(self.by_category),
            "global_load_widths": {str(k): v for k, v in self.load_widths.items()},
            "global_store_widths": {str(k): v for k, v in self.store_widths.items()},
            "mma_flops": self.mma_flops,
            "ldsm_bytes": self.ldsm_bytes,
            "mufu_ops": {op: n for op, n in self.by_opcode.items() if op.startswith("MUFU")},
            "mma_ops": {op: n for op, n in self.by_opcode.items()
                        if categorize(op) in ("mma", "wgmma")},
        }


@dataclass(frozen=True)
class Loop:
    """A natural loop found from a backward branch: offsets [start, end] inclusive."""

    start: int
    end: int


@dataclass(frozen=True)
class SassFunction:
    """One kernel's instructions in address order, its labels and register count."""

    name: str
    instructions: tuple[Instruction, ...]
    labels: Mapping[str, int] = field(default_factory=dict)
    registers: int | None = None

    def mix(self, loop: Loop | None = None) -> InstructionMix:
        """The mix of the whole function, or of one loop's body."""
        if loop is None:
            return InstructionMix.of(self.instructions)
        return InstructionMix.of(i for i in self.instructions
                                 if loop.start <= i.offset <= loop.end)

    def branch_target(self, ins: Instruction) -> int | None:
        """Byte offset a branch jumps to, or None (not a branch / indirect)."""
        if ins.base not in _BRANCHES:
            return None
        if (m := _BRANCH_LABEL.search(ins.operands)) is not None:
            return self.labels.get(m.group("label"))
        if (a := _BRANCH_ADDR.search(ins.operands)) is not None:
            return int(a.group("addr"), 16)
        return None

    def loops(self) -> tuple[Loop, ...]:
        """Every backward branch's loop (a self-branch, as ptxas emits after EXIT, is not
        one), outermost first."""
        found = set()
        for ins in self.instructions:
            target = self.branch_target(ins)
            if target is not None and target < ins.offset:
                found.add(Loop(target, ins.offset))
        return tuple(sorted(found, key=lambda lp: (lp.start, -lp.end)))

    def hot_loop(self) -> Loop | None:
        """The innermost loop holding the most MMA FLOPs (the main loop of a tensor-core
        kernel); without MMAs, the loop with the most instructions; None without loops."""
        loops = self.loops()
        if not loops:
            return None

        def score(lp: Loop) -> tuple[int, int, int]:
            mix = self.mix(lp)
            return (mix.mma_flops, mix.total if mix.mma_flops == 0 else 0,
                    -(lp.end - lp.start))

        return max(loops, key=score)


@dataclass(frozen=True)
class SassListing:
    """A parsed listing: target arch (when the text names it) and functions by name."""

    arch: str | None
    functions: Mapping[str, SassFunction]

    def function(self, name: str | None = None) -> SassFunction:
        """The function ``name``, or the only one when ``name`` is None."""
        if name is None:
            if len(self.functions) != 1:
                raise InvalidInput(f"the listing has {len(self.functions)} functions "
                                   f"({sorted(self.functions)}); name the one wanted")
            return next(iter(self.functions.values()))
        try:
            return self.functions[name]
        except KeyError:
            raise InvalidInput(f"function {name!r} is not in the listing; it has "
                               f"{sorted(self.functions)}") from None


def parse_sass(text: str) -> SassListing:
    """Parse nvdisasm or cuobjdump SASS text. Raises InvalidInput when it holds no
    instruction at all (not a SASS listing)."""
    arch: str | None = None
    funcs: dict[str, SassFunction] = {}
    name: str | None = None
    ins: list[Instruction] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    registers: int | None = None
    pending_registers: int | None = None

    def close() -> None:
        if name is not None:
            for label in pending:  # labels at the very end point past the last instruction
                labels[label] = (ins[-1].offset + 16) if ins else 0
            funcs[name] = SassFunction(name, tuple(ins), dict(labels), registers)

    for raw in text.splitlines():
        if arch is None and (m := _TARGET_DIRECTIVE.match(raw) or
                             _CUOBJDUMP_ARCH.search(raw)) is not None:
            arch = m.group("arch")
        if (m := _REGISTERS.search(raw)) is not None:
            pending_registers = int(m.group(1))
        start = _NVDISASM_FUNC.match(raw) or _CUOBJDUMP_FUNC.match(raw)
        if start is not None:
            close()
            name, ins, labels, pending = start.group("name"), [], {}, []
            registers, pending_registers = pending_registers, None
            continue
        if name is None:
            continue
        if (m := _LABEL.match(raw)) is not None:
            pending.append(m.group("label"))
            continue
        if (m := _LINE.match(raw)) is not None:
            offset = int(m.group("off"), 16)
            for label in pending:
                labels[label] = offset
            pending = []
            ins.append(Instruction(offset, m.group("op"), m.group("rest").strip(),
                                   (m.group("pred") or "").strip()))
    close()
    if not any(f.instructions for f in funcs.values()):
        raise InvalidInput("no SASS instruction found; expected nvdisasm or cuobjdump -sass "
                           "output (lines like '/*0000*/  MOV R1, c[0x0][0x28] ;')")
    return SassListing(arch, funcs)
