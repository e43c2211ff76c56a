"""Score modifications as declarations: the device hook, run-time values and reference of a
feature that changes attention scores (``Feature.score``).

A ``ScoreMod`` is FlexAttention's ``score_mod`` written once for both sides: ``cuda`` is a
C++ expression of the scaled score ``score`` (``softmax_scale * q.k``, after the built-in
transforms: softcap, then ALiBi), the ints ``batch``, ``head`` (the query head), ``q_idx``
and ``kv_idx`` (the row and key within their sequence, varlen included) and its ``params``
(run-time scalars); its value is the new scaled score. ``reference`` computes the same in
float64 on broadcastable tensors: ``reference(score, batch, head, q_idx, kv_idx, **values)``
with score (B, H, Nq, Nk) and index tensors of shapes (B, 1, 1, 1), (1, H, 1, 1),
(1, 1, Nq, 1) and (1, 1, 1, Nk). ``ModParam.draws`` are the values verification picks from.

A family that takes declared modifications (``KernelFamily.score_mods``) renders the
problem's ones into one functor (``render_functor``), appends their params to its kernel's
arguments (``codegen.abi``: an ``EntryAbi`` with ``score_mods``), and applies the functor to
every score before the mask; masked scores stay hidden whatever a modification returns.
"""

from __future__ import annotations

import keyword
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flashtune.errors import InvalidProblem

if TYPE_CHECKING:
    import torch

#: The names a modification's expression reads besides its params.
HOOK_ARGUMENTS = ("score", "batch", "head", "q_idx", "kv_idx")
#: The C++ type of each param type: run-time scalars, and captured tensors (contiguous
#: float32 or int32 on the launch's device, ``codegen.trace``).
#: ``tiles``: a block mask's key tile ranges, int32 (Bm, Hm, query tiles, 4) read by
#: ``ft::flex::tile_range`` (its dims: the three sizes): per query tile the key tiles
#: [lo, hi) it walks (it skips the others) and [full_lo, full_hi) among them whose every key
#: every row sees (the modification's ``mask`` is not evaluated there).
PARAM_TYPES = {"float": "float", "int": "int", "float_ptr": "const float*",
               "int_ptr": "const int*", "tiles": "const int*"}
#: The param types that are tensors.
POINTER_TYPES = frozenset({"float_ptr", "int_ptr", "tiles"})

#: ``reference(score, batch, head, q_idx, kv_idx, **values)`` -> the modified score.
Reference = Callable[..., "torch.Tensor"]


@dataclass(frozen=True)
class ModParam:
    """A run-time value of a modification: its name (a kernel argument: unique among the
    registered features' params), its type (``float`` or ``int``: float32 or int32; or a
    captured tensor, ``float_ptr`` or ``int_ptr``) and the values verification draws from;
    a tensor's ``dims`` name the int params that hold its sizes (verification draws a
    random tensor of those sizes)."""

    name: str
    type: str = "float"
    draws: tuple[float, ...] = (0.5,)
    dims: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "draws", tuple(self.draws))
        object.__setattr__(self, "dims", tuple(self.dims))
        if self.dims and self.type not in POINTER_TYPES:
            raise InvalidProblem(f"param {self.name!r} of type {self.type!r} has dims; only "
                                 f"tensors ({sorted(POINTER_TYPES)}) have sizes")
        if self.type == "tiles" and len(self.dims) != 3:
            raise InvalidProblem(f"tile ranges {self.name!r} need the names of their three "
                                 f"sizes (batch, head, query tile) as dims, got {self.dims}")
        if (not self.name.isidentifier() or keyword.iskeyword(self.name)
                or self.name.startswith("_") or self.name in HOOK_ARGUMENTS):
            raise InvalidProblem(f"score modification param {self.name!r} must be an "
                                 "identifier that does not start with an underscore and is "
                                 f"not one of {list(HOOK_ARGUMENTS)}, e.g. 'bias'")
        if self.type not in PARAM_TYPES:
            raise InvalidProblem(f"param {self.name!r} has type {self.type!r}; expected one "
                                 f"of {sorted(PARAM_TYPES)}")
        if not self.draws:
            raise InvalidProblem(f"param {self.name!r} needs at least one value to draw for "
                                 "verification (draws=...)")
        if self.type == "int" and any(float(v) != int(v) for v in self.draws):
            raise InvalidProblem(f"int param {self.name!r} draws {self.draws}: expected "
                                 "whole numbers")


@dataclass(frozen=True)
class ScoreMod:
    """The device hook, params and float64 reference of one score modification (see the
    module doc)."""

    cuda: str
    reference: Reference
    params: tuple[ModParam, ...] = ()
    #: A C++ bool expression of ``batch``, ``head``, ``q_idx``, ``kv_idx`` and the params:
    #: False hides the key. Evaluated only on the key tiles a ``tiles`` param marks partial
    #: (so it needs one); ``reference`` includes it.
    mask: str = ""
    #: A C++ float expression of the same names: d(cuda) / d(score), the factor the
    #: backward multiplies dS by. Empty: the modification has no backward.
    grad: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(self.params))
        for text in (self.cuda, self.mask or "true", self.grad or "1.0f"):
            if not text.strip() or any(c in text for c in ";{}\n"):
                raise InvalidProblem(f"score modification {text!r} must be one C++ "
                                     "expression (no ';', braces or line breaks), e.g. "
                                     "'score + bias'")
        if self.mask and not any(p.type == "tiles" for p in self.params):
            raise InvalidProblem("a score modification with a mask needs a 'tiles' param "
                                 "(the key tiles where the mask is evaluated)")
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise InvalidProblem(f"score modification params {names} repeat a name")

    def apply(self, score: torch.Tensor, batch: torch.Tensor, head: torch.Tensor,
              q_idx: torch.Tensor, kv_idx: torch.Tensor, values: dict[str, Any]
              ) -> torch.Tensor:
        """The float64 reference on one batch of scores, with this modification's values
        taken from ``values`` by name (KeyError naming a missing one)."""
        missing = [p.name for p in self.params if p.name not in values]
        if missing:
            raise KeyError(f"score modification values {missing} are missing")
        mine = {p.name: values[p.name] for p in self.params}
        return self.reference(score, batch, head, q_idx, kv_idx, **mine)


def render_functor(mods: Sequence[tuple[str, ScoreMod]]) -> str:
    """The C++ functor ``ScoreMods`` applying ``mods`` ((feature name, modification), in
    key order) to a scaled score: its params as members, in order (``functor_values``)."""
    members = "".join(f"  {PARAM_TYPES[p.type]} {p.name};\n" for _, mod in mods
                      for p in mod.params)
    steps = "".join(f"    score = ({mod.cuda});  // {name}\n" for name, mod in mods)
    unused = "".join(f"    (void){a};\n" for a in HOOK_ARGUMENTS[1:])
    tiles = [p for _, mod in mods for p in mod.params if p.type == "tiles"]
    if len(tiles) > 1:
        raise InvalidProblem(f"score modifications {[p.name for p in tiles]} each bring key "
                             "tile ranges; a kernel takes one block mask")
    ranges = "".join(
        "  // The key tiles [lo, hi) query tile m_block of (batch, head) walks, and the full\n"
        "  // ones [full_lo, full_hi) among them.\n"
        "  __device__ __forceinline__ void tile_range(int batch, int head, int m_block,\n"
        "                                             int& lo, int& hi, int& full_lo,\n"
        "                                             int& full_hi) const {\n"
        f"    ft::flex::tile_range({p.name}, {', '.join(p.dims)}, batch, head, m_block, lo, "
        "hi,\n"
        "                         full_lo, full_hi);\n"
        "  }\n" for p in tiles)
    masks = [mod.mask for _, mod in mods if mod.mask]
    keep = ("  // Whether key kv_idx is visible to query q_idx (evaluated on partial tiles).\n"
            "  __device__ __forceinline__ bool keep(int batch, int head, int q_idx,\n"
            "                                       int kv_idx) const {\n"
            f"{unused}"
            f"    return {' && '.join(f'({m})' for m in masks) or 'true'};\n"
            "  }\n") if tiles else ""
    differentiable = all(mod.grad for _, mod in mods)
    # The chain rule over the modifications in key order: each one's slope at the score it
    # is given, times the slopes before it.
    chain = "".join(f"    slope *= ({mod.grad});  // {name}\n"
                    + (f"    score = ({mod.cuda});\n" if i + 1 < len(mods) else "")
                    for i, (name, mod) in enumerate(mods))
    grad = ("  // d(operator()) / d(score) at the same arguments (the backward's slope).\n"
            "  __device__ __forceinline__ float grad(float score, int batch, int head,\n"
            "                                        int q_idx, int kv_idx) const {\n"
            f"{unused}"
            "    (void)score;\n"
            "    float slope = 1.0f;\n"
            f"{chain}"
            "    return slope;\n"
            "  }\n") if differentiable else ""
    return ("// The problem's declared score modifications (codegen.score_mods), in key order,\n"
            "// on the scaled score of query row q_idx and key kv_idx of (batch, head).\n"
            "struct ScoreMods {\n"
            "  static constexpr bool kOn = true;\n"
            f"  static constexpr bool kTileRanges = {'true' if tiles else 'false'};\n"
            f"  static constexpr bool kGrad = {'true' if differentiable else 'false'};\n"
            f"{members}"
            f"{ranges}"
            f"{keep}"
            "  __device__ __forceinline__ float operator()(float score, int batch, int head,\n"
            "                                              int q_idx, int kv_idx) const {\n"
            f"{unused}{steps}"
            "    return score;\n"
            "  }\n"
            f"{grad}"
            "};")


def functor_values(mods: Sequence[tuple[str, ScoreMod]]) -> str:
    """The kernel arguments that initialise ``render_functor``'s members, in order."""
    return ", ".join(p.name for _, mod in mods for p in mod.params)
