"""The expressions of traced modifications (``codegen.trace``): the operation tree, its
CUDA rendering and its float64 evaluation.

``render`` makes the C++ expression from the tree with this module's own tokens only
(operators, the helpers of ``templates/flex_ops.cuh``, CUDA math functions, the hook's
argument names, generated param names and numbers formatted from Python numbers), so no
text of a user's code can reach the compiler. ``evaluate`` computes the same tree on torch
tensors in float64: the reference the forward family verifies a traced modification with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: The kinds of a symbolic value.
FLOAT, INT, BOOL = "float", "int", "bool"


@dataclass(frozen=True)
class Node:
    """One operation of a traced expression: ``op`` with operand nodes ``args``, its
    ``kind`` (float, int or bool); ``value`` for a constant, ``slot`` for a captured load
    (the index of the tensor among the captured ones); ``line``: where the user's function
    did it (messages only: neither compared nor rendered)."""

    op: str
    args: tuple[Node, ...]
    kind: str
    value: float | int | bool | None = None
    slot: int = -1
    line: str = field(default="", compare=False)


#: The hook arguments, as leaf nodes; the unary float functions, comparisons and arithmetic
#: operators by operation name.
LEAVES = {"score": Node("score", (), FLOAT), "batch": Node("batch", (), INT),
           "head": Node("head", (), INT), "q_idx": Node("q_idx", (), INT),
           "kv_idx": Node("kv_idx", (), INT)}
_UNARY_FLOAT = {"exp": "expf", "log": "logf", "tanh": "tanhf", "sigmoid": "ft::flex::sigmoid"}
COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
ARITH = {"add": "+", "sub": "-", "mul": "*"}


# --- Rendering: the CUDA expression, from this module's own tokens only -------------------

_HELPER = {("floordiv", INT): "ft::flex::floordiv", ("mod", INT): "ft::flex::mod",
           ("mod", FLOAT): "ft::flex::fmodpy", ("min", FLOAT): "fminf",
           ("max", FLOAT): "fmaxf", ("min", INT): "ft::flex::imin",
           ("max", INT): "ft::flex::imax", ("abs", FLOAT): "fabsf",
           ("abs", INT): "ft::flex::iabs"}
_C_TYPES = {FLOAT: "float", INT: "int", BOOL: "bool"}
_LOGICAL = {"and": "&&", "or": "||", "xor": "!="}
_FLT_MAX = 3.4028234663852886e38


def _literal(n: Node) -> str:
    v = n.value
    if n.kind == BOOL:
        return "true" if v else "false"
    if n.kind == INT:
        return f"({int(v)})" if int(v) < 0 else str(int(v))  # type: ignore[arg-type]
    x = float(v)  # type: ignore[arg-type]
    if abs(x) > _FLT_MAX:
        return "INFINITY" if x > 0 else "(-INFINITY)"
    text = repr(x)
    return f"({text}f)" if x < 0 else f"{text}f"


def render(n: Node, prefix: str, dims: tuple[int, ...]) -> str:
    """The C++ expression of ``n``; captured tensor ``i`` is the param ``<prefix>_t<i>``
    with sizes ``<prefix>_t<i>_n<j>`` (``dims[i]`` of them)."""
    def r(m: Node) -> str:
        return render(m, prefix, dims)

    op, a = n.op, n.args
    if op in LEAVES:
        return op
    if op == "const":
        return _literal(n)
    if op == "cast":
        return f"(({_C_TYPES[n.kind]})({r(a[0])}))"
    if op in ARITH:
        return f"({r(a[0])} {ARITH[op]} {r(a[1])})"
    if op == "truediv" or (op == "floordiv" and n.kind == FLOAT):
        quotient = f"({r(a[0])} / {r(a[1])})"
        return quotient if op == "truediv" else f"floorf{quotient}"
    if op in COMPARE:
        return f"({r(a[0])} {COMPARE[op]} {r(a[1])})"
    if op in ("and", "or", "xor"):
        return f"({r(a[0])} {_LOGICAL[op]} {r(a[1])})"
    if op == "neg":
        return f"(-{r(a[0])})"
    if op == "not":
        return f"(!{r(a[0])})"
    if op in _UNARY_FLOAT:
        return f"{_UNARY_FLOAT[op]}({r(a[0])})"
    if op == "where":
        return f"({r(a[0])} ? {r(a[1])} : {r(a[2])})"
    if op == "load":
        ptr = f"{prefix}_t{n.slot}"
        if not a:
            return f"{ptr}[0]"
        sizes = [f"{ptr}_n{j}" for j in range(dims[n.slot])]
        pairs = ", ".join(f"{r(i)}, {s}" for i, s in zip(a, sizes, strict=True))
        return f"ft::flex::load{len(a)}({ptr}, {pairs})"
    return f"{_HELPER[(op, n.kind)]}({', '.join(r(m) for m in a)})"


# --- The float64 reference: the same tree on torch tensors -------------------------------

def evaluate(n: Node, leaves: dict[str, torch.Tensor], captured: list[torch.Tensor]
             ) -> torch.Tensor:
    """``n`` on broadcastable float64 / int64 tensors: ``leaves`` by hook argument name,
    ``captured`` the tensors by slot (any dtype; floats are read as float64)."""
    def e(m: Node) -> torch.Tensor:
        return evaluate(m, leaves, captured)

    op, a = n.op, n.args
    device = leaves["score"].device
    if op in LEAVES:
        return leaves[op]
    if op == "const":
        dtype = {FLOAT: torch.float64, INT: torch.int64, BOOL: torch.bool}[n.kind]
        return torch.tensor(n.value, dtype=dtype, device=device)
    if op == "cast":
        return e(a[0]).to(torch.float64 if n.kind == FLOAT else torch.int64)
    if op == "load":
        t = captured[n.slot].to(device)
        t = t.to(torch.float64) if t.is_floating_point() else t.to(torch.int64)
        if not a:
            return t.reshape(())
        index = []
        for j, m in enumerate(a):
            i = e(m)
            size = t.shape[j]
            index.append(torch.where(i < 0, i + size, i).clamp(0, size - 1))
        return t[tuple(index)]
    x = [e(m) for m in a]
    if op == "add":
        return x[0] + x[1]
    if op == "sub":
        return x[0] - x[1]
    if op == "mul":
        return x[0] * x[1]
    if op == "truediv":
        return x[0] / x[1]
    if op == "floordiv":
        return (torch.div(x[0], x[1], rounding_mode="floor") if n.kind == INT
                else torch.floor(x[0] / x[1]))
    if op == "mod":
        return torch.remainder(x[0], x[1])
    if op in ("min", "max"):
        return (torch.minimum if op == "min" else torch.maximum)(x[0], x[1])
    if op in COMPARE:
        return getattr(torch, op)(x[0], x[1])  # type: ignore[no-any-return]
    if op in ("and", "or", "xor"):
        return getattr(torch, f"logical_{op}")(x[0], x[1])  # type: ignore[no-any-return]
    if op == "not":
        return torch.logical_not(x[0])
    if op == "neg":
        return -x[0]
    if op == "abs":
        return x[0].abs()
    if op == "where":
        return torch.where(x[0], x[1], x[2])
    return getattr(torch, op)(x[0])  # type: ignore[no-any-return]  # exp, log, tanh, sigmoid
