"""Element types of a kernel's operands: one table spells each type in every place it appears.

``DType`` names an element type as problem keys, database rows and the command line write it
(``fp16``); ``ELEMENTS`` gives each one its C++ type (what a template binds as ``Element``),
its PTX operand type (mma.sync / wgmma), its torch dtype, its TMA data type and its bytes, so
nothing else in flashtune spells a type out. A DType without a row fails at import.

``Fp8Type`` names an 8-bit floating-point type (OCP e4m3 and e5m2, ``FP8_ELEMENTS``): an input
operand type (Q, K/V), never an output's, and never every operand's. An ``Operand`` is either.

``Dtypes`` is what a Problem names per operand: the element type of Q, of K and V (one type:
they are loaded by the same pipeline), and of O (a DType: outputs are 16-bit). Every kernel
accumulates in float32 (the MMA accumulator, the softmax statistics and the LSE), whatever
its operands; that is part of each family's kernel, not of a Problem, until a family offers
another accumulator.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from flashtune.codegen.tensormap import TmaDType
from flashtune.errors import InvalidProblem


class DType(str, Enum):
    """An element type of an operand (Q, K/V or O), by its key word."""

    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def element(self) -> ElementType:
        """This type's row of ``ELEMENTS``: every spelling of it."""
        return ELEMENTS[self]

    @property
    def itemsize(self) -> int:
        """Bytes of one element."""
        return self.element.itemsize


class Fp8Type(str, Enum):
    """An 8-bit floating-point storage type (OCP FP8), by its key word.

    Not a ``DType``: every DType is the type of all operands of some family (tests and the
    default rule enumerate DType), while an FP8 type is only an input's (Q, K/V), beside a
    16-bit O (``Dtypes``). The FP8 forward (``families/fwd8``) takes e4m3 Q, K and V on
    mma.sync m16n8k32; the conversions are ``templates/fp8.cuh``, modelled bit-exactly by
    the emulator.
    """

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def element(self) -> ElementType:
        """This type's row of ``FP8_ELEMENTS``: every spelling of it."""
        return FP8_ELEMENTS[self]

    @property
    def itemsize(self) -> int:
        """Bytes of one element."""
        return self.element.itemsize


#: The element type of one operand: a 16-bit type, or (Q, K/V only) an FP8 type.
Operand = DType | Fp8Type

_CPP_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_:]*$")
_WORD_RE = re.compile(r"^[a-z][a-z0-9]*$")
_TORCH_RE = re.compile(r"^[a-z][a-z0-9_]*$")  # torch spells float8_e4m3fn with '_'


@dataclass(frozen=True)
class ElementType:
    """Every spelling of one element type.

    cpp: the C++ type of the CUDA headers (``cuda_fp16.h``, ``cuda_bf16.h``) a template binds;
    ptx: the operand type word of ``mma.sync`` / ``wgmma`` (``f16``, ``bf16``);
    torch: the name of its ``torch.dtype`` attribute (``float16``), so that codegen never
      imports torch (``families.base.torch_dtype`` reads it);
    tma: its ``CUtensorMapDataType``, for kernels that load it with TMA;
    itemsize: bytes of one element;
    mantissa: its stored mantissa bits (fp16 10, bf16 7, e4m3 3, e5m2 2).
    """

    cpp: str
    ptx: str
    torch: str
    tma: TmaDType
    itemsize: int
    mantissa: int

    def __post_init__(self) -> None:
        if not _CPP_RE.match(self.cpp):
            raise InvalidProblem(f"C++ type {self.cpp!r} is not a type name")
        for what, word, pattern in (("ptx", self.ptx, _WORD_RE),
                                    ("torch", self.torch, _TORCH_RE)):
            if not pattern.match(word):
                raise InvalidProblem(f"{what} name {word!r} of {self.cpp} is not a lowercase word")
        if self.itemsize != self.tma.itemsize:
            raise InvalidProblem(f"{self.cpp} has {self.itemsize} bytes but its TMA type "
                                 f"{self.tma.name} has {self.tma.itemsize}")
        if not 0 < self.mantissa < 8 * self.itemsize:
            raise InvalidProblem(f"{self.cpp} has {self.mantissa} mantissa bits; expected "
                                 f"1 to {8 * self.itemsize - 1} in {self.itemsize} bytes")

    @property
    def unit_roundoff(self) -> float:
        """The largest relative error of rounding a real to this type to nearest, above
        its normals: half an ulp of 1, 2^-(mantissa + 1) (torch's ``finfo(...).eps / 2``)."""
        return 2.0 ** -(self.mantissa + 1)


#: The one table of element types.
ELEMENTS: dict[DType, ElementType] = {
    DType.FP16: ElementType(cpp="__half", ptx="f16", torch="float16", tma=TmaDType.FLOAT16,
                            itemsize=2, mantissa=10),
    DType.BF16: ElementType(cpp="__nv_bfloat16", ptx="bf16", torch="bfloat16",
                            tma=TmaDType.BFLOAT16, itemsize=2, mantissa=7),
}
if set(ELEMENTS) != set(DType):
    raise ImportError(f"ELEMENTS has no row for {sorted(set(DType) - set(ELEMENTS))}")
#: The FP8 rows: TMA has no FP8 data type, so FP8 tiles travel as UINT8 (as in FA3).
FP8_ELEMENTS: dict[Fp8Type, ElementType] = {
    Fp8Type.E4M3: ElementType(cpp="__nv_fp8_e4m3", ptx="e4m3", torch="float8_e4m3fn",
                              tma=TmaDType.UINT8, itemsize=1, mantissa=3),
    Fp8Type.E5M2: ElementType(cpp="__nv_fp8_e5m2", ptx="e5m2", torch="float8_e5m2",
                              tma=TmaDType.UINT8, itemsize=1, mantissa=2),
}
if set(FP8_ELEMENTS) != set(Fp8Type):
    raise ImportError(f"FP8_ELEMENTS has no row for {sorted(set(Fp8Type) - set(FP8_ELEMENTS))}")
for _dtype in (*DType, *Fp8Type):
    if not _WORD_RE.match(_dtype.value):  # a key part: no '_' or '-'
        raise ImportError(f"DType {_dtype.name} = {_dtype.value!r} is not a lowercase word")


def _enum(cls: type[Any], value: object, what: str) -> Any:
    """``value`` as a member of enum ``cls`` (a member or its value), InvalidProblem naming
    the legal values otherwise."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        legal = [m.value for m in cls]
        raise InvalidProblem(
            f"{what}={value!r} is not supported; expected one of {legal}"
        ) from None


def as_dtype(value: object, what: str = "dtype") -> DType:
    """``value`` (a DType or its key word) as a DType; InvalidProblem naming the legal ones."""
    dtype: DType = _enum(DType, value, what)
    return dtype


def as_operand(value: object, what: str = "dtype") -> Operand:
    """``value`` (a DType, an Fp8Type or the key word of either) as an Operand;
    InvalidProblem naming the legal ones."""
    if isinstance(value, (DType, Fp8Type)):
        return value
    for cls in (DType, Fp8Type):
        try:
            found: Operand = cls(value)
            return found
        except ValueError:
            pass
    legal = [m.value for m in (*DType, *Fp8Type)]
    raise InvalidProblem(f"{what}={value!r} is not supported; expected one of {legal}")


def as_output(value: object, what: str = "o dtype") -> DType:
    """``value`` as the DType of an output; an FP8 type is refused naming the 16-bit ones."""
    o = as_operand(value, what)
    if isinstance(o, Fp8Type):
        raise InvalidProblem(f"{what}={o.value!r}: the output is a 16-bit type; expected "
                             f"one of {[d.value for d in DType]} (with FP8 inputs, name it "
                             "as out_dtype)")
    return o


def is_fp8(dtype: Operand) -> bool:
    """Whether ``dtype`` is an 8-bit floating-point type."""
    return isinstance(dtype, Fp8Type)


@dataclass(frozen=True)
class Dtypes:
    """The element types of one problem's operands: Q, K and V (one type), O.

    Q and K/V may be FP8 (``Fp8Type``); O is a 16-bit type (an FP8 O is refused, naming the
    fix), so an FP8 problem never has one type for all operands. ``word`` is its key part:
    the type's word when all three are the same (``bf16``, the key
    of every problem before per-operand types existed), else the three words joined by
    ``-`` in the order q, kv, o (``bf16-fp16-bf16``); ``parse`` inverts it.
    """

    q: Operand
    kv: Operand
    o: DType

    def __post_init__(self) -> None:
        for name in ("q", "kv"):
            object.__setattr__(self, name, as_operand(getattr(self, name), f"{name} dtype"))
        object.__setattr__(self, "o", as_output(self.o))

    @classmethod
    def same(cls, dtype: Operand | str) -> Dtypes:
        """Every operand of type ``dtype`` (a 16-bit type: an FP8 type is an input's only)."""
        operand = as_operand(dtype)
        if isinstance(operand, Fp8Type):
            raise InvalidProblem(f"dtype={operand.value!r} for every operand: O is a 16-bit "
                                 f"type; expected o_dtype (out_dtype) one of "
                                 f"{[d.value for d in DType]} beside {operand.value} inputs")
        return _SAME[operand]

    @property
    def fp8(self) -> bool:
        """Whether an input operand (Q or K/V) is FP8."""
        return is_fp8(self.q) or is_fp8(self.kv)

    @property
    def uniform(self) -> bool:
        """Whether Q, K/V and O have one element type."""
        return self.q is self.kv is self.o

    @property
    def word(self) -> str:
        """The key part: ``fp16``, or ``q-kv-o`` when the operands differ."""
        if self.uniform:
            return f"{self.q.value}"
        return f"{self.q.value}-{self.kv.value}-{self.o.value}"

    @classmethod
    def parse(cls, word: str) -> Dtypes:
        """The Dtypes whose ``word`` is ``word``; InvalidProblem saying what is expected."""
        parts = word.split("-")
        legal = [d.value for d in DType]
        inputs = legal + [d.value for d in Fp8Type]
        if (len(parts) not in (1, 3) or any(p not in inputs for p in parts[:2])
                or parts[-1] not in legal):
            raise InvalidProblem(f"element types {word!r} are not one of {legal} nor three "
                                 f"types as q-kv-o, q and kv of {inputs}, o of {legal} (e.g. "
                                 "'bf16-fp16-bf16', 'e4m3-e4m3-bf16')")
        if len(parts) == 1:
            return cls.same(parts[0])
        return cls(as_operand(parts[0]), as_operand(parts[1]), DType(parts[2]))

    def __str__(self) -> str:
        """For messages: ``fp16`` (every operand) or ``q=bf16 kv=fp16 o=bf16``."""
        if self.uniform:
            return f"{self.q.value}"
        return f"q={self.q.value} kv={self.kv.value} o={self.o.value}"


_SAME = {dtype: Dtypes(dtype, dtype, dtype) for dtype in DType}
#: Every operand fp16, or every operand bf16: what each 16-bit family accepts.
SAME_16BIT: frozenset[Dtypes] = frozenset({Dtypes.same(DType.FP16), Dtypes.same(DType.BF16)})
#: e4m3 Q, K and V with an fp16 or a bf16 O.
E4M3_INPUTS: frozenset[Dtypes] = frozenset(Dtypes(Fp8Type.E4M3, Fp8Type.E4M3, o)
                                           for o in DType)
#: Q, K and V of one FP8 format (e4m3 or e5m2) with an fp16 or a bf16 O: what the FP8
#: forward accepts.
FP8_INPUTS: frozenset[Dtypes] = frozenset(Dtypes(f, f, o) for f in Fp8Type for o in DType)
