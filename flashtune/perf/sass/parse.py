"""Parse SASS listings (nvdisasm or cuobjdump text) and count the instruction mix that
matters for attention kernels.

A listing line looks like ``/*01f0*/  @!P0 LDG.E.128 R4, [R2.64] ;`` optionally followed by
the encoding in a comment; functions start at ``.text.<name>:`` (nvdisasm) or
``Function : <name>`` (cuobjdump); branch targets are labels (``.L_x_3``) or addresses.
Counts are static (instructions in the code, not executions); ``SassFunction.loops`` finds
the loops (back edges, cfg.py), and loops.py which of them are the kernel's main loops.

sm_90a kernels (NVRTC 13, read from the compiled families' listings) add their own classes:
``HGMMA.64x128x16.F32`` (wgmma; the shape is part of the opcode), ``WARPGROUP.ARRIVE`` /
``WARPGROUP.DEPBAR.LE`` (wgmma.fence / wgmma.wait_group), ``SYNCS.EXCH.64`` /
``SYNCS.ARRIVE.TRANS64`` / ``SYNCS.PHASECHK.TRANS64.TRYWAIT`` and
``ARRIVES.LDGSTSBAR.64.ARVCNT`` (mbarrier init / arrive / try_wait and
cp.async.mbarrier.arrive), ``UTMALDG.5D`` / ``UTMACCTL.PF`` (TMA load, tensor-map prefetch),
``USETMAXREG`` (setmaxnreg), ``FENCE.VIEW.ASYNC.S`` / ``MEMBAR`` (proxy and memory fences),
and named barriers (``BAR.SYNC R3, 0x100`` / ``BAR.ARV``: a barrier id other than 0 or a
thread count) apart from the CTA-wide ``BAR.SYNC 0x0``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from flashtune.errors import InvalidInput
from flashtune.perf.sass.cfg import back_edges

#: Categories an instruction is counted under (besides its full opcode).
CATEGORIES: tuple[str, ...] = (
    "mma", "wgmma", "wgsync", "ldsm", "ldgsts", "tma", "mbarrier", "ldg", "stg", "lds", "sts",
    "ldl", "stl", "bar", "namedbar", "fence", "regalloc", "mufu", "fp32", "convert", "shfl",
    "int", "control", "other",
)
#: Categories whose instructions run on a pipe the cost model charges by throughput; every
#: other category takes one issue slot per instruction (``InstructionMix.issue_only``).
PIPE_CATEGORIES: frozenset[str] = frozenset(
    {"mma", "wgmma", "mufu", "fp32", "convert", "shfl", "ldl", "stl"})
#: QMMA: Ada's FP8 mma.sync (sm_89; sm_90's ptxas lowers FP8 mma.sync to HMMA.16816 pairs).
_MMA = {"HMMA", "QMMA", "IMMA", "DMMA", "BMMA"}
_FP32 = {"FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "FSETP", "FSET", "FCHK", "FSWZADD",
         "HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSETP2"}
_CONVERT = {"F2F", "F2FP", "F2I", "I2F", "I2FP", "F2IP", "FRND"}
_INT = {"IADD3", "IMAD", "IMUL", "LOP3", "SHF", "LEA", "ISETP", "SEL", "MOV", "IABS", "IMNMX",
        "POPC", "FLO", "BREV", "PRMT", "LOP", "IADD", "SHL", "SHR", "BMSK", "SGXT", "VIADD",
        "VIMNMX", "P2R", "R2P", "PLOP3", "CS2R", "S2R", "S2UR", "R2UR"}
_CONTROL = {"BRA", "EXIT", "BSSY", "BSYNC", "WARPSYNC", "DEPBAR", "LDGDEPBAR", "CALL", "RET",
            "BREAK", "JMP", "JMX", "BRX", "YIELD", "NANOSLEEP", "BPT", "KILL", "ELECT",
            "VOTE", "VOTEU"}
#: Hopper's own instructions by base opcode (checked before the uniform-datapath "U*" rule,
#: as UTMALDG and USETMAXREG are not integer work).
_HOPPER = {"WARPGROUP": "wgsync", "SYNCS": "mbarrier", "ARRIVES": "mbarrier",
           "UTMALDG": "tma", "UTMASTG": "tma", "UTMACCTL": "tma", "UTMAPF": "tma",
           "UTMAREDG": "tma", "UBLKCP": "tma", "UBLKRED": "tma", "UBLKPF": "tma",
           "FENCE": "fence", "MEMBAR": "fence", "ERRBAR": "fence", "CCTL": "fence",
           "USETMAXREG": "regalloc"}
_WGMMA = {"HGMMA", "IGMMA", "QGMMA", "BGMMA"}
_MEM_WIDTH = {"ldg", "stg", "lds", "sts", "ldl", "stl", "ldgsts"}
_WIDTH_TOKENS = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "32": 32, "64": 64, "128": 128,
                 "256": 256}
#: Bytes one warp-wide ldmatrix moves, by its matrix count suffix (.1/.2/.4 x 8x8 x 16 bit).
LDSM_BYTES = {"1": 128, "2": 256, "4": 512}
#: FLOPs of one warp-wide HMMA (or FP8 QMMA: 16832) by shape token.
HMMA_FLOPS = {"16816": 2 * 16 * 8 * 16, "1688": 2 * 16 * 8 * 8, "884": 2 * 8 * 8 * 4,
              "16832": 2 * 16 * 8 * 32}
#: Warps of the warpgroup that issues one wgmma (each computes 16 of its 64 rows).
WARPGROUP_WARPS = 4
_GMMA_SHAPE = re.compile(r"(\d+)x(\d+)x(\d+)")
_BAR_ID = re.compile(r"^\s*(?P<id>0x[0-9a-fA-F]+|\d+)\s*$")


def wgmma_shape(opcode: str) -> str | None:
    """The ``MxNxK`` token of a wgmma opcode ('64x128x16'), else None."""
    if opcode.split(".", 1)[0] not in _WGMMA:
        return None
    return next((t for t in opcode.split(".")[1:] if _GMMA_SHAPE.fullmatch(t)), None)


def wgmma_flops(opcode: str) -> int:
    """FLOPs one warpgroup-wide wgmma computes (2*M*N*K of its ``MxNxK`` shape token, e.g.
    HGMMA.64x128x16.F32: 262144); 0 for anything else or a shape the opcode does not name."""
    shape = wgmma_shape(opcode)
    if shape is None:
        return 0
    m, n, k = (int(x) for x in shape.split("x"))
    return 2 * m * n * k

_LINE = re.compile(
    r"^\s*/\*(?P<off>[0-9a-fA-F]{4,})\*/\s+(?P<pred>@!?U?P(?:T|\d+)\s+)?"
    r"(?P<op>[A-Z][A-Za-z0-9_.]*)(?P<rest>[^;]*);"
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
        """The opcode's category; a BAR naming a barrier other than 0 or a thread count
        (``bar.sync id, n`` / ``bar.arrive``) is a named barrier ("namedbar")."""
        cat = categorize(self.opcode)
        if cat == "bar" and self.is_named_barrier:
            return "namedbar"
        return cat

    @property
    def is_named_barrier(self) -> bool:
        """A BAR on a barrier other than 0, with a thread count, or an arrive (never the
        CTA-wide ``BAR.SYNC 0x0`` of __syncthreads)."""
        if self.base != "BAR":
            return False
        if "ARV" in self.modifiers:  # bar.arrive always names a thread count
            return True
        parts = [p for p in self.operands.split(",") if p.strip()]
        if not parts:
            return False
        if len(parts) > 1:  # an id and a thread count
            return True
        m = _BAR_ID.match(parts[0])
        return m is None or int(m["id"], 0) != 0

    @property
    def width_bits(self) -> int | None:
        """Access width of a memory instruction (32 when no width modifier), else None."""
        if self.category not in _MEM_WIDTH:
            return None
        widths = [_WIDTH_TOKENS[m] for m in self.modifiers if m in _WIDTH_TOKENS]
        return widths[-1] if widths else 32

    @property
    def mma_flops(self) -> int:
        """Tensor FLOPs this warp computes: a warp-wide HMMA's, or its quarter of a
        warpgroup-wide wgmma's (``tensor_flops``); 0 for anything else or an unknown shape."""
        if self.base in _WGMMA:
            return self.tensor_flops // WARPGROUP_WARPS
        return self.tensor_flops

    @property
    def tensor_flops(self) -> int:
        """FLOPs of the whole instruction: warp-wide for HMMA and QMMA, warpgroup-wide for
        a wgmma."""
        if self.base in ("HMMA", "QMMA"):
            return next((HMMA_FLOPS[m] for m in self.modifiers if m in HMMA_FLOPS), 0)
        return wgmma_flops(self.opcode)


def categorize(opcode: str) -> str:
    """The mix category of a SASS opcode (one of CATEGORIES)."""
    base = opcode.split(".", 1)[0]
    if base in _MMA:
        return "mma"
    if base in _WGMMA:
        return "wgmma"
    if base in _HOPPER:
        return _HOPPER[base]
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


#: Categories of the synchronisation and asynchronous-copy machinery (listed by opcode).
SYNC_CATEGORIES: tuple[str, ...] = ("wgsync", "mbarrier", "tma", "bar", "namedbar", "fence",
                                    "regalloc")


@dataclass(frozen=True)
class InstructionMix:
    """Static counts of a range of instructions (NOPs and never-executed ones excluded)."""

    by_category: Mapping[str, int]
    by_opcode: Mapping[str, int]
    load_widths: Mapping[int, int]   # LDG by access width in bits
    store_widths: Mapping[int, int]  # STG by access width in bits
    #: Tensor FLOPs one warp computes: warp-wide HMMAs plus its quarter of each wgmma.
    mma_flops: int
    ldsm_bytes: int                  # sum of warp-wide ldmatrix bytes
    wgmma_flops: int = 0             # the part of mma_flops issued as wgmma (HGMMA)

    @classmethod
    def of(cls, instructions: Iterable[Instruction]) -> InstructionMix:
        cats: Counter[str] = Counter()
        ops: Counter[str] = Counter()
        loads: Counter[int] = Counter()
        stores: Counter[int] = Counter()
        flops = wg_flops = 0
        ldsm_bytes = 0
        for ins in instructions:
            if ins.base == "NOP" or ins.never_executes:
                continue
            cat = ins.category
            cats[cat] += 1
            ops[ins.opcode] += 1
            flops += ins.mma_flops
            if cat == "wgmma":
                wg_flops += ins.mma_flops
            if cat == "ldsm":
                ldsm_bytes += next((LDSM_BYTES[m] for m in reversed(ins.modifiers)
                                    if m in LDSM_BYTES), 512)
            elif cat == "ldg":
                loads[ins.width_bits or 32] += 1
            elif cat == "stg":
                stores[ins.width_bits or 32] += 1
        return cls({c: cats.get(c, 0) for c in CATEGORIES}, dict(sorted(ops.items())),
                   dict(sorted(loads.items())), dict(sorted(stores.items())), flops, ldsm_bytes,
                   wg_flops)

    def __getitem__(self, category: str) -> int:
        if category not in self.by_category:
            raise KeyError(f"unknown category {category!r}; expected one of {CATEGORIES}")
        return self.by_category[category]

    @property
    def total(self) -> int:
        return sum(self.by_category.values())

    @property
    def issue_only(self) -> int:
        """Instructions that cost one issue slot each (every category outside
        PIPE_CATEGORIES), plus the wgmmas: their tensor time is charged by FLOPs."""
        return self["wgmma"] + sum(n for c, n in self.by_category.items()
                                   if c not in PIPE_CATEGORIES)

    def tensor_ops(self) -> list[TensorOp]:
        """The tensor-core opcodes with their counts and FLOPs per instruction."""
        out = []
        for op, n in self.by_opcode.items():
            cat = categorize(op)
            if cat not in ("mma", "wgmma"):
                continue
            flops = Instruction(0, op).tensor_flops
            out.append(TensorOp(op, n, flops, "warpgroup" if cat == "wgmma" else "warp"))
        return out

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
            "wgmma_flops": self.wgmma_flops,
            "tensor_ops": [t.to_dict() for t in self.tensor_ops()],
            "sync_ops": {op: n for op, n in self.by_opcode.items()
                         if categorize(op) in SYNC_CATEGORIES},
        }


@dataclass(frozen=True)
class TensorOp:
    """One tensor-core opcode of a mix: its count and what one instruction computes, over
    a warp (HMMA) or a warpgroup of 4 warps (wgmma)."""

    opcode: str
    count: int
    flops_per_instruction: int
    scope: str  # "warp" or "warpgroup"

    @property
    def shape(self) -> str | None:
        return wgmma_shape(self.opcode)

    def to_dict(self) -> dict[str, object]:
        return {"opcode": self.opcode, "count": self.count, "shape": self.shape,
                "flops_per_instruction": self.flops_per_instruction, "scope": self.scope}


@dataclass(frozen=True)
class Loop:
    """A natural loop found from a backward branch: offsets [start, end] inclusive."""

    start: int
    end: int

    def encloses(self, other: Loop) -> bool:
        """``other`` is another loop within this one's range (nested in it)."""
        return other != self and self.start <= other.start and other.end <= self.end


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
        """Every back edge's loop: a backward branch whose target dominates it (perf.sass.cfg; a
        self-branch, as ptxas emits after EXIT, is not one, nor the jump back from an
        out-of-line mbarrier retry), outermost first."""
        found = {Loop(edge.target, edge.source)
                 for edge in back_edges(self.instructions, self.branch_target)
                 if edge.target < edge.source}
        return tuple(sorted(found, key=lambda lp: (lp.start, -lp.end)))


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
