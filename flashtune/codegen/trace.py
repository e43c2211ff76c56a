"""Tracing user modifications into score modifications: FlexAttention's ``score_mod`` and
``mask_mod``, written as Python functions, become a ``codegen.score_mods.ScoreMod``.

A modification is called once on symbolic values (``Sym``): the scaled score, the batch,
the query head, the query row and the key (``score, b, h, q_idx, kv_idx``; a mask
modification gets the last four). What it does with them is recorded as an expression tree
of a fixed set of operations, and only those:

- arithmetic ``+ - * /``, ``//`` and ``%`` (Python's floor semantics, ints and floats),
  unary ``-``, ``abs``;
- comparisons ``< <= > >= == !=`` and, on their results, ``& | ~`` (and, or, not);
- ``torch.where``, ``torch.minimum`` / ``maximum``, ``abs`` / ``torch.abs``, ``exp``,
  ``log``, ``tanh``, ``sigmoid`` (functions or methods);
- indexing of a captured 1-D to 4-D tensor by one index expression per dim
  (``bias[h, q_idx - kv_idx]``); a negative index counts from the end as in torch, and an
  index past either end is clamped (the kernel also evaluates positions past the sequences'
  ends, whose scores it then hides);
- Python ints, floats and bools as constants (they are part of the expression, and so of the
  kernel's key); a 0-d captured tensor as a run-time value.

Anything else (a str, an attribute, ``if`` on a symbolic value, ``float()``, ``math.*``,
any other torch function) is refused with ``UnsupportedModification`` naming the operation
and the file and line of the user's function that did it.

The CUDA expression is rendered from the tree by this module alone: every token is one of
its own (operators, helper names of ``templates/flex_ops.cuh``, the fixed argument names,
generated param names, numbers formatted from Python numbers). Names, strings and attributes
of the user's code never reach it, so a modification cannot inject code. The expression's
digest names the modification's feature (``flex`` + 12 hex digits): its key part, so one
modification is tuned, cached and shared like a built-in feature.

Captured tensors are run-time kernel arguments, not constants: a float tensor becomes a
``const float*`` (float32, contiguous), an integer or bool one a ``const int*`` (int32), each
with its sizes as int params. ``TracedMod.values`` prepares them for a call.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from flashtune.codegen.score_mods import ModParam, ScoreMod
from flashtune.codegen.trace_expr import (
    ARITH,
    BOOL,
    COMPARE,
    FLOAT,
    INT,
    LEAVES,
    Node,
    evaluate,
    render,
)
from flashtune.codegen.trace_grad import ZERO, NotDifferentiable, derivative
from flashtune.errors import InvalidInput

_INT32 = 2**31 - 1
_MAX_DIMS = 4


class UnsupportedModification(InvalidInput):
    """A modification used an operation outside the traced set (see the module doc)."""


def _where_in_user_code() -> str:
    """``file:line in function`` of the innermost frame outside this module and torch."""
    here = os.path.abspath(__file__)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != here and not path.startswith(torch_dir):
            return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown line>"


def _refuse(operation: str, fix: str) -> UnsupportedModification:
    return UnsupportedModification(
        f"unsupported operation in a score or mask modification: {operation} at "
        f"{_where_in_user_code()}; {fix}")


class _Tracer:
    """The state of one trace: the captured tensors, in order of first use."""

    def __init__(self) -> None:
        self.captured: list[torch.Tensor] = []

    def capture(self, t: torch.Tensor) -> int:
        for i, seen in enumerate(self.captured):
            if seen is t:
                return i
        if t.dim() > _MAX_DIMS:
            raise _refuse(f"capturing a {t.dim()}-D tensor", "captured tensors have 0 to 4 "
                          "dims")
        if t.is_complex():
            raise _refuse(f"capturing a {t.dtype} tensor", "captured tensors are real or "
                          "integer")
        self.captured.append(t)
        return len(self.captured) - 1


_active: list[_Tracer] = []


def _const(x: object) -> Node:
    if isinstance(x, Sym):
        return x.node
    if isinstance(x, bool):
        return Node("const", (), BOOL, x)
    if isinstance(x, int):
        if abs(x) > _INT32:
            raise _refuse(f"the int constant {x} (beyond int32)", "use a float or a smaller "
                          "int")
        return Node("const", (), INT, x)
    if isinstance(x, float):
        if math.isnan(x):
            raise _refuse("a NaN constant", "use a number or +-inf")
        return Node("const", (), FLOAT, x)
    if isinstance(x, torch.Tensor):
        if x.dim() != 0:
            raise _refuse(f"a {x.dim()}-D captured tensor used without indexing",
                          "index it with one index expression per dim, e.g. bias[h, q_idx]")
        slot = _active[-1].capture(x)
        kind = FLOAT if x.is_floating_point() else INT
        return Node("load", (), kind, slot=slot)
    raise _refuse(f"an operand of type {type(x).__name__}", "operands are the symbolic "
                  "arguments, Python ints, floats and bools, and captured tensors")


def _to(kind: str, n: Node) -> Node:
    """``n`` converted to ``kind`` (int -> float, bool -> int or float)."""
    if n.kind == kind:
        return n
    return Node("cast", (n,), kind)


def _common(a: Node, b: Node) -> str:
    if FLOAT in (a.kind, b.kind):
        return FLOAT
    return INT


def _located(make: Callable[..., Sym]) -> Callable[..., Sym]:
    """``make`` whose result node records the user's line (for the backward's messages)."""
    def located(*args: object) -> Sym:
        out = make(*args)
        return Sym(replace(out.node, line=_where_in_user_code()))
    return located


@_located
def _binary(op: str, x: object, y: object) -> Sym:
    a, b = _const(x), _const(y)
    if op in ARITH or op in ("floordiv", "mod", "min", "max"):
        kind = _common(a, b)
        return Sym(Node(op, (_to(kind, a), _to(kind, b)), kind))
    if op == "truediv":
        return Sym(Node("truediv", (_to(FLOAT, a), _to(FLOAT, b)), FLOAT))
    if op in COMPARE:
        kind = _common(a, b)
        return Sym(Node(op, (_to(kind, a), _to(kind, b)), BOOL))
    if op in ("and", "or", "xor"):
        if a.kind != BOOL or b.kind != BOOL:
            raise _refuse(f"a bitwise {op} of {a.kind} and {b.kind} values", "&, | and ^ "
                          "combine comparisons (bools) only")
        return Sym(Node(op, (a, b), BOOL))
    raise _refuse(f"the operation {op!r}", "see flashtune.codegen.trace for the set")


@_located
def _unary(op: str, x: object) -> Sym:
    a = _const(x)
    if op == "neg":
        if a.kind == BOOL:
            raise _refuse("negating a bool", "use ~ for not")
        return Sym(Node("neg", (a,), a.kind))
    if op == "abs":
        a = _to(INT, a) if a.kind == BOOL else a
        return Sym(Node("abs", (a,), a.kind))
    if op == "not":
        if a.kind != BOOL:
            raise _refuse(f"~ of a {a.kind} value", "~ negates comparisons (bools) only")
        return Sym(Node("not", (a,), BOOL))
    return Sym(Node(op, (_to(FLOAT, a),), FLOAT))


def _where(cond: object, x: object, y: object) -> Sym:
    c, a, b = _const(cond), _const(x), _const(y)
    if c.kind != BOOL:
        raise _refuse(f"torch.where on a {c.kind} condition", "the condition is a "
                      "comparison, e.g. torch.where(q_idx >= kv_idx, score, -inf)")
    kind = BOOL if a.kind == b.kind == BOOL else _common(a, b)
    return Sym(Node("where", (c, _to(kind, a), _to(kind, b)), kind))


def _index(t: torch.Tensor, index: object) -> Sym:
    items = index if isinstance(index, tuple) else (index,)
    if len(items) != t.dim() or t.dim() == 0:
        raise _refuse(f"indexing a {t.dim()}-D captured tensor with {len(items)} indices",
                      "give one index expression per dim (no slices, no partial indexing)")
    nodes = []
    for item in items:
        if not isinstance(item, (Sym, int)) or isinstance(item, bool):
            raise _refuse(f"an index of type {type(item).__name__}", "indices are int "
                          "expressions of b, h, q_idx, kv_idx or ints")
        node = _const(item)
        if node.kind != INT:
            raise _refuse(f"a {node.kind} index", "indices are int expressions; convert "
                          "with // or use an int expression")
        nodes.append(node)
    slot = _active[-1].capture(t)
    kind = FLOAT if t.is_floating_point() else (BOOL if t.dtype == torch.bool else INT)
    load = Node("load", tuple(nodes), INT if kind == BOOL else kind, slot=slot)
    return Sym(Node("ne", (load, Node("const", (), INT, 0)), BOOL) if kind == BOOL else load)


_TORCH_FUNCTIONS: dict[Any, Callable[..., Sym]] = {
    torch.where: _where,
    torch.minimum: lambda a, b: _binary("min", a, b),
    torch.maximum: lambda a, b: _binary("max", a, b),
    torch.abs: lambda a: _unary("abs", a),
    torch.exp: lambda a: _unary("exp", a),
    torch.log: lambda a: _unary("log", a),
    torch.tanh: lambda a: _unary("tanh", a),
    torch.sigmoid: lambda a: _unary("sigmoid", a),
    torch.Tensor.__getitem__: _index,
}
#: torch.Tensor's operators with a symbolic right operand (tensor op Sym).
_TENSOR_OPERATORS = {"add": "add", "sub": "sub", "mul": "mul", "div": "truediv",
                     "__add__": "add", "__sub__": "sub", "__mul__": "mul",
                     "__truediv__": "truediv", "__radd__": "add", "__rsub__": "rsub",
                     "__rmul__": "mul", "__rtruediv__": "rtruediv"}


class Sym:
    """A symbolic value of a traced modification; see the module doc for what it supports."""

    __slots__ = ("node",)

    def __init__(self, node: Node) -> None:
        self.node = node

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Sym:
        if kwargs:
            raise _refuse(f"keyword arguments {sorted(kwargs)} to {_name(func)}",
                          "pass the operands positionally")
        handler = _TORCH_FUNCTIONS.get(func)
        if handler is not None:
            return handler(*args)
        name = getattr(func, "__name__", "")
        op = _TENSOR_OPERATORS.get(name)
        if op is not None and len(args) == 2:
            if op == "rsub":
                return _binary("sub", args[1], args[0])
            if op == "rtruediv":
                return _binary("truediv", args[1], args[0])
            return _binary(op, args[0], args[1])
        raise _refuse(f"{_name(func)}", "the traced set is arithmetic, comparisons, "
                      "torch.where, minimum/maximum, abs, exp, log, tanh, sigmoid, // and %, "
                      "and indexing captured tensors")

    def __add__(self, o: object) -> Sym: return _binary("add", self, o)
    def __radd__(self, o: object) -> Sym: return _binary("add", o, self)
    def __sub__(self, o: object) -> Sym: return _binary("sub", self, o)
    def __rsub__(self, o: object) -> Sym: return _binary("sub", o, self)
    def __mul__(self, o: object) -> Sym: return _binary("mul", self, o)
    def __rmul__(self, o: object) -> Sym: return _binary("mul", o, self)
    def __truediv__(self, o: object) -> Sym: return _binary("truediv", self, o)
    def __rtruediv__(self, o: object) -> Sym: return _binary("truediv", o, self)
    def __floordiv__(self, o: object) -> Sym: return _binary("floordiv", self, o)
    def __rfloordiv__(self, o: object) -> Sym: return _binary("floordiv", o, self)
    def __mod__(self, o: object) -> Sym: return _binary("mod", self, o)
    def __rmod__(self, o: object) -> Sym: return _binary("mod", o, self)
    def __lt__(self, o: object) -> Sym: return _binary("lt", self, o)
    def __le__(self, o: object) -> Sym: return _binary("le", self, o)
    def __gt__(self, o: object) -> Sym: return _binary("gt", self, o)
    def __ge__(self, o: object) -> Sym: return _binary("ge", self, o)
    def __eq__(self, o: object) -> Sym: return _binary("eq", self, o)  # type: ignore[override]
    def __ne__(self, o: object) -> Sym: return _binary("ne", self, o)  # type: ignore[override]
    def __and__(self, o: object) -> Sym: return _binary("and", self, o)
    def __rand__(self, o: object) -> Sym: return _binary("and", o, self)
    def __or__(self, o: object) -> Sym: return _binary("or", self, o)
    def __ror__(self, o: object) -> Sym: return _binary("or", o, self)
    def __xor__(self, o: object) -> Sym: return _binary("xor", self, o)
    def __rxor__(self, o: object) -> Sym: return _binary("xor", o, self)
    def __neg__(self) -> Sym: return _unary("neg", self)
    def __pos__(self) -> Sym: return self
    def __abs__(self) -> Sym: return _unary("abs", self)
    def __invert__(self) -> Sym: return _unary("not", self)
    def exp(self) -> Sym: return _unary("exp", self)
    def log(self) -> Sym: return _unary("log", self)
    def tanh(self) -> Sym: return _unary("tanh", self)
    def sigmoid(self) -> Sym: return _unary("sigmoid", self)
    def abs(self) -> Sym: return _unary("abs", self)

    __hash__ = None  # type: ignore[assignment]

    def __bool__(self) -> bool:
        raise _refuse("Python control flow on a symbolic value (if, and, or, not, a "
                      "chained comparison)", "use torch.where, & and |")

    def __float__(self) -> float:
        raise _refuse("float() of a symbolic value (e.g. math.* functions)",
                      "use the torch functions (torch.exp, torch.tanh, ...)")

    def __int__(self) -> int:
        raise _refuse("int() of a symbolic value", "use // for integer division")

    def __index__(self) -> int:
        raise _refuse("a symbolic value as a Python index (a list or a non-tensor "
                      "sequence)", "index captured torch tensors only")

    def __pow__(self, o: object) -> Sym:
        raise _refuse("** (power)", "multiply, or use torch.exp(n * torch.log(x))")

    def __getattr__(self, name: str) -> Any:
        raise _refuse(f"the attribute .{name}", "use torch functions on symbolic values")

    def __getitem__(self, item: object) -> Sym:
        raise _refuse("indexing a symbolic value", "index captured tensors by symbolic "
                      "values, not the other way round")

    def __iter__(self) -> Any:
        raise _refuse("iterating a symbolic value", "it is one number per position")

    def __repr__(self) -> str:
        return f"Sym({self.node.kind})"


def _name(func: Any) -> str:
    """What a message calls ``func`` (messages only: never rendered into code)."""
    return f"{getattr(func, '__qualname__', None) or getattr(func, '__name__', repr(func))}()"


# --- Tracing ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TracedMod:
    """A traced modification: its expression tree (the new scaled score), the captured
    tensors in slot order, and the feature name its digest gives (``flex`` + 12 hex
    digits)."""

    expression: Node
    captured: tuple[torch.Tensor, ...]
    name: str
    cuda: str
    #: The kernel takes a block mask's key tile ranges (``ranges_param``) and skips the
    #: key tiles outside them; ``cuda`` is then the score part alone and ``mask_cuda`` the
    #: mask, which the kernel evaluates only on the tiles the ranges mark partial.
    tiles: bool = False
    mask_cuda: str = ""
    #: The score part alone (without the mask); None: ``expression`` has no mask.
    modified: Node | None = None

    def score_slope(self) -> Node:
        """d(the modified score) / d(score) as a tree (``codegen.trace_grad``): the factor
        the backward multiplies dS by. Where the mask hides a key P is 0, so the score
        part's slope serves. NotDifferentiable naming an operation without one."""
        part = self.modified if self.modified is not None else self.expression
        return derivative(part, LEAVES["score"]) or ZERO

    def grad_cuda(self) -> str:
        """``score_slope`` as the CUDA expression of the backward's hook."""
        return render(self.score_slope(), self.name,
                      tuple(t.dim() for t in self.captured))

    def grad_slots(self) -> tuple[int, ...]:
        """The captured float tensors that require grad (their slots)."""
        return tuple(i for i, t in enumerate(self.captured)
                     if t.is_floating_point() and t.requires_grad)

    @property
    def ranges_param(self) -> str:
        """The name of the tile ranges argument (its sizes: ``<name>_n0`` .. ``_n2``)."""
        return f"{self.name}_r"

    @property
    def params(self) -> tuple[ModParam, ...]:
        """The kernel arguments: per captured tensor its pointer, then its sizes."""
        out: list[ModParam] = []
        for i, t in enumerate(self.captured):
            ptr = f"{self.name}_t{i}"
            sizes = tuple(f"{ptr}_n{j}" for j in range(t.dim()))
            out.append(ModParam(ptr, "float_ptr" if t.is_floating_point() else "int_ptr",
                                dims=sizes))
            out.extend(ModParam(s, "int", draws=(int(n),))
                       for s, n in zip(sizes, t.shape, strict=True))
        if self.tiles:
            sizes = tuple(f"{self.ranges_param}_n{j}" for j in range(3))
            out.append(ModParam(self.ranges_param, "tiles", dims=sizes))
            out.extend(ModParam(s, "int", draws=(1,)) for s in sizes)
        return tuple(out)

    def score_mod(self) -> ScoreMod:
        """The declaration a ``Feature`` carries: the rendered expression, the params and
        the float64 reference (the tree evaluated on the given captured tensors)."""
        captured = [f"{self.name}_t{i}" for i in range(len(self.captured))]
        expression = self.expression

        def reference(score: torch.Tensor, batch: torch.Tensor, head: torch.Tensor,
                      q_idx: torch.Tensor, kv_idx: torch.Tensor, **values: Any
                      ) -> torch.Tensor:
            leaves = {"score": score.to(torch.float64), "batch": batch.to(torch.int64),
                      "head": head.to(torch.int64), "q_idx": q_idx.to(torch.int64),
                      "kv_idx": kv_idx.to(torch.int64)}
            return evaluate(expression, leaves, [values[c] for c in captured])

        try:
            grad = self.grad_cuda()
        except NotDifferentiable:
            grad = ""  # the forward serves it; a backward refuses it (naming the op)
        return ScoreMod(self.cuda, reference, self.params, self.mask_cuda, grad)

    def values(self, device: torch.device) -> dict[str, object]:
        """The params of one call: each captured tensor contiguous as float32 or int32 on
        ``device``, and its sizes."""
        out: dict[str, object] = {}
        for i, t in enumerate(self.captured):
            ptr = f"{self.name}_t{i}"
            dtype = torch.float32 if t.is_floating_point() else torch.int32
            out[ptr] = t.detach().to(device=device, dtype=dtype).contiguous()
            out.update({f"{ptr}_n{j}": int(n) for j, n in enumerate(t.shape)})
        return out


Mod = Callable[..., Any]


def trace(score_mod: Mod | None = None, mask_mod: Mod | None = None, *,
          tiles: bool = False) -> TracedMod:
    """One modification of the scaled score from FlexAttention's ``score_mod(score, b, h,
    q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` (either may be None, not both):
    where the mask is False the score is -inf. ``tiles``: the kernel also takes a block
    mask's key tile ranges (part of the key). UnsupportedModification for an operation
    outside the traced set."""
    if score_mod is None and mask_mod is None:
        raise InvalidInput("trace needs a score_mod or a mask_mod; both are None")
    for what, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            args = ("(score, b, h, q_idx, kv_idx)" if what == "score_mod"
                    else "(b, h, q_idx, kv_idx)")
            raise InvalidInput(f"{what}={fn!r} is not callable; expected a function {args}")
    tracer = _Tracer()
    _active.append(tracer)
    try:
        b, h, q, kv = (Sym(LEAVES[n]) for n in ("batch", "head", "q_idx", "kv_idx"))
        modified = score = Sym(LEAVES["score"])
        if score_mod is not None:
            modified = score = _result(score_mod(score, b, h, q, kv), "score_mod", FLOAT)
        keep = None
        if mask_mod is not None:
            keep = _result(mask_mod(b, h, q, kv), "mask_mod", BOOL)
            score = _where(keep, score, -math.inf)
    finally:
        _active.pop()
    dims = tuple(t.dim() for t in tracer.captured)
    kinds = "".join("f" if t.is_floating_point() else "i" for t in tracer.captured)
    # The digest covers the expression with placeholder names and the captured kinds.
    shape = render(score.node, "P", dims)
    digest = hashlib.sha256(f"{shape}|{kinds}|{dims}|{tiles}".encode()).hexdigest()
    name = "flex" + digest[:12]
    if not tiles:
        return TracedMod(score.node, tuple(tracer.captured), name,
                         render(score.node, name, dims), modified=modified.node)
    # With tile ranges the mask is a hook of its own, evaluated on partial tiles only.
    return TracedMod(score.node, tuple(tracer.captured), name,
                     render(modified.node, name, dims), True,
                     render(keep.node, name, dims) if keep is not None else "true",
                     modified.node)


def _result(value: object, what: str, kind: str) -> Sym:
    node = _const(value)
    if kind == FLOAT and node.kind != FLOAT:
        node = _to(FLOAT, node)
    if kind == BOOL and node.kind != BOOL:
        raise UnsupportedModification(f"{what} returned a {node.kind} value; a mask_mod "
                                      "returns a comparison (True: the key is visible)")
    return Sym(node)
