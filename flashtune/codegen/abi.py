"""The launch ABI of generated kernels: each entry point's arguments, declared once.

A family declares its kernel's arguments as an ``EntryAbi``: one ``Arg`` per parameter, in
the kernel's order, with its name, kind (tensor pointer, scalar, tensor map), element type,
const-ness and the Problem feature switch that adds it (None: always there). Everything that
must agree with the kernel's parameter list is generated from that one declaration:

- ``signature(features)``: the ``.cu.jinja`` parameter list (the template's ``signature``);
- ``packer(features)``: a Python function from the launch's named inputs (tensors and
  values) to the packed arguments, generated as straight-line code (it runs on every call);
- ``emulator_signature(features)``: the parameter type codes the emulator's kernel library
  exports for the entry point (``ftemu_signature__<entry>``), checked at load.

An entry that takes declared score modifications (``score_mods=True``) has, after its own
arguments, the params of the problem's modifications (``codegen.score_mods``), in key order:
a feature declared with a ``ScoreMod`` adds its arguments with no edit of any ABI. An
argument declared with ``feature=WITH_SCORE_MODS`` is there when the problem has any.

Packed arguments are (ArgType, value) pairs in the kernel's parameter order; every backend
converts them the same way (a 64-bit pointer, a 32-bit or 64-bit integer, a 32-bit float),
except a tensor map (``TMAP``, a ``TensorMap``), which each backend encodes its own way
(``runtime.tma``).

Element types stay symbolic for the operands (``Element.Q``, ``Element.KV``, ``Element.O``:
"the element type of that operand"), rendered through the template's type aliases
(``OPERAND_ALIASES``: today every operand is the template's ``Element``).
"""

from __future__ import annotations

import keyword
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from flashtune.codegen import features as _features
from flashtune.codegen.score_mods import POINTER_TYPES
from flashtune.codegen.tensormap import TensorMap
from flashtune.errors import InvalidInput


class ArgType(str, Enum):
    PTR = "ptr"
    I32 = "i32"
    I64 = "i64"
    F32 = "f32"
    TMAP = "tmap"


#: The value of one packed argument.
ArgValue = int | float | TensorMap

#: A packed argument list: (type, value) in the kernel's parameter order.
PackedArgs = tuple[tuple[ArgType, ArgValue], ...]

#: A generated packer: the launch's named inputs (positional in ``EntryAbi.inputs`` order,
#: or by keyword) to the packed arguments.
Packer = Callable[..., PackedArgs]


class ArgKind(str, Enum):
    """What a kernel parameter is."""

    TENSOR = "tensor"          # a pointer to a tensor's elements
    SCALAR = "scalar"          # a value passed by value
    TENSOR_MAP = "tensor_map"  # a CUtensorMap passed by value (__grid_constant__)


class Element(str, Enum):
    """The element type of a parameter: an operand's (symbolic) or a fixed C type."""

    Q = "q"            # the Q operand's element type (and dQ's)
    KV = "kv"          # the K and V operands' element type (and dK's, dV's, the caches')
    O = "o"  # noqa: E741  (the O operand's element type, and dO's)
    FLOAT = "float"    # float32
    INT = "int"        # int32
    INT64 = "int64"    # int64 (``long long``)


OPERANDS = frozenset({Element.Q, Element.KV, Element.O})

#: The template's type alias of each operand's element type.
OPERAND_ALIASES: Mapping[Element, str] = {Element.Q: "Element", Element.KV: "Element",
                                          Element.O: "Element"}

_C_TYPES = {Element.FLOAT: "float", Element.INT: "int", Element.INT64: "long long"}
_SCALAR_TYPES = {Element.FLOAT: ArgType.F32, Element.INT: ArgType.I32,
                 Element.INT64: ArgType.I64}
#: The emulator's type code of each packed type (runtime.h ``type_code``).
_EMULATOR_CODES = {ArgType.PTR: "p", ArgType.I32: "i", ArgType.I64: "l", ArgType.F32: "f",
                   ArgType.TMAP: "T"}


class How(str, Enum):
    """How a packer gets one argument's value from an input."""

    PTR = "ptr"        # input.data_ptr()
    STRIDE = "stride"  # input.stride()[dim]
    SIZE = "size"      # input.shape[dim]
    GIVEN = "given"    # the input itself (a scalar, a tensor map, a value the caller made)


@dataclass(frozen=True)
class Source:
    """Where a packer takes one argument's value from: ``how`` applied to the input named
    ``input``. ``optional``: the input may be None, and then the value is ``default`` (a
    null pointer, a zero stride, ...)."""

    how: How
    input: str
    dim: int = 0
    optional: bool = False
    default: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "how", How(self.how))
        _check_identifier(self.input, "a Source input")
        if not 0 <= self.dim < 8:
            raise InvalidInput(f"Source dim={self.dim} must be in [0, 8)")
        if self.optional and self.how is How.GIVEN:
            raise InvalidInput(f"input {self.input!r}: a given value cannot be optional "
                               "(pass the value the kernel should get)")


def ptr(input: str, *, optional: bool = False) -> Source:
    """The data pointer of tensor ``input`` (0 when optional and None)."""
    return Source(How.PTR, input, optional=optional)


def stride(input: str, dim: int, *, optional: bool = False) -> Source:
    """Element stride ``dim`` of tensor ``input`` (0 when optional and None)."""
    return Source(How.STRIDE, input, dim, optional=optional)


def size(input: str, dim: int, *, optional: bool = False, default: int = 0) -> Source:
    """Size ``dim`` of tensor ``input`` (``default`` when optional and None)."""
    return Source(How.SIZE, input, dim, optional=optional, default=default)


def given(input: str) -> Source:
    """The value passed as ``input`` itself."""
    return Source(How.GIVEN, input)


def _check_identifier(name: str, what: str) -> None:
    if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
        raise InvalidInput(f"{what} {name!r} must be a Python and C identifier that does not "
                           "start with an underscore, e.g. 'seqlen_q'")


@dataclass(frozen=True)
class Arg:
    """One kernel parameter.

    ``element``: the pointee type of a tensor, the type of a scalar, the operand of a tensor
    map. ``const``/``restrict``: the pointer's qualifiers (tensors only). ``feature``: the
    Problem feature switch whose kernels take this parameter (None: all). ``source``: where
    the packer takes its value. ``wrap``: the rendered signature starts a new line before
    it (layout only, so that rendered sources keep their bytes)."""

    name: str
    kind: ArgKind
    element: Element
    source: Source
    const: bool = False
    restrict: bool = True
    feature: str | None = None
    wrap: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ArgKind(self.kind))
        object.__setattr__(self, "element", Element(self.element))
        _check_identifier(self.name, "an argument name")
        if self.kind is ArgKind.TENSOR and self.source.how is not How.PTR:
            raise InvalidInput(f"argument {self.name!r}: a tensor argument takes a pointer "
                               f"(ptr(...)), not {self.source.how.value}")
        if self.kind is not ArgKind.TENSOR and self.source.how is How.PTR:
            raise InvalidInput(f"argument {self.name!r}: a {self.kind.value} cannot take a "
                               "pointer; declare it as a tensor")
        if self.kind is ArgKind.SCALAR and self.element not in _SCALAR_TYPES:
            raise InvalidInput(f"scalar {self.name!r}: element {self.element.value!r} must be "
                               f"one of {[e.value for e in _SCALAR_TYPES]}")
        if self.kind is ArgKind.TENSOR_MAP and (self.element not in OPERANDS
                                                or self.source.how is not How.GIVEN):
            raise InvalidInput(f"tensor map {self.name!r} must name an operand (q, kv, o) "
                               "and be given (given(...))")

    @property
    def arg_type(self) -> ArgType:
        """The packed type of this parameter."""
        if self.kind is ArgKind.TENSOR:
            return ArgType.PTR
        if self.kind is ArgKind.TENSOR_MAP:
            return ArgType.TMAP
        return _SCALAR_TYPES[self.element]

    def declaration(self, aliases: Mapping[Element, str] = OPERAND_ALIASES) -> str:
        """The C++ parameter declaration, e.g. ``const Element* __restrict__ q``."""
        if self.kind is ArgKind.TENSOR_MAP:
            return f"const __grid_constant__ CUtensorMap {self.name}"
        ctype = aliases[self.element] if self.element in OPERANDS else _C_TYPES[self.element]
        if self.kind is ArgKind.SCALAR:
            return f"{ctype} {self.name}"
        return (f"{'const ' if self.const else ''}{ctype}* "
                f"{'__restrict__ ' if self.restrict else ''}{self.name}")


def tensor(name: str, element: Element, *, const: bool = False, restrict: bool = True,
           optional: bool = False, feature: str | None = None, wrap: bool = False) -> Arg:
    """A tensor pointer argument whose value is the data pointer of the input ``name``."""
    return Arg(name, ArgKind.TENSOR, element, ptr(name, optional=optional), const=const,
               restrict=restrict, feature=feature, wrap=wrap)


def scalar(name: str, element: Element, source: Source | None = None, *,
           feature: str | None = None, wrap: bool = False) -> Arg:
    """A scalar argument (by default the value given as ``name``)."""
    return Arg(name, ArgKind.SCALAR, element, source or given(name), feature=feature,
               wrap=wrap)


def tensor_map(name: str, operand: Element, *, feature: str | None = None,
               wrap: bool = False) -> Arg:
    """A tensor map argument of ``operand``'s tiles (the map given as ``name``)."""
    return Arg(name, ArgKind.TENSOR_MAP, operand, given(name), feature=feature, wrap=wrap)


#: The (batch, row, head) stride names of a (batch, seq, heads, dim) tensor.
ROW_STRIDES = ("batch", "row", "head")


def strides(prefix: str, input: str | None = None, names: Iterable[str] = ROW_STRIDES, *,
            optional: bool = False, feature: str | None = None, wrap: bool = True
            ) -> tuple[Arg, ...]:
    """int64 arguments ``<prefix>_<name>_stride``, one per dim of tensor ``input`` (default
    ``prefix``) in order; the first starts a new line when ``wrap``."""
    source = input or prefix
    return tuple(scalar(f"{prefix}_{name}_stride", Element.INT64,
                        stride(source, dim, optional=optional), feature=feature,
                        wrap=wrap and dim == 0)
                 for dim, name in enumerate(names))


#: The ``feature`` of an argument that kernels with declared score modifications take.
WITH_SCORE_MODS = "*score_mods"

_INDENT = "    "
_ZEROS = (0,) * 8


@dataclass(frozen=True)
class EntryAbi:
    """The arguments of one kernel entry point, in parameter order (see the module doc);
    ``score_mods``: the entry also takes the params of the problem's declared score
    modifications, after ``args``."""

    name: str
    args: tuple[Arg, ...]
    score_mods: bool = False
    _packers: dict[tuple[frozenset[str], int], Packer] = field(default_factory=dict, init=False,
                                                  repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        _check_identifier(self.name, "an entry point ABI name")
        names = [a.name for a in self.args]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise InvalidInput(f"ABI {self.name}: arguments {repeated} are declared twice")

    def extended(self, name: str, *more: Arg) -> EntryAbi:
        """This ABI with ``more`` arguments after its own (a kernel that takes more)."""
        return EntryAbi(name, self.args + more, self.score_mods)

    def active(self, features: Collection[str] = ()) -> tuple[Arg, ...]:
        """The arguments of a kernel with the feature switches ``features`` on."""
        modified = self.score_mods and bool(_features.mods_of(features))
        own = tuple(a for a in self.args if a.feature is None or a.feature in features
                    or (modified and a.feature == WITH_SCORE_MODS))
        if not self.score_mods:
            return own
        return own + tuple(
            (tensor(p.name, Element.FLOAT if p.type == "float_ptr" else Element.INT,
                    const=True, feature=name, wrap=i == 0) if p.type in POINTER_TYPES else
             scalar(p.name, Element.FLOAT if p.type == "float" else Element.INT,
                    feature=name, wrap=i == 0))
            for name, mod in _features.mods_of(features)
            for i, p in enumerate(mod.params))

    def signature(self, features: Collection[str] = (),
                  aliases: Mapping[Element, str] = OPERAND_ALIASES) -> str:
        """The rendered parameter list (one indent in, no parentheses), the template's
        ``signature``."""
        out = []
        for i, arg in enumerate(self.active(features)):
            sep = "" if i == 0 else ",\n" + _INDENT if arg.wrap else ", "
            out.append(sep + arg.declaration(aliases))
        return _INDENT + "".join(out)

    def arg_types(self, features: Collection[str] = ()) -> tuple[ArgType, ...]:
        """The packed types of the parameters, in order."""
        return tuple(a.arg_type for a in self.active(features))

    def emulator_signature(self, features: Collection[str] = ()) -> str:
        """The type codes the emulator's library reports for this entry point."""
        return "".join(_EMULATOR_CODES[t] for t in self.arg_types(features))

    def inputs(self, features: Collection[str] = ()) -> tuple[str, ...]:
        """The packer's parameters: the inputs the arguments read, in first-use order."""
        seen: dict[str, None] = {}
        for arg in self.active(features):
            seen.setdefault(arg.source.input, None)
        return tuple(seen)

    def packer(self, features: Collection[str] = ()) -> Packer:
        """The packer of a kernel with ``features`` on (generated once per feature set)."""
        names = frozenset(features)
        # Keyed by the registry's generation too: a feature registered again may declare
        # other params.
        key = (names, _features.generation())
        pack = self._packers.get(key)
        if pack is None:
            pack = self._packers.setdefault(key, _generate(self, self.active(names),
                                                           self.inputs(names)))
        return pack

    def pack(self, values: Mapping[str, object], features: Collection[str] = ()
             ) -> PackedArgs:
        """The packed arguments from inputs by name (InvalidInput naming a missing one)."""
        names = self.inputs(features)
        missing = [n for n in names if n not in values]
        if missing:
            raise InvalidInput(f"ABI {self.name}: inputs {missing} are missing; the packer "
                               f"takes {list(names)}")
        return self.packer(features)(*(values[n] for n in names))


def _generate(abi: EntryAbi, args: tuple[Arg, ...], inputs: tuple[str, ...]) -> Packer:
    """Straight-line Python for one packer: each tensor's strides and shape read once, the
    result one tuple literal (it runs on every call of the hot path). The code is made
    from declared identifiers and ints only."""
    optional = {a.source.input for a in args if a.source.optional}
    uses = {(a.source.input, a.source.how) for a in args}
    body = []
    for name in inputs:
        if (name, How.STRIDE) in uses:
            body.append(f"    {name}__s = _ZEROS if {name} is None else {name}.stride()"
                        if name in optional else f"    {name}__s = {name}.stride()")
        if (name, How.SIZE) in uses and name not in optional:
            body.append(f"    {name}__n = {name}.shape")
    items = []
    for a in args:
        s = a.source
        if s.how is How.PTR:
            value = (f"(0 if {s.input} is None else {s.input}.data_ptr())" if s.optional
                     else f"{s.input}.data_ptr()")
        elif s.how is How.STRIDE:
            value = f"{s.input}__s[{s.dim}]"
        elif s.how is How.SIZE:
            value = (f"({int(s.default)} if {s.input} is None else {s.input}.shape[{s.dim}])"
                     if s.input in optional else f"{s.input}__n[{s.dim}]")
        else:
            value = s.input
        items.append(f"(_{a.arg_type.name}, {value})")
    code = (f"def pack_{abi.name}({', '.join(inputs)}):\n" + "\n".join(body)
            + ("\n" if body else "") + f"    return ({', '.join(items)}{',' if items else ''})\n")
    namespace: dict[str, object] = {f"_{t.name}": t for t in ArgType}
    namespace["_ZEROS"] = _ZEROS
    exec(compile(code, f"<abi {abi.name}>", "exec"), namespace)  # noqa: S102
    pack = namespace[f"pack_{abi.name}"]
    assert callable(pack)
    pack.__doc__ = f"The packed arguments of {abi.name}: inputs {', '.join(inputs)}."
    return pack
