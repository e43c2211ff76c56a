"""Resource usage of a compiled kernel, read from ptxas' verbose output (``-v``).

ptxas prints, per function, lines such as::

    ptxas info    : Compiling entry function 'k' for 'sm_80'
    ptxas info    : Function properties for k
    ptxas         .     256 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info    : Used 32 registers, used 1 barriers, 1024 bytes smem, 372 bytes cmem[0]

(older releases omit the barrier count and may list several cmem banks). Spills are summed
over the entry and every non-inlined function it calls; the other figures are the entry's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

_FUNC = re.compile(r"(?:Compiling entry function|Function properties for) '?([\w$.]+)'?")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_CMEM = re.compile(r"(\d+) bytes cmem\[\d+\]")
_BARRIERS = re.compile(r"used (\d+) barriers")


@dataclass(frozen=True)
class Resources:
    """Per-thread and per-block resources of one kernel on one arch (bytes unless named)."""

    registers: int
    spill_stores: int
    spill_loads: int
    static_smem: int
    dynamic_smem: int
    stack_frame: int
    cmem: int
    max_threads: int
    barriers: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Resources.{f.name} must be a non-negative int, got {value!r}")

    @property
    def spill_bytes(self) -> int:
        """Bytes spilled to and reloaded from local memory (stores + loads)."""
        return self.spill_stores + self.spill_loads

    @property
    def smem_bytes(self) -> int:
        """Shared memory of one block: static plus dynamic."""
        return self.static_smem + self.dynamic_smem

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Resources:
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown Resources field(s) {sorted(unknown)}; expected "
                             f"{sorted(names)}")
        return cls(**dict(data))


@dataclass
class _Function:
    registers: int | None = None
    static_smem: int = 0
    cmem: int = 0
    barriers: int = 0
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


def parse_ptxas_log(log: str, entry: str, *, dynamic_smem: int, max_threads: int) -> Resources:
    """Resources of ``entry`` from ptxas' verbose output.

    Raises ValueError when the log has no register count for ``entry`` (ptxas did not run
    verbosely, or the entry is not in the module).
    """
    funcs: dict[str, _Function] = {}
    current: _Function | None = None
    for line in log.splitlines():
        if (m := _FUNC.search(line)) is not None:
            current = funcs.setdefault(m.group(1), _Function())
            continue
        if current is None:
            continue
        if (m := _FRAME.search(line)) is not None:
            current.stack_frame, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif (m := _REGS.search(line)) is not None:
            current.registers = int(m.group(1))
            current.static_smem = sum(int(x) for x in _SMEM.findall(line))
            current.cmem = sum(int(x) for x in _CMEM.findall(line))
            barriers = _BARRIERS.search(line)
            current.barriers = int(barriers.group(1)) if barriers else 0
    main = funcs.get(entry)
    if main is None or main.registers is None:
        raise ValueError(
            f"the ptxas output has no 'Used N registers' line for entry {entry!r} "
            f"(functions seen: {sorted(funcs)}); compile with --ptxas-options=-v"
        )
    return Resources(
        registers=main.registers,
        spill_stores=sum(f.spill_stores for f in funcs.values()),
        spill_loads=sum(f.spill_loads for f in funcs.values()),
        static_smem=main.static_smem,
        dynamic_smem=dynamic_smem,
        stack_frame=main.stack_frame,
        cmem=main.cmem,
        max_threads=max_threads,
        barriers=main.barriers,
    )
