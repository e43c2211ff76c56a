"""Derivatives of traced modifications (``codegen.trace``): the backward's view of an
expression tree.

``derivative(n, wrt)`` is the tree of d n / d wrt, built by forward-mode symbolic
differentiation over the traced operation set, where ``wrt`` is the ``score`` leaf or one
captured-tensor load (a ``load`` node: one element of a captured float tensor, at its index
expressions). Zero is represented by ``None`` and products with constant ones are folded, so
the derivative of ``score + bias[h, q_idx - kv_idx]`` by the score is the constant 1.

The rules are torch autograd's, so the float64 reference (torch autograd of
``trace_expr.evaluate``) and the kernel agree everywhere, kinks included: ``abs`` has slope
0 at 0, ``minimum`` / ``maximum`` split the slope evenly on ties, ``where`` passes the
slope of the branch it takes, comparisons and int or bool values have none, float ``%``
(``remainder``) has slope 1 in its dividend and ``-floor(a / b)`` in its divisor.

Refused (``NotDifferentiable``, naming the operation and the line of the user's function
that did it): a float floor division whose operand depends on the differentiated value
(its slope is 0 almost everywhere and undefined at each step, so a gradient through it is
almost surely a mistake; torch refuses it too).

The derivative trees use the traced operations only, so ``trace_expr.render`` turns them
into CUDA expressions from its own tokens and ``trace_expr.evaluate`` computes them in
float64, exactly like the modifications themselves.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from flashtune._lazy import lazy_module
from flashtune.codegen.trace_expr import BOOL, FLOAT, Node, evaluate
from flashtune.errors import InvalidInput

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


class NotDifferentiable(InvalidInput):
    """A modification whose derivative the backward does not support (see the module
    doc)."""


ONE = Node("const", (), FLOAT, 1.0)
ZERO = Node("const", (), FLOAT, 0.0)
_HALF = Node("const", (), FLOAT, 0.5)


def _f(op: str, *args: Node) -> Node:
    return Node(op, args, FLOAT)


def _mul(a: Node | None, b: Node | None) -> Node | None:
    if a is None or b is None:
        return None
    if a == ONE:
        return b
    if b == ONE:
        return a
    return _f("mul", a, b)


def _add(a: Node | None, b: Node | None) -> Node | None:
    if a is None:
        return b
    if b is None:
        return a
    return _f("add", a, b)


def _neg(a: Node | None) -> Node | None:
    return None if a is None else _f("neg", a)


def _sub(a: Node | None, b: Node | None) -> Node | None:
    return _add(a, _neg(b))


def _dense(a: Node | None) -> Node:
    """``a`` with zero spelled out (a branch of ``where``)."""
    return ZERO if a is None else a


def _gt0(x: Node) -> Node:
    return Node("gt", (x, ZERO), BOOL)


def _lt0(x: Node) -> Node:
    return Node("lt", (x, ZERO), BOOL)


def derivative(n: Node, wrt: Node) -> Node | None:
    """d n / d ``wrt`` as a float tree (None: identically zero); ``wrt`` is the score leaf
    or a float ``load`` node of ``n``. NotDifferentiable for an operation without a
    supported derivative on a path that depends on ``wrt``."""
    if n == wrt:
        return ONE
    if n.kind != FLOAT or not n.args:
        return None  # int and bool values, other leaves, constants, other loads
    op, a = n.op, n.args
    if op == "cast" or op == "load":
        return None  # an int or bool made float; a load's indices are ints
    d = [derivative(m, wrt) for m in a]
    if all(x is None for x in d):
        return None
    if op == "add":
        return _add(d[0], d[1])
    if op == "sub":
        return _sub(d[0], d[1])
    if op == "mul":
        return _add(_mul(d[0], a[1]), _mul(a[0], d[1]))
    if op == "truediv":
        # (a / b)' = a' / b - a b' / b^2
        first = None if d[0] is None else _f("truediv", d[0], a[1])
        second = (None if d[1] is None else
                  _f("truediv", _mul(a[0], d[1]) or ZERO, _f("mul", a[1], a[1])))
        return _sub(first, second)
    if op == "neg":
        return _neg(d[0])
    if op == "abs":  # sign(a) a', 0 at a = 0 (torch's)
        return Node("where", (_gt0(a[0]), _dense(d[0]), Node("where", (
            _lt0(a[0]), _dense(_neg(d[0])), ZERO), FLOAT)), FLOAT)
    if op in ("min", "max"):  # the taken side's slope; ties split evenly (torch's)
        first_wins = Node("lt" if op == "min" else "gt", (a[0], a[1]), BOOL)
        second_wins = Node("gt" if op == "min" else "lt", (a[0], a[1]), BOOL)
        tie = _mul(_HALF, _add(d[0], d[1]))
        return Node("where", (first_wins, _dense(d[0]), Node("where", (
            second_wins, _dense(d[1]), _dense(tie)), FLOAT)), FLOAT)
    if op == "where":
        return Node("where", (a[0], _dense(d[1]), _dense(d[2])), FLOAT)
    if op == "exp":
        return _mul(d[0], n)
    if op == "log":
        return _f("truediv", _dense(d[0]), a[0])
    if op == "tanh":  # (1 - tanh^2) a'
        return _mul(d[0], _f("sub", ONE, _f("mul", n, n)))
    if op == "sigmoid":  # s (1 - s) a'
        return _mul(d[0], _f("mul", n, _f("sub", ONE, n)))
    if op == "mod":  # remainder(a, b)' = a' - floor(a / b) b'
        return _sub(d[0], _mul(_f("floordiv", a[0], a[1]), d[1]))
    where = f" at {n.line}" if n.line else ""
    raise NotDifferentiable(
        f"the backward cannot differentiate a float {_OP_NAMES.get(op, op)}{where}: its "
        "operand depends on the score or on a captured tensor that requires grad, and its "
        "slope is zero almost everywhere. Detach that part (compute it from the index "
        "arguments only), or pass inputs that do not require grad")


_OP_NAMES = {"floordiv": "floor division (//)"}


def float_loads(n: Node, slots: frozenset[int]) -> tuple[Node, ...]:
    """The distinct float ``load`` nodes of ``n`` reading the captured tensors ``slots``,
    in first-visit order (equal index expressions are one load)."""
    found: dict[Node, None] = {}

    def visit(m: Node) -> None:
        if m.op == "load" and m.kind == FLOAT and m.slot in slots:
            found.setdefault(m, None)
        for arg in m.args:
            visit(arg)
    visit(n)
    return tuple(found)


def _flat_index(load: Node, leaves: dict[str, torch.Tensor], captured: list[torch.Tensor],
                sizes: tuple[int, ...]) -> torch.Tensor:
    """The flat element index a ``load`` reads at every position (int64, broadcast from the
    leaves): each index counted from the end when negative, then clamped, as the kernel
    and ``trace_expr.evaluate`` read it."""
    flat = torch.zeros((), dtype=torch.int64, device=leaves["batch"].device)
    for node, size in zip(load.args, sizes, strict=True):
        i = evaluate(node, leaves, captured).to(torch.int64)
        flat = flat * size + torch.where(i < 0, i + size, i).clamp(0, size - 1)
    return flat


#: Score positions one step of ``captured_grads`` reduces at once (bounds its memory).
CHUNK_ELEMENTS = 1 << 22


def captured_grads(expression: Node, captured: Sequence[torch.Tensor], wanted: Iterable[int],
                   dscore: torch.Tensor, score: torch.Tensor | None = None,
                   first_batch: int = 0) -> dict[int, torch.Tensor]:
    """The gradients of the captured tensors ``wanted`` (slots of float tensors), float64
    like each tensor, from ``dscore`` (B, Hq, Nq, Nk): the gradient of the loss by the
    modified score at every position (the backward kernel's buffer; 0 where hidden).

    Per distinct load of a wanted tensor: its derivative tree evaluated on the dense grid
    (``score``: the unmodified scaled scores (B, Hq, Nq, Nk), needed only when a derivative
    reads the score; None otherwise), times ``dscore``, summed per element the load reads
    (``fixed_order_sum``), a block of query rows at a time (at most ``CHUNK_ELEMENTS``
    positions), the blocks' sums added in order: the same buffer gives the same bits on
    every run and device schedule, with no atomics."""
    slots = frozenset(wanted)
    batch, heads, rows, keys = dscore.shape
    device = dscore.device
    values = [t.detach().to(device) for t in captured]
    slopes = []
    for load in float_loads(expression, slots):
        slope = derivative(expression, load)
        if slope is None:
            continue
        if score is None and reads_score(slope):
            raise InvalidInput("the derivative by a captured tensor reads the score; pass "
                               "the unmodified scaled scores as score=")
        slopes.append((load, slope))
    out = {s: torch.zeros(captured[s].numel(), dtype=torch.float64, device=device)
           for s in slots}
    step = max(1, CHUNK_ELEMENTS // max(1, batch * heads * keys))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        leaves = {
            "batch": torch.arange(first_batch, first_batch + batch, device=device)
            .view(-1, 1, 1, 1), "head": torch.arange(heads, device=device).view(1, -1, 1, 1),
            "q_idx": torch.arange(r0, r1, device=device).view(1, 1, -1, 1),
            "kv_idx": torch.arange(keys, device=device).view(1, 1, 1, -1),
            "score": (score[:, :, r0:r1].to(torch.float64) if score is not None
                      else torch.full((), math.nan, dtype=torch.float64, device=device))}
        upstream = dscore[:, :, r0:r1].to(torch.float64)
        parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {s: [] for s in slots}
        for load, slope in slopes:
            contribution = upstream * evaluate(slope, leaves, values)
            # A hidden position (dscore 0) adds nothing, whatever its slope (inf, NaN).
            contribution = torch.where(upstream == 0, 0.0, contribution)
            index = _flat_index(load, leaves, values, tuple(captured[load.slot].shape))
            shape = (index + torch.zeros_like(contribution, dtype=torch.int64)).shape
            parts[load.slot].append((index.expand(shape).reshape(-1),
                                     contribution.expand(shape).reshape(-1)))
        for slot, found in parts.items():
            if found:
                out[slot] += fixed_order_sum(torch.cat([i for i, _ in found]),
                                             torch.cat([c for _, c in found]),
                                             captured[slot].numel())
    return {s: g.view(captured[s].shape) for s, g in out.items()}


def fixed_order_sum(index: torch.Tensor, values: torch.Tensor, size: int) -> torch.Tensor:
    """float64 (size,): per element the sum of ``values`` whose ``index`` is it, in an order
    fixed by the data alone: the pairs stably sorted by index, then a segmented scan by
    doubling (step d adds the partial sum d places back when it is of the same element; a
    fixed tree of elementwise float64 additions), then each element written once from the
    last place of its run. No atomics and no float scan of torch's (whose CUDA form is not
    deterministic), so ``torch.use_deterministic_algorithms`` accepts every step."""
    order = torch.sort(index, stable=True)
    keys = order.values
    sums = values[order.indices].to(torch.float64)
    step = 1
    while step < keys.numel():
        same = keys[step:] == keys[:-step]
        sums = torch.cat((sums[:step], torch.where(same, sums[step:] + sums[:-step],
                                                   sums[step:])))
        step *= 2
    last = torch.ones_like(keys, dtype=torch.bool)
    last[:-1] = keys[1:] != keys[:-1]
    out = torch.zeros(size, dtype=torch.float64, device=values.device)
    out[keys[last]] = sums[last]
    return out


def reads_score(n: Node | None) -> bool:
    """Whether tree ``n`` reads the score leaf."""
    return n is not None and (n.op == "score" or any(reads_score(m) for m in n.args))
