"""The forward kernel's arguments, declared once (``FWD_ABI``): the template's signature
(``templates/flash_fwd.cu.jinja``, ``hopper_fwd.cu.jinja``), the packers and the emulator's
expected signature are generated from it (``codegen.abi``).

    q, k, v (const T*), o (T*), lse (float*),
    seqlen_q, seqlen_k, heads_q, heads_kv (int32),
    q, k, v, o strides in elements: batch, row (sequence), head (int64 each, 12 in all),
    softmax_scale (float32)
    then the features' values, those of the Problem's switches only (``feature_values``):
      window: window_left, window_right (int32; -1 unbounded);
      softcap: softcap (float32, > 0);
      alibi: alibi_slopes (const float*), alibi_batch_stride (int64; 0 for (heads_q,) slopes);
      varlen: cu_seqlens_q, cu_seqlens_k (const int*), max_seqlen_q (int32), see below;
      dropout: dropout_seed, dropout_offset (int64), dropout_p (float32, in [0, 1));
      with varlen, Q, K, V and O
        are then (1, total rows, heads, head_dim) (flash-attn's packed (total, heads, dim)
        with a batch dim of 1), seqlen_q and seqlen_k their total rows, the LSE
        (heads_q, total rows of Q), and the grid (ceil(max_seqlen_q / block_m), heads_q,
        number of sequences);
      sinks: sinks (const float*; float32 (heads_q,), one logit per query head);
      declared score modifications (``codegen.score_mods``): their params, in key order.

Q/O are (batch, seqlen_q, heads_q, head_dim), K/V are (batch, seqlen_k, heads_kv,
head_dim), each with a contiguous last dim and otherwise arbitrary strides; LSE is a
contiguous float32 (batch, heads_q, seqlen_q) tensor. The grid is (ceil(seqlen_q / block_m),
heads_q, batch); a persistent kernel's has fewer blocks in x (``persistent_grid``).

The forward op's hot-path packer (``FwdPacker``, made by ``forward_packer``) is what a family
that serves ``fwd`` supplies (``KernelFamily.hot_packer``): the plan stores it once and the
torch API calls it on every call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from flashtune._lazy import lazy_module
from flashtune.codegen.abi import (
    ArgValue,
    Element,
    EntryAbi,
    PackedArgs,
    scalar,
    size,
    strides,
    tensor,
)
from flashtune.codegen.features import mods_of
from flashtune.codegen.spec import Problem
from flashtune.errors import InvalidInput

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

_Q, _KV, _O, _F, _I, _L = (Element.Q, Element.KV, Element.O, Element.FLOAT, Element.INT,
                           Element.INT64)

#: The dropout's run-time values (templates/dropout.cuh), the forward's and the backward's:
#: the generator's seed and offset (int64; the seed's 64 bits as a signed value) and p.
DROPOUT_ARGS = (
    scalar("dropout_seed", _L, feature="dropout", wrap=True),
    scalar("dropout_offset", _L, feature="dropout"),
    scalar("dropout_p", _F, feature="dropout"),
)

#: The varlen switch's packed-batch arguments, the forward's and the backward's: the int32
#: cumulative lengths of the query and key sequences (batch + 1 each, on the device).
VARLEN_ARGS = (
    tensor("cu_seqlens_q", _I, const=True, feature="varlen", wrap=True),
    tensor("cu_seqlens_k", _I, const=True, feature="varlen"),
)

#: The forward's kernel arguments (the mma.sync and the sm_90a forwards).
FWD_ABI = EntryAbi("flash_fwd", score_mods=True, args=(
    tensor("q", _Q, const=True), tensor("k", _KV, const=True),
    tensor("v", _KV, const=True, wrap=True), tensor("o", _O), tensor("lse", _F),
    scalar("seqlen_q", _I, size("q", 1), wrap=True), scalar("seqlen_k", _I, size("k", 1)),
    scalar("heads_q", _I, size("q", 2)), scalar("heads_kv", _I, size("k", 2)),
    *strides("q"), *strides("k"), *strides("v"), *strides("o"),
    scalar("softmax_scale", _F, wrap=True),
    scalar("window_left", _I, feature="window"), scalar("window_right", _I, feature="window"),
    scalar("softcap", _F, feature="softcap"),
    tensor("alibi_slopes", _F, const=True, feature="alibi", wrap=True),
    scalar("alibi_batch_stride", _L, feature="alibi"),
    *VARLEN_ARGS,
    scalar("max_seqlen_q", _I, feature="varlen", wrap=True),
    tensor("sinks", _F, const=True, feature="sinks", wrap=True),
    *DROPOUT_ARGS,
))

#: The plain forward's packer: (q, k, v, o, lse, softmax_scale) -> packed arguments.
pack_args = FWD_ABI.packer()


@dataclass(frozen=True)
class VarlenArgs:
    """The run-time values of a varlen launch: int32 cumulative lengths of the sequences
    (on the launch's device) and the longest query sequence."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int = 0  # the longest key sequence (chooses the tuning bucket)

    @property
    def batch(self) -> int:
        return int(self.cu_seqlens_q.shape[0]) - 1


@dataclass(frozen=True)
class DropoutArgs:
    """The run-time values of a dropout launch (templates/dropout.cuh): the generator's
    ``seed`` (an unsigned 64-bit value), its ``offset`` (the first of the batch * heads_q
    streams the launch draws from) and the probability ``p`` in [0, 1) of dropping an
    element."""

    seed: int
    offset: int
    p: float

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 2**64:
            raise InvalidInput(f"dropout seed={self.seed} must be in [0, 2**64)")
        if not 0 <= self.offset < 2**63:
            raise InvalidInput(f"dropout offset={self.offset} must be in [0, 2**63)")
        if not 0.0 <= self.p < 1.0:
            raise InvalidInput(f"dropout p={self.p} must be in [0, 1)")

    @property
    def signed_seed(self) -> int:
        """The seed's 64 bits as the kernel's signed int64 argument."""
        return self.seed - 2**64 if self.seed >= 2**63 else self.seed


class VariantLike(Protocol):
    """The run-time values of a call's features (``variants.VariantValues``, the runtime's
    ``Variant``)."""

    @property
    def window(self) -> tuple[int, int]: ...
    @property
    def softcap(self) -> float: ...
    @property
    def alibi_slopes(self) -> torch.Tensor | None: ...
    @property
    def varlen(self) -> VarlenArgs | None: ...
    @property
    def mods(self) -> Mapping[str, object]: ...
    @property
    def sinks(self) -> torch.Tensor | None: ...
    @property
    def dropout(self) -> DropoutArgs | None: ...


Grid = tuple[int, int, int]


class FwdPacker(Protocol):
    """The forward op's hot-path packer: the grid and packed arguments of one call on
    validated tensors (O and LSE allocated), ``variant`` the call's feature values (None:
    no features). The arguments start with the q, k and v pointers (the runtime's alignment
    check reads them)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor, softmax_scale: float, variant: VariantLike | None = None
                 ) -> tuple[Grid, PackedArgs]: ...


#: Values a family adds to the forward's inputs from q, k and v (the tensor maps of a TMA
#: kernel), by input name.
ExtraValues = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor"],
                       Mapping[str, ArgValue]]


def feature_values(problem: Problem, variant: VariantLike | None) -> dict[str, object]:
    """The packer inputs of ``problem``'s feature switches from the call's values.
    ``alibi_slopes``: float32 (heads_q,) or (batch, heads_q) with a contiguous last dim
    (required when ``problem.alibi``); ``varlen`` is required when ``problem.varlen``;
    ``sinks``: contiguous float32 (heads_q,) (required when ``problem.sinks``); ``dropout``
    is required with the ``dropout`` switch."""
    out: dict[str, object] = {}
    if problem.window:
        window = (-1, -1) if variant is None else variant.window
        out["window_left"], out["window_right"] = window
    if problem.softcap:
        out["softcap"] = 0.0 if variant is None else variant.softcap
    if problem.alibi:
        slopes = None if variant is None else variant.alibi_slopes
        if slopes is None:
            raise InvalidInput(f"{problem.key()} needs alibi_slopes: a float32 tensor (heads_q,) "
                               "or (batch, heads_q)")
        out["alibi_slopes"] = slopes
        out["alibi_batch_stride"] = slopes.stride(0) if slopes.dim() == 2 else 0
    if problem.varlen:
        varlen = None if variant is None else variant.varlen
        if varlen is None:
            raise InvalidInput(f"{problem.key()} needs cu_seqlens_q, cu_seqlens_k and "
                               "max_seqlen_q")
        out["cu_seqlens_q"] = varlen.cu_seqlens_q
        out["cu_seqlens_k"] = varlen.cu_seqlens_k
        out["max_seqlen_q"] = varlen.max_seqlen_q
    if problem.sinks:
        sinks = None if variant is None else variant.sinks
        if sinks is None:
            raise InvalidInput(f"{problem.key()} needs sinks: a float32 tensor (heads_q,)")
        out["sinks"] = sinks
    if problem.has("dropout"):
        dropout = None if variant is None else variant.dropout
        if dropout is None:
            raise InvalidInput(f"{problem.key()} needs the dropout's seed, offset and p")
        out["dropout_seed"] = dropout.signed_seed
        out["dropout_offset"] = dropout.offset
        out["dropout_p"] = dropout.p
    for name, mod in mods_of(problem.features):
        for p in mod.params:
            if variant is None or p.name not in variant.mods:
                raise InvalidInput(f"{problem.key()} needs the value of {p.name!r} (a "
                                   f"{p.type} param of the score modification {name!r})")
            out[p.name] = variant.mods[p.name]
    return out


def forward_packer(abi: EntryAbi, problem: Problem, block_m: int,
                   extra: ExtraValues | None = None) -> FwdPacker:
    """The hot-path packer of ``problem`` on a kernel of ``abi`` with query tiles of
    ``block_m`` rows: the generated packer of the problem's feature switches, fed from the
    call's tensors, its feature values and ``extra``. A plain problem's packer is the
    generated one with the grid beside it: the warm call's one pack."""
    features = problem.features
    pack = abi.packer(features)
    if not features and extra is None:
        def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  lse: torch.Tensor, softmax_scale: float,
                  variant: VariantLike | None = None) -> tuple[Grid, PackedArgs]:
            batch, seqlen_q, heads_q, _ = q.shape
            return ((-(-seqlen_q // block_m), heads_q, batch),
                    pack(q, k, v, o, lse, softmax_scale))
        return plain
    names = abi.inputs(features)

    def general(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                lse: torch.Tensor, softmax_scale: float,
                variant: VariantLike | None = None) -> tuple[Grid, PackedArgs]:
        values: dict[str, object] = {"q": q, "k": k, "v": v, "o": o, "lse": lse,
                                     "softmax_scale": softmax_scale,
                                     **feature_values(problem, variant)}
        if extra is not None:
            values.update(extra(q, k, v))
        batch, seqlen_q, heads_q, _ = q.shape
        varlen = variant.varlen if variant is not None and problem.varlen else None
        if varlen is not None:
            batch, seqlen_q = varlen.batch, varlen.max_seqlen_q
        return ((-(-seqlen_q // block_m), heads_q, batch),
                pack(*(values[n] for n in names)))
    return general


#: A persistent launch fills each SM with at least this many blocks (the residency the
#: default tiles aim for), or with the config's ``minblocks`` where that is larger.
PERSISTENT_BLOCKS_PER_SM = 2
