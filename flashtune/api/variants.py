"""The attention features of one API call: validation, normalisation, and refusal where a
kernel family does not implement them.

The keyword arguments are flash-attn's: ``window_size=(left, right)`` (-1: unbounded on that
side; ``causal=True`` is the window (-1, 0) and, with a window, sets its right side to 0),
``softcap`` (None or 0.0, flash-attn's default: off; else a cap > 0) and ``alibi_slopes``
(float32 (heads_q,) or (batch, heads_q) on the tensors' device), and gpt-oss's ``sinks``
(float32 (heads_q,) on the tensors' device, ``check_sinks``). ``resolve`` turns them
into a ``Variant``: the compile-time feature switches of the Problem and the run-time values
of the launch.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from flashtune import families
from flashtune.codegen.spec import MAX_HEAD_DIM, Problem
from flashtune.errors import FeatureNotSupported, InvalidInput
from flashtune.families.base import element_type
from flashtune.families.fwd.args import DropoutArgs, VarlenArgs

NO_WINDOW = (-1, -1)


@dataclass(frozen=True)
class Variant:
    """The features of one call after validation: ``causal`` and a ``window`` exclude each
    other (a causal window is (left, 0)); a window of (-1, -1), a softcap of 0.0 and no
    slopes mean the feature is off."""

    causal: bool
    window: tuple[int, int] = NO_WINDOW
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    varlen: VarlenArgs | None = None
    #: The params of declared score modifications by name (numbers, and tensors for
    #: captured ones of traced modifications).
    mods: Mapping[str, object] = field(default_factory=dict)
    #: Attention sinks: float32 (heads_q,), one logit per query head (``check_sinks``).
    sinks: torch.Tensor | None = None
    #: The features of traced score and mask modifications (``api.flex``), registered
    #: after the built-ins, so last in key order.
    traced: tuple[str, ...] = ()
    #: The dropout's seed, offset and p (None: no dropout).
    dropout: DropoutArgs | None = None

    @property
    def features(self) -> tuple[str, ...]:
        """The Problem feature switches this call needs, in key order."""
        on = (("window", self.window != NO_WINDOW), ("softcap", self.softcap > 0.0),
              ("alibi", self.alibi_slopes is not None), ("varlen", self.varlen is not None),
              ("sinks", self.sinks is not None), ("dropout", self.dropout is not None))
        return tuple(name for name, flag in on if flag) + self.traced


def check_window_size(window_size: object) -> tuple[int, int]:
    """(left, right) as ints >= -1; InvalidInput otherwise."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, numbers.Integral)
                   for w in window_size)):
        raise InvalidInput(f"window_size={window_size!r} must be a pair of ints (left, right), "
                           "e.g. (256, 0) for a causal sliding window of 256 keys; -1 means "
                           "unbounded on that side")
    left, right = int(window_size[0]), int(window_size[1])
    if left < -1 or right < -1:
        raise InvalidInput(f"window_size={tuple(window_size)!r} has a size below -1; expected "
                           "-1 (unbounded) or a number of keys >= 0 on each side")
    return left, right


def check_softcap(softcap: object) -> float:
    """The cap as a float (0.0, no softcapping, for None and for 0.0: flash-attn's default
    means off, so its callers' ``softcap=0.0`` is the plain kernel, with the plain key);
    InvalidInput unless None, 0 or finite > 0."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise InvalidInput(f"softcap={softcap!r} must be a float > 0 (scores become "
                           "softcap * tanh(scores / softcap)) or None for no softcapping")
    cap = float(softcap)
    if cap == 0.0:
        return 0.0
    if not (math.isfinite(cap) and cap > 0.0):
        raise InvalidInput(f"softcap={softcap!r} is not a finite number > 0; expected e.g. "
                           "softcap=30.0, or softcap=None (or 0.0) for no softcapping")
    return cap


def _float32_tensor(name: str, value: object, q: torch.Tensor,
                    shapes: tuple[tuple[int, ...], ...], of_shape: str, shape_is: str,
                    convert: str) -> torch.Tensor | None:
    """``value`` with a contiguous last dim, or None; InvalidInput naming ``name`` unless a
    dense float32 tensor of one of ``shapes`` on q's device. ``of_shape``: the expected
    shape after "float32 of shape"; ``shape_is``: after "expected" for a wrong shape;
    ``convert``: the fix of a wrong dtype."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise InvalidInput(f"{name} must be a torch.Tensor, got {type(value).__name__}; "
                           f"expected float32 of shape {of_shape}")
    if value.dtype != torch.float32:
        raise InvalidInput(f"{name} has dtype {value.dtype}; expected torch.float32. "
                           f"Convert with {convert}")
    if tuple(value.shape) not in shapes:
        raise InvalidInput(f"{name} has shape {tuple(value.shape)}; expected {shape_is}")
    if value.device != q.device:
        raise InvalidInput(f"{name} is on {value.device} but q is on {q.device}; move "
                           f"it with {name}.to(q.device)")
    if value.layout != torch.strided:
        raise InvalidInput(f"{name} has layout {value.layout}; expected a dense tensor")
    return value if value.stride(-1) == 1 else value.contiguous()


def check_alibi_slopes(slopes: object, q: torch.Tensor, batch: int) -> torch.Tensor | None:
    """The slopes with a contiguous last dim, or None; InvalidInput unless float32 of shape
    (heads_q,) or (batch, heads_q) on q's device (heads_q: q's second-to-last dim)."""
    heads_q = q.shape[-2]
    return _float32_tensor("alibi_slopes", slopes, q, ((heads_q,), (batch, heads_q)),
                           f"({heads_q},) or ({batch}, {heads_q})",
                           f"({heads_q},) (one slope per query head) or ({batch}, {heads_q}) "
                           "(per batch and query head)", "alibi_slopes.float()")


def check_sinks(sinks: object, q: torch.Tensor) -> torch.Tensor | None:
    """The sinks, contiguous, or None; InvalidInput unless a float32 tensor of shape
    (heads_q,) on q's device (heads_q: q's second-to-last dim). It may require grad (its
    gradient comes from the backward pass)."""
    heads_q = q.shape[-2]
    return _float32_tensor("sinks", sinks, q, ((heads_q,),),
                           f"({heads_q},): one logit per query head",
                           f"({heads_q},): one logit per query head",
                           "sinks.float() (gradients still flow to the original)")


def resolve(causal: bool, window_size: object, softcap: object, alibi_slopes: object,
            q: torch.Tensor, batch: int, longest: tuple[int, int] | None,
            varlen: VarlenArgs | None = None, sinks: object = None) -> Variant:
    """The validated features of a call on q (..., Hq, D) of ``batch`` sequences.

    A window is normalised to the cheapest equal mask: the window (-1, 0) is ``causal``,
    and, given the longest query and key sequences ``longest`` (None: not known on the
    host), a side that reaches every key from every row becomes -1. Without a window the
    mask is ``causal`` as given.
    """
    left, right = check_window_size(window_size)
    cap = check_softcap(softcap)
    slopes = check_alibi_slopes(alibi_slopes, q, batch)
    checked_sinks = check_sinks(sinks, q)
    window = NO_WINDOW
    if (left, right) != NO_WINDOW:
        if causal:
            right = 0
        if longest is not None:
            if left >= longest[1] - 1:  # the last row reaches key 0
                left = -1
            if right >= longest[0] - 1:  # row 0 reaches the last key
                right = -1
        causal = (left, right) == (-1, 0)
        window = NO_WINDOW if causal else (left, right)
    return Variant(causal, window, cap, slopes, varlen, sinks=checked_sinks)


#: Features an op composes around a kernel family rather than compiling into it, by family:
#: the backward kernels recompute P from the forward's LSE, which already includes the sink
#: (the sink's own gradient is a reduction of the backward's D, ``api.backward``); a decode
#: split's partial LSE leaves the sink out and the split combine joins it (``api.decode``).
COMPOSED: Mapping[str, frozenset[str]] = {"bwd": frozenset({"sinks"}),
                                          "bwddet": frozenset({"sinks"}),
                                          "decode": frozenset({"sinks"}),
                                          "decode8": frozenset({"sinks"})}


def kernel_features(op: str, features: tuple[str, ...]) -> tuple[str, ...]:
    """The feature switches of ``features`` that kernel family ``op``'s kernels compile in
    (all but its ``COMPOSED`` ones)."""
    composed = COMPOSED.get(op)
    if not composed:
        return features
    return tuple(f for f in features if f not in composed)


def refuse_unsupported(op: str, features: tuple[str, ...], q: torch.Tensor, what: str,
                       head_dim_v: int | None = None) -> None:
    """FeatureNotSupported when kernel family ``op`` does not implement ``features`` (for a
    call on validated ``q``; only those its kernels compile in, ``kernel_features``);
    ``what`` names the operation for the message; ``head_dim_v``: the kernel's V head dim
    where it is not q's."""
    features = kernel_features(op, features)
    if not features:
        return
    dtype = element_type(q.dtype)
    problem = Problem(head_dim=q.shape[-1], dtype=dtype, op=op, features=features,
                      head_dim_v=head_dim_v)
    try:
        families.get(op).check_problem(problem)
    except FeatureNotSupported as exc:
        raise FeatureNotSupported(f"{what}: {exc}") from None



def _dense(t: object) -> bool:
    """A dense (strided, not nested) tensor with at least one dim: one whose shape can be
    read and padded (anything else is left for validation to refuse)."""
    return (isinstance(t, torch.Tensor) and not t.is_nested and t.layout == torch.strided
            and t.dim() > 0)


def padded_head_dim(*tensors: torch.Tensor | None) -> int | None:
    """The common head dim (last dim) of ``tensors`` (None entries ignored) when it is not a
    multiple of 8 but at most MAX_HEAD_DIM, so that zero-padding them makes it servable;
    None otherwise (also for anything validation must explain: no common dim, nested or
    sparse tensors)."""
    given = [t for t in tensors if t is not None]
    if not given or not all(_dense(t) for t in given):
        return None
    dim = given[0].shape[-1]
    if dim % 8 == 0 or dim > MAX_HEAD_DIM or any(t.shape[-1] != dim for t in given):
        return None
    return int(dim)


def zero_pad(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A copy of ``t`` whose last dim ``dim`` is zero-padded to the next multiple of 8 (zero
    columns change neither Q K^T nor the kept columns of P V)."""
    return torch.nn.functional.pad(t, (0, -dim % 8))


def pad_head_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]:
    """(q, k, v, None) unchanged, or, when their common head dim (last dim) is not a multiple
    of 8 but at most MAX_HEAD_DIM, copies zero-padded to the next multiple of 8 (one copy of
    each) and the original head dim, to slice the output with. Anything else is left for
    validation to explain."""
    dim = padded_head_dim(q, k, v)
    if dim is None:
        return q, k, v, None
    return zero_pad(q, dim), zero_pad(k, dim), zero_pad(v, dim), dim
