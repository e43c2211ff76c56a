"""The forward's attention features on the family side: what the template binds, the
run-time values a launch passes, and random values for verification.

A Problem's feature switches (``window``, ``softcap``, ``alibi``, ``sinks``, ``dropout``)
are compiled in; their values (window sizes, the cap, the slopes, the sinks, the dropout's
seed, offset and p) are run-time arguments (``args.feature_values``). In an ``Inputs`` they
are the scalars ``window_left``, ``window_right``, ``softcap``, ``max_seqlen_q``,
``dropout_seed``, ``dropout_offset``, ``dropout_p`` and the tensors ``alibi_slopes``,
``cu_seqlens_q``, ``cu_seqlens_k``, ``sinks``. A
varlen launch's q, k, v are packed as (1, total rows, heads, head_dim); ``Shape`` then gives
the number of sequences and the longest query and key sequences.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flashtune._lazy import lazy_module
from flashtune.codegen.features import mods_of
from flashtune.codegen.render import TemplateValue
from flashtune.codegen.score_mods import POINTER_TYPES, functor_values, render_functor
from flashtune.codegen.spec import FEATURES, Problem, Shape, ShapeLike
from flashtune.families.base import Inputs, random_rows
from flashtune.families.fwd.args import DropoutArgs, VarlenArgs
from flashtune.families.fwd.dropout import DROPOUT_PS

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

#: Window sizes flash-attn's tests draw from (plus -1, unbounded), and its softcap values.
WINDOW_SIZES = (-1, 0, 1, 3, 16, 64, 100, 256)
SOFTCAPS = (5.0, 30.0, 50.0)

#: Template parameter of each feature switch.
_TEMPLATE_NAMES = {"window": "local", "softcap": "softcap", "alibi": "alibi",
                   "varlen": "varlen", "sinks": "sinks", "dropout": "dropout"}


@dataclass(frozen=True)
class VariantValues:
    """The run-time values of the features of one call (unused ones keep these defaults)."""

    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    varlen: VarlenArgs | None = None
    #: The params of declared score modifications (``codegen.score_mods``) by name
    #: (numbers, and tensors for captured ones).
    mods: Mapping[str, object] = field(default_factory=dict)
    #: Attention sinks: float32 (heads_q,).
    sinks: torch.Tensor | None = None
    dropout: DropoutArgs | None = None

    @classmethod
    def of(cls, inputs: Inputs) -> VariantValues:
        """The values an ``Inputs`` carries (absent ones: the defaults)."""
        s = inputs.scalars
        t = inputs.tensors
        varlen = (VarlenArgs(t["cu_seqlens_q"], t["cu_seqlens_k"], int(s["max_seqlen_q"]))
                  if "cu_seqlens_q" in t else None)
        mods: dict[str, object] = {p.name: s[p.name] if p.name in s else t[p.name]
                                   for _, mod in mods_of(FEATURES) for p in mod.params
                                   if p.name in s or p.name in t}
        dropout = (DropoutArgs(int(s["dropout_seed"]), int(s["dropout_offset"]),
                               float(s["dropout_p"])) if "dropout_seed" in s else None)
        return cls((int(s.get("window_left", -1)), int(s.get("window_right", -1))),
                   float(s.get("softcap", 0.0)), t.get("alibi_slopes"), varlen, mods,
                   t.get("sinks"), dropout)

    def only(self, problem: Problem) -> VariantValues:
        """These values with those of features ``problem`` does not switch on reset."""
        return VariantValues(self.window if problem.window else (-1, -1),
                             self.softcap if problem.softcap else 0.0,
                             self.alibi_slopes if problem.alibi else None,
                             self.varlen if problem.varlen else None,
                             {p.name: self.mods[p.name]
                              for _, mod in mods_of(problem.features)
                              for p in mod.params if p.name in self.mods},
                             self.sinks if problem.sinks else None,
                             self.dropout if problem.has("dropout") else None)


def template_params(problem: Problem) -> dict[str, TemplateValue]:
    """The template switches of ``problem``'s features (none for a plain problem, so that
    its source is the same as before features existed): the built-ins' switches, and the
    declared score modifications' functor (``score_mods``) with the arguments that
    initialise it (``score_mod_values``)."""
    params: dict[str, TemplateValue] = {_TEMPLATE_NAMES[name]: True
                                        for name in problem.features if name in _TEMPLATE_NAMES}
    mods = mods_of(problem.features)
    if mods:
        params["score_mods"] = render_functor(mods)
        params["score_mod_values"] = functor_values(mods)
    return params


def random_values(problem: Problem, shape: ShapeLike, gen: torch.Generator,
                  device: torch.device | str) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Random feature values for ``problem`` (scalars, tensors), drawn with ``gen``: window
    sizes from WINDOW_SIZES (not both unbounded), a cap from SOFTCAPS, ALiBi slopes in
    [0, 1) of shape (batch, heads_q), sinks (``random_sinks``), a dropout seed (64 bits),
    offset and p (from DROPOUT_PS), and each declared score modification's params from
    their ``draws`` (a captured tensor: random values, normal floats or ints by
    ``random_ints``, of the sizes its ``dims`` params drew; a block mask's tile ranges:
    every key tile)."""
    scalars: dict[str, float] = {}
    tensors: dict[str, torch.Tensor] = {}

    def pick(values: tuple[float, ...]) -> float:
        return values[int(torch.randint(len(values), (1,), generator=gen, device=device))]

    if problem.window:
        left, right = -1, -1
        while (left, right) == (-1, -1):
            left, right = int(pick(WINDOW_SIZES)), int(pick(WINDOW_SIZES))
        scalars.update(window_left=left, window_right=right)
    if problem.softcap:
        scalars["softcap"] = pick(SOFTCAPS)
    if problem.alibi:
        tensors["alibi_slopes"] = torch.rand(shape.batch, shape.heads_q, generator=gen,
                                             device=device)
    if problem.sinks:
        tensors["sinks"] = random_sinks(shape.heads_q, gen, device)
    if problem.has("dropout"):
        words = torch.randint(2**31, (4,), generator=gen, device=device).tolist()
        scalars.update(dropout_seed=words[0] << 33 | words[1] << 2 | words[2] & 3,
                       dropout_offset=words[3], dropout_p=pick(DROPOUT_PS))
    for _, mod in mods_of(problem.features):
        for p in mod.params:
            if p.type not in POINTER_TYPES:
                scalars[p.name] = pick(p.draws) if p.type == "float" else int(pick(p.draws))
        for p in mod.params:  # captured tensors: random ones of their drawn sizes
            sizes = [int(scalars[d]) for d in p.dims]
            if p.type == "tiles":  # every key tile walked and partial (the mask everywhere):
                # as many tiles as the smallest tile (16 keys) makes
                whole = torch.tensor([0, -(-shape.seqlen_k // 16), 0, 0], dtype=torch.int32,
                                     device=device)
                tensors[p.name] = whole.expand(*sizes, 4).contiguous()
            elif p.type == "float_ptr":
                tensors[p.name] = torch.randn(sizes, generator=gen, device=device)
            elif p.type == "int_ptr":
                tensors[p.name] = random_ints(sizes, shape, gen, device)
    return scalars, tensors


def random_ints(sizes: list[int], shape: ShapeLike, gen: torch.Generator,
                device: torch.device | str) -> torch.Tensor:
    """A captured int tensor's verification values: each element, by a coin, a small int in
    [0, 4) (ids that repeat: document ids, table indices) or a position in [0, longest
    sequence] (bounds that cut rows: FlashMask's column ends, prefix lengths). Small ints
    alone would leave a bound-like tensor hiding every row past the third (zero outputs
    that any config matches); an index past a tensor's end is clamped, as in the kernel."""
    small = torch.randint(4, sizes, generator=gen, device=device, dtype=torch.int32)
    span = max(shape.seqlen_q, shape.seqlen_k) + 1
    wide = torch.randint(span, sizes, generator=gen, device=device, dtype=torch.int32)
    return torch.where(torch.rand(sizes, generator=gen, device=device) < 0.5, wide, small)


def random_sinks(heads_q: int, gen: torch.Generator, device: torch.device | str
                 ) -> torch.Tensor:
    """float32 sinks (heads_q,): normal with a spread of 3 around 1, so that some heads' sink
    outweighs a row's scores (the LSE of N(0, 1) logits over a few hundred keys is about 6)
    and some is negligible, and one head's sink is 8, larger than most rows' LSE."""
    sinks = torch.randn(heads_q, generator=gen, device=device) * 3 + 1
    sinks[int(torch.randint(heads_q, (), generator=gen, device=device))] = 8.0
    return sinks


def random_lengths(count: int, longest: int, gen: torch.Generator) -> list[int]:
    """``count`` sequence lengths in [0, longest], the first one ``longest``: the rest
    mostly short (up to longest // 8; zero-length ones included), a quarter of them long."""
    lengths = [longest]
    for _ in range(count - 1):
        long = float(torch.rand((), generator=gen)) < 0.25
        top = longest if long else max(1, longest // 8)
        lengths.append(int(torch.randint(top + 1, (), generator=gen)))
    return lengths


def cumulative(lengths: list[int], device: torch.device | str) -> torch.Tensor:
    """int32 cumulative lengths (0, l0, l0 + l1, ...)."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def random_varlen(problem: Problem, shape: Shape, gen: torch.Generator,
                  device: torch.device | str) -> tuple[dict[str, torch.Tensor], float]:
    """Packed q, k, v (1, total, heads, head_dim) of ``shape.batch`` sequences of random
    lengths up to the shape's (self-attention lengths when they are equal), their
    cumulative lengths, and the longest query sequence."""
    gen_cpu = torch.Generator().manual_seed(int(torch.randint(2**62, (), generator=gen)))
    lens_q = random_lengths(shape.batch, shape.seqlen_q, gen_cpu)
    lens_k = (lens_q if shape.seqlen_q == shape.seqlen_k
              else random_lengths(shape.batch, shape.seqlen_k, gen_cpu))
    packed = Shape(1, shape.heads_q, shape.heads_kv, max(1, sum(lens_q)), max(1, sum(lens_k)))
    tensors = {"q": random_rows(problem, packed, sum(lens_q), shape.heads_q, gen, device),
               "k": random_rows(problem, packed, sum(lens_k), shape.heads_kv, gen, device),
               "v": random_rows(problem, packed, sum(lens_k), shape.heads_kv, gen, device,
                                problem.v_head_dim),
               "cu_seqlens_q": cumulative(lens_q, device),
               "cu_seqlens_k": cumulative(lens_k, device)}
    return tensors, float(max(lens_q))
