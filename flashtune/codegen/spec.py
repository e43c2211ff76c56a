"""The core value types of code generation: Problem, KernelConfig, KernelSource.

All are frozen and validate themselves on construction, so a value that exists is legal.
Each has one canonical, filename-safe ``key()`` used for file names, database rows, logs
and memo keys, and a ``from_key`` that inverts it.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from flashtune.codegen.dtypes import DType as DType  # re-exported: Problem's field type
from flashtune.codegen.dtypes import Dtypes, Operand, as_operand, as_output
from flashtune.codegen.features import (
    MASK_WORDS,
    FeatureNames,
    FeatureTitles,
    by_word,
    feature,
    generation,
    registered,
    switch_set,
)
from flashtune.errors import InvalidConfig, InvalidInput, InvalidProblem

#: Head dims a kernel is compiled for; other multiples of 8 up to 256 are padded up.
COMPILED_HEAD_DIMS: tuple[int, ...] = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = 256
#: Q/K head dims above MAX_HEAD_DIM, each compiled as it is: Gemma 4's 512 and DeepSeek's
#: absorbed MLA prefill (576: 512 latent + 64 RoPE). A kernel holds V's (O's) head dim of
#: at most MAX_HEAD_DIM beside them (a split problem); the API runs a wider V in column
#: chunks.
WIDE_HEAD_DIMS: tuple[int, ...] = (512, 576)
#: The ops whose kernels also hold V's head dim up to a wide Q/K's (one of WIDE_HEAD_DIMS)
#: in one kernel: the mma.sync backward's, which adds dK, dV and dQ in column chunks.
WIDE_V_OPS: frozenset[str] = frozenset({"bwd", "bwddet"})
#: Sequence buckets are powers of two clamped to this range.
MIN_SEQ_BUCKET = 64
MAX_SEQ_BUCKET = 1 << 20


#: A kernel family's name as it appears in problem keys: lowercase letters and digits.
_OP_RE = re.compile(r"^[a-z][a-z0-9]{0,15}$")
#: The head dim's part of a problem key: Q/K's, and V's after ``v`` when it differs
#: (``d192v128``).
_DIM_RE = re.compile(r"^d([1-9][0-9]{0,2})(?:v([1-9][0-9]{0,2}))?$")


def _check_int(value: object, what: str, exc: type[Exception]) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise exc(f"{what} must be an int, got {type(value).__name__} {value!r}")
    return value


def _head_dim_reason(value: object, what: str, wide: bool = False) -> str | None:
    """Why ``value`` cannot be a head dim (``what`` names it in the message), or None;
    ``wide``: one of WIDE_HEAD_DIMS is one (Q/K's head dim)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{what} must be an int, got {type(value).__name__} {value!r}"
    if wide and value in WIDE_HEAD_DIMS:
        return None
    if value > MAX_HEAD_DIM:  # padding only grows a head dim: no advice to pad here
        wider = (f", or for Q/K one of {WIDE_HEAD_DIMS} beside V's head dim of at most "
                 f"{MAX_HEAD_DIM}") if wide else ""
        return (f"{what}={value} is not supported; the kernels hold at most {MAX_HEAD_DIM} "
                f"(a multiple of 8 in [8, {MAX_HEAD_DIM}]){wider}, and a larger head dim has "
                "no flashtune kernel")
    if value < 8 or value % 8:
        return (f"{what}={value} is not supported; expected a multiple of 8 in "
                f"[8, {MAX_HEAD_DIM}] (pad it with zeros to {max(8, -(-value // 8) * 8)})")
    return None


def padded_head_dim(head_dim: int) -> int:
    """The compiled head dim that serves ``head_dim`` (the next one of COMPILED_HEAD_DIMS;
    one of WIDE_HEAD_DIMS serves itself)."""
    if head_dim in WIDE_HEAD_DIMS:
        return head_dim
    for size in COMPILED_HEAD_DIMS:
        if head_dim <= size:
            return size
    raise InvalidProblem(f"head_dim={head_dim} exceeds the maximum {MAX_HEAD_DIM}")


def seq_bucket(seqlen: int) -> int:
    """Power-of-two tuning bucket of a sequence length (clamped to [64, 2**20])."""
    if seqlen < 1:
        raise InvalidProblem(f"sequence length must be >= 1, got {seqlen}")
    bucket = 1 << max(0, math.ceil(math.log2(seqlen)))
    return min(max(bucket, MIN_SEQ_BUCKET), MAX_SEQ_BUCKET)


#: The feature switches of a Problem beyond the mask, in key order: the registered
#: features' names (``codegen.features``), read live.
FEATURES: Sequence[str] = FeatureNames()
#: What each feature switch is called in messages (the API's keyword in parentheses).
FEATURE_NAMES: Mapping[str, str] = FeatureTitles()


def _malformed(key: str, why: str) -> InvalidProblem:
    return InvalidProblem(f"problem key {key!r} is malformed ({why}); expected e.g. "
                          "'fwd_d128_bf16_causal' (or with a feature: "
                          "'fwd_d64_fp16_local_softcap_alibi')")


@dataclass(frozen=True, init=False)
class Problem:
    """What is compiled into a kernel: op, head dim, element types and feature switches.

    Sizes that vary per call (batch, sequence lengths, head counts, strides) are run-time
    arguments and are not part of a Problem; ``bucket()`` maps them to a tuning bucket.

    Element types (``codegen.dtypes``): ``dtype`` is Q's; ``kv_dtype`` (K and V) and
    ``o_dtype`` (O) are None when they are ``dtype`` (a value equal to ``dtype`` is stored
    as None, so equal problems compare equal and ``dataclasses.replace(p, dtype=...)`` keeps
    a uniform problem uniform). Read them as ``dtypes`` (a ``Dtypes``: q, kv, o). A family
    declares the combinations it accepts (``KernelFamily.dtypes``). Q and K/V may be FP8
    (``Fp8Type``, the FP8 forward's ``fwd8_d128_e4m3-e4m3-bf16_causal``); O never is, so an
    FP8 problem names its 16-bit ``o_dtype`` (refused at construction otherwise).

    Head dims: ``head_dim`` is Q's and K's (the Q K^T contraction); ``head_dim_v`` is V's
    and O's when it differs (DeepSeek's prefill: 192 / 128), stored as None when it equals
    ``head_dim`` (a value equal to it is stored as None, so a plain problem keeps its key,
    and ``dataclasses.replace(p, head_dim=...)`` keeps a plain problem plain); read V's as
    ``v_head_dim``. A family declares whether it serves a split problem
    (``KernelFamily.split_head_dims``). The key then names both: ``fwd_d192v128_bf16_causal``.
    Q/K's head dim may also be one of WIDE_HEAD_DIMS (512, 576) beside V's of at most 256
    (``fwd_d576v256_bf16_causal``), for the families that declare ``max_head_dim``; the
    ops of WIDE_V_OPS (the backward's) take V's head dim up to Q/K's beside them.

    Feature switches (each compiled in or out; off, the kernel is the plain one):
      causal: key j is hidden from query i unless j <= i + Nk - Nq (bottom-right aligned);
      ``features``: the names of the registered features that are on (``codegen.features``),
        in key order. Each is also a keyword of the constructor and an attribute
        (``Problem(64, DType.FP16, window=True)``, ``problem.window``). The built-ins:
      window: a sliding window (flash-attn's local attention): key j is visible to query i
        iff i + Nk - Nq - left <= j <= i + Nk - Nq + right, with the run-time sizes
        (left, right) and -1 meaning unbounded on that side. A causal window is the window
        (left, 0), so ``causal`` and ``window`` are exclusive;
      softcap: scores become cap * tanh(scale * q.k / cap) (a run-time cap > 0);
      alibi: scores get the bias -slope * |i + Nk - Nq - j| (run-time per-head slopes);
      varlen: the batch is packed (total rows, heads, dim) with run-time cumulative lengths
        per sequence (flash-attn's varlen layout); the masks apply per sequence.
    """

    head_dim: int
    dtype: Operand
    causal: bool = False
    op: str = "fwd"
    features: tuple[str, ...] = ()
    kv_dtype: Operand | None = None
    o_dtype: Operand | None = None
    head_dim_v: int | None = None

    def __init__(self, head_dim: int, dtype: Operand | str, causal: bool = False,
                 op: str = "fwd", *, features: Iterable[str] = (),
                 kv_dtype: Operand | str | None = None, o_dtype: Operand | str | None = None,
                 head_dim_v: int | None = None, **switches: bool) -> None:
        """``features``: names of registered features to switch on; ``switches``: a feature
        by its name (``window=True``; ``False`` switches one of ``features`` off);
        ``head_dim_v``: V's head dim (None: ``head_dim``)."""
        q = as_operand(dtype)
        set_ = object.__setattr__
        set_(self, "head_dim", head_dim)
        set_(self, "head_dim_v", None if head_dim_v == head_dim and not isinstance(
            head_dim_v, bool) else head_dim_v)
        set_(self, "dtype", q)
        set_(self, "causal", causal)
        set_(self, "op", op)
        for name, given in (("kv_dtype", kv_dtype), ("o_dtype", o_dtype)):
            other = None if given is None else as_operand(given, name)
            set_(self, name, None if other is q else other)
        self._validate()
        self.dtypes  # noqa: B018  (an FP8 output, or FP8 for every operand, is refused here)
        if isinstance(features, str):
            raise InvalidProblem(f"features={features!r} must be a collection of feature "
                                 f"names, e.g. ({features!r},)")
        on = set(features)
        for name, value in switches.items():
            feature(name)  # InvalidProblem naming the registered features
            if not isinstance(value, bool):
                raise InvalidProblem(f"{name} must be a bool, got {value!r}")
            if value:
                on.add(name)
            else:
                on.discard(name)
        set_(self, "features", switch_set(frozenset(on), causal))

    def _validate(self) -> None:
        if not isinstance(self.op, str) or not _OP_RE.match(self.op):
            raise InvalidProblem(f"op={self.op!r} is not a kernel family name; expected "
                                 "lowercase letters and digits, e.g. 'fwd'")
        why = _head_dim_reason(self.head_dim, "head_dim", wide=True)
        if why is not None:
            raise InvalidProblem(why.replace("pad it", "pad the head dim of q, k and v"))
        wide_v = self.head_dim > MAX_HEAD_DIM and self.op in WIDE_V_OPS
        if self.head_dim > MAX_HEAD_DIM and not wide_v and not (
                isinstance(self.head_dim_v, int) and self.head_dim_v <= MAX_HEAD_DIM):
            raise InvalidProblem(
                f"head_dim={self.head_dim} (Q/K) needs V's head dim of at most {MAX_HEAD_DIM} "
                f"in one kernel, got head_dim_v={self.head_dim_v}: O's accumulators of a wider "
                "V do not fit a thread's registers (flashtune.attention runs such a V in "
                f"column chunks of {MAX_HEAD_DIM})")
        if self.head_dim_v is not None:
            why = _head_dim_reason(self.head_dim_v, "head_dim_v (V's head dim)",
                                   wide=wide_v and self.head_dim_v in WIDE_HEAD_DIMS)
            if why is None and wide_v and self.head_dim_v > self.head_dim:
                why = (f"head_dim_v={self.head_dim_v} (V's head dim) exceeds Q/K's "
                       f"{self.head_dim}; expected at most that")
            if why is not None:
                raise InvalidProblem(why.replace("pad it", "pad v's head dim"))
        if not isinstance(self.causal, bool):
            raise InvalidProblem(f"causal must be a bool, got {self.causal!r}")

    if not TYPE_CHECKING:
        def __getattr__(self, name: str) -> bool:
            # A registered feature's switch reads as an attribute (``problem.bias``); only
            # called when normal lookup fails, so fields and properties are untouched.
            if name.startswith("_") or name not in FEATURES:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute "
                                     f"{name!r}")
            return name in self.features

    # Typed reads of the built-in switches (the registry is the truth; a feature registered
    # later reads through ``has`` or as an attribute at run time).
    @property
    def window(self) -> bool:
        return "window" in self.features

    @property
    def softcap(self) -> bool:
        return "softcap" in self.features

    @property
    def alibi(self) -> bool:
        return "alibi" in self.features

    @property
    def varlen(self) -> bool:
        return "varlen" in self.features

    @property
    def sinks(self) -> bool:
        return "sinks" in self.features

    @property
    def dropout(self) -> bool:
        return "dropout" in self.features

    def has(self, name: str) -> bool:
        """Whether feature ``name`` is on (InvalidProblem if no such feature is registered)."""
        return feature(name).name in self.features

    @functools.cached_property
    def dtypes(self) -> Dtypes:
        """The element types of Q, K/V and O."""
        if self.kv_dtype is None and self.o_dtype is None:
            return Dtypes.same(self.dtype)
        return Dtypes(self.dtype, self.kv_dtype or self.dtype,
                      as_output(self.o_dtype or self.dtype, "o dtype"))

    @property
    def padded_head_dim(self) -> int:
        return padded_head_dim(self.head_dim)

    @property
    def v_head_dim(self) -> int:
        """V's (and O's) head dim: ``head_dim_v``, or ``head_dim`` when they are equal."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def padded_v_head_dim(self) -> int:
        """The compiled head dim that serves V's."""
        return padded_head_dim(self.v_head_dim)

    @property
    def split_head_dims(self) -> bool:
        """Whether V's head dim differs from Q/K's."""
        return self.head_dim_v is not None

    @property
    def mask(self) -> str:
        """The mask as a key word: ``causal``, a mask feature's word (``local`` for a
        window) or ``full``."""
        if self.causal:
            return "causal"
        return next((f.word for f in map(feature, self.features) if f.mask), "full")

    def key(self) -> str:
        """Canonical key, e.g. ``fwd_d128_bf16_causal`` or ``fwd_d64_fp16_local_softcap``
        (a plain problem's key has no feature words; the element types are one word when
        every operand has that type, else ``q-kv-o``: ``fwd_d128_bf16-fp16-bf16_full``;
        V's head dim follows Q/K's where it differs: ``fwd_d192v128_bf16_causal``)."""
        return self._key

    @functools.cached_property
    def _key(self) -> str:
        # Computed once per value: keys name memo entries on the serving path.
        extra = "".join(f"_{f.word}" for f in map(feature, self.features) if not f.mask)
        dims = f"d{self.head_dim}" + ("" if self.head_dim_v is None else f"v{self.head_dim_v}")
        return f"{self.op}_{dims}_{self.dtypes.word}_{self.mask}{extra}"

    @classmethod
    def from_key(cls, key: str) -> Problem:
        """The Problem whose ``key()`` is ``key``; InvalidProblem when it is not canonical.
        Memoised per state of the feature registry (a key names one problem until it
        changes)."""
        return _problem_of_key(key, generation())

    @classmethod
    def _parse_key(cls, key: str) -> Problem:
        parts = key.split("_") if isinstance(key, str) else []
        if len(parts) < 4:
            raise _malformed(key, "expected op, head dim, element types and mask")
        op, dim, word, mask, *words = parts
        dims = _DIM_RE.match(dim)
        if not _OP_RE.match(op) or dims is None:
            raise _malformed(key, "expected a lowercase op and a head dim like 'd128' (or "
                             "'d192v128': Q/K's, then V's)")
        try:
            dtypes = Dtypes.parse(word)
        except InvalidProblem as exc:
            raise _malformed(key, str(exc)) from None
        on: list[str] = []
        if mask not in MASK_WORDS:
            found = by_word(mask)
            if found is None or not found.mask:
                masks = [*MASK_WORDS, *(f.word for f in registered() if f.mask)]
                raise _malformed(key, f"{mask!r} is not a mask word; expected one of {masks}")
            on.append(found.name)
        for w in words:
            found = by_word(w)
            if found is None or found.mask:
                raise _malformed(key, f"{w!r} is not a feature word; expected one of "
                                 f"{[f.word for f in registered() if not f.mask]}")
            on.append(found.name)
        head_dim_v = None if dims[2] is None else int(dims[2])
        problem = cls(int(dims[1]), dtypes.q, causal=mask == "causal", op=op, features=on,
                      kv_dtype=dtypes.kv, o_dtype=dtypes.o, head_dim_v=head_dim_v)
        if problem.key() != key:
            raise _malformed(key, f"its canonical spelling is {problem.key()!r}")
        return problem

    def to_dict(self) -> dict[str, Any]:
        """The fields; a feature switch appears only when it is on, ``kv_dtype`` /
        ``o_dtype`` only when they differ from ``dtype`` and ``head_dim_v`` only when it
        differs from ``head_dim`` (so a plain problem's dict is the same as before feature
        switches, per-operand types and split head dims existed)."""
        out: dict[str, Any] = {"op": self.op, "head_dim": self.head_dim,
                               "dtype": self.dtype.value, "causal": self.causal}
        out.update({name: True for name in self.features})
        out.update({name: value.value for name in ("kv_dtype", "o_dtype")
                    if (value := getattr(self, name)) is not None})
        if self.head_dim_v is not None:
            out["head_dim_v"] = self.head_dim_v
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Problem:
        unknown = set(data) - {"op", "head_dim", "dtype", "causal", "kv_dtype", "o_dtype",
                               "head_dim_v", *FEATURES}
        if unknown:
            raise InvalidProblem(f"unknown problem field(s) {sorted(unknown)}; expected op, "
                                 f"head_dim, head_dim_v, dtype, causal, kv_dtype, o_dtype or "
                                 f"a feature ({', '.join(FEATURES)})")
        return cls(head_dim=data["head_dim"], dtype=data["dtype"],
                   causal=data.get("causal", False), op=data.get("op", "fwd"),
                   kv_dtype=data.get("kv_dtype"), o_dtype=data.get("o_dtype"),
                   head_dim_v=data.get("head_dim_v"),
                   **{name: data[name] for name in FEATURES if name in data})

    def bucket(self, seqlen_q: int, seqlen_k: int) -> ProblemBucket:
        """The tuning bucket of a call with these sequence lengths."""
        return ProblemBucket(self, seq_bucket(max(seqlen_q, seqlen_k)))


@functools.lru_cache(maxsize=4096)
def _problem_of_key(key: str, features_generation: int) -> Problem:
    return Problem._parse_key(key)


@dataclass(frozen=True)
class ProblemBucket:
    """A Problem plus a power-of-two sequence-length bucket: the unit of tuning.

    ``shape_class``: a family's word for the class of call shapes within the bucket that
    are tuned apart ("" for none, every family but decoding: ``families.decode.shape_class``
    names a GQA group, query rows and page size, e.g. ``g8q4p16``); its key is the bucket
    key's last word (``decode_d128_bf16_n4096_g8q4p16``).
    """

    problem: Problem
    seqlen: int
    shape_class: str = ""

    def __post_init__(self) -> None:
        n = _check_int(self.seqlen, "seqlen bucket", InvalidProblem)
        if n < MIN_SEQ_BUCKET or n > MAX_SEQ_BUCKET or n & (n - 1):
            raise InvalidProblem(
                f"seqlen bucket {n} is not a power of two in [{MIN_SEQ_BUCKET}, {MAX_SEQ_BUCKET}]"
            )
        if not isinstance(self.shape_class, str) or (
                self.shape_class and not SHAPE_CLASS_RE.match(self.shape_class)):
            raise InvalidProblem(f"shape class {self.shape_class!r} is malformed; expected "
                                 "'' or a lowercase word of letters and digits, e.g. 'g8q4p16'")

    def key(self) -> str:
        tail = f"_{self.shape_class}" if self.shape_class else ""
        return f"{self.problem.key()}_n{self.seqlen}{tail}"

    @classmethod
    def from_key(cls, key: str) -> ProblemBucket:
        found = _BUCKET_KEY_RE.match(key)
        if found is None:
            raise InvalidProblem(f"bucket key {key!r} is malformed; expected e.g. "
                                 "'fwd_d128_bf16_causal_n4096'")
        return cls(Problem.from_key(found["problem"]), int(found["n"]),
                   found["shape_class"] or "")


#: A shape class word (``ProblemBucket.shape_class``).
SHAPE_CLASS_RE = re.compile(r"^[a-z][a-z0-9]{0,23}$")
_BUCKET_KEY_RE = re.compile(
    r"^(?P<problem>.+)_n(?P<n>[0-9]+)(?:_(?P<shape_class>[a-z][a-z0-9]*))?$")


#: Warps per block. 12 is three warpgroups of 4 (block_m 192 with one warpgroup per 64 rows,
#: the sm_90a forward's largest tile); the other values are powers of two.
LEGAL_WARPS = (1, 2, 4, 8, 12, 16)
LEGAL_STAGES = (1, 2, 3, 4)
MAX_THREADS = 1024

#: Name of a further template knob in a config (and its key): lowercase letters and digits.
_EXTRA_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,15}$")
#: A further knob's value: an int (0/1 for a switch) or a lowercase word (a named mode).
ExtraValue = int | str
_EXTRA_WORD_RE = re.compile(r"^[a-z][a-z0-9]{0,15}$")
#: The fields every config has (the rest of a config is its extras).
BASE_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")


def knob_name_error(name: str) -> str | None:
    """Why ``name`` cannot name a further knob (``KernelConfig.extras``), or None."""
    if not _EXTRA_NAME_RE.match(name) or name in BASE_FIELDS:
        return (f"extra knob name {name!r} is illegal; expected lowercase letters and digits "
                "(e.g. 'splitsize'), not one of the base fields")
    return None


def _normalise_extras(extras: object) -> tuple[tuple[str, ExtraValue], ...]:
    try:
        items = list(extras.items()) if isinstance(extras, Mapping) else list(extras)  # type: ignore[call-overload]
        pairs = sorted((str(k), v) for k, v in items)
    except (TypeError, ValueError):
        raise InvalidConfig(f"extras={extras!r} must be a mapping of knob name -> value") from None
    for name, value in pairs:
        why = knob_name_error(name)
        if why is not None:
            raise InvalidConfig(why)
        if isinstance(value, bool):
            raise InvalidConfig(f"extra knob {name}={value!r}: write switches as 0 or 1")
        if isinstance(value, int):
            if not 0 <= value < 1 << 20:
                raise InvalidConfig(f"extra knob {name}={value} is outside [0, 2**20)")
        elif not (isinstance(value, str) and _EXTRA_WORD_RE.match(value)):
            raise InvalidConfig(f"extra knob {name}={value!r} must be an int or a lowercase "
                                "word")
    if len({n for n, _ in pairs}) != len(pairs):
        raise InvalidConfig(f"extra knob names repeat in {pairs}")
    return tuple(pairs)


@dataclass(frozen=True)
class KernelConfig:
    """The tunables of a kernel: four every family has, and any further template knobs.

    block_m (B_r): query rows per thread block, split across warps in slabs of 16 rows.
    block_n (B_c): key/value rows per tile streamed through shared memory.
    num_warps: warps per block; each owns block_m / num_warps query rows.
    num_stages: K/V tiles in flight in the cp.async pipeline (1 = no prefetch).
    extras: further knobs a family's template declares, as sorted (name, value) pairs
        (a mapping is accepted); which names and values are legal is the family's rule.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    extras: tuple[tuple[str, ExtraValue], ...] = ()

    if TYPE_CHECKING:
        # The generated __init__ as type checkers should see it: ``extras`` may also be a
        # mapping (as documented above); ``__post_init__`` normalises it to sorted pairs.
        def __init__(self, block_m: int, block_n: int, num_warps: int, num_stages: int,
                     extras: Mapping[str, ExtraValue] | tuple[tuple[str, ExtraValue], ...] = (),
                     ) -> None: ...

    def __post_init__(self) -> None:
        for name in BASE_FIELDS:
            _check_int(getattr(self, name), name, InvalidConfig)
        object.__setattr__(self, "extras", _normalise_extras(self.extras))
        if self.num_warps not in LEGAL_WARPS:
            raise InvalidConfig(f"num_warps={self.num_warps} is illegal; expected one of "
                                f"{LEGAL_WARPS}")
        if self.num_stages not in LEGAL_STAGES:
            raise InvalidConfig(f"num_stages={self.num_stages} is illegal; expected one of "
                                f"{LEGAL_STAGES}")
        if not (16 <= self.block_m <= 256 and self.block_m % 16 == 0):
            raise InvalidConfig(f"block_m={self.block_m} is illegal; expected a multiple of 16 "
                                "in [16, 256]")
        if not (16 <= self.block_n <= 256 and self.block_n % 16 == 0):
            raise InvalidConfig(f"block_n={self.block_n} is illegal; expected a multiple of 16 "
                                "in [16, 256]")
        if self.block_m % (16 * self.num_warps):
            raise InvalidConfig(
                f"block_m={self.block_m} cannot be split into 16-row slabs over "
                f"num_warps={self.num_warps}; use block_m a multiple of {16 * self.num_warps} "
                "or fewer warps"
            )
        if self.threads > MAX_THREADS:
            raise InvalidConfig(f"{self.threads} threads per block exceed {MAX_THREADS}")

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def rows_per_warp(self) -> int:
        return self.block_m // self.num_warps

    def extra(self, name: str, default: ExtraValue) -> ExtraValue:
        """The value of further knob ``name``, or ``default`` when the config omits it."""
        return dict(self.extras).get(name, default)

    def key(self) -> str:
        """Canonical key, e.g. ``m128_n64_w4_s2`` (``..._s2_swizzle-1`` with extras)."""
        base = f"m{self.block_m}_n{self.block_n}_w{self.num_warps}_s{self.num_stages}"
        return base + "".join(f"_{name}-{value}" for name, value in self.extras)

    _KEY_RE = re.compile(
        r"^m(\d{1,3})_n(\d{1,3})_w(\d{1,2})_s(\d)((?:_[a-z][a-z0-9]*-[a-z0-9]+)*)$")

    @classmethod
    def from_key(cls, key: str) -> KernelConfig:
        match = cls._KEY_RE.match(key)
        if not match:
            raise InvalidConfig(f"config key {key!r} is malformed; expected e.g. 'm128_n64_w4_s2'")
        m, n, w, s = (int(g) for g in match.groups()[:4])
        extras: dict[str, ExtraValue] = {}
        for part in match.group(5).split("_")[1:]:
            name, _, value = part.partition("-")
            extras[name] = int(value) if value.isdigit() else value
        return cls(block_m=m, block_n=n, num_warps=w, num_stages=s, extras=tuple(extras.items()))

    def to_dict(self) -> dict[str, ExtraValue]:
        """Flat fields: the four base ones and every extra knob by name."""
        out: dict[str, ExtraValue] = {f: getattr(self, f) for f in BASE_FIELDS}
        out.update(self.extras)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KernelConfig:
        """Inverse of ``to_dict``: the four base fields are required, others are extras."""
        missing = set(BASE_FIELDS) - set(data)
        if missing:
            raise InvalidConfig(f"config fields missing: {sorted(missing)}; expected "
                                f"{list(BASE_FIELDS)} plus any extra knobs")
        extras = tuple((k, v) for k, v in data.items() if k not in BASE_FIELDS)
        return cls(**{k: data[k] for k in BASE_FIELDS}, extras=extras)


class ShapeLike(Protocol):
    """Sizes of one attention-like call (``Shape`` satisfies this)."""

    @property
    def batch(self) -> int: ...
    @property
    def heads_q(self) -> int: ...
    @property
    def heads_kv(self) -> int: ...
    @property
    def seqlen_q(self) -> int: ...
    @property
    def seqlen_k(self) -> int: ...


@dataclass(frozen=True)
class Shape:
    """Sizes of one attention-like call: batch, query and key/value heads, sequence lengths."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int

    def __post_init__(self) -> None:
        for name in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInput(f"shape {name}={value!r} is invalid; expected an int >= 1")
        if self.heads_q % self.heads_kv:
            raise InvalidInput(f"heads_q={self.heads_q} is not a multiple of heads_kv="
                               f"{self.heads_kv}; GQA needs heads_q = group * heads_kv")

    @classmethod
    def square(cls, batch: int, heads: int, seqlen: int) -> Shape:
        return cls(batch, heads, heads, seqlen, seqlen)

    def key(self) -> str:
        """A short, filename-safe name of the shape, e.g. ``b2_hq16_hkv16_q4096_k4096``."""
        return (f"b{self.batch}_hq{self.heads_q}_hkv{self.heads_kv}_"
                f"q{self.seqlen_q}_k{self.seqlen_k}")


@dataclass(frozen=True)
class KernelSource:
    """A rendered kernel, ready to compile for any arch (or for its one ``target``).

    ``digest`` covers everything that changes the binary apart from the target arch and the
    compiler: the rendered code, the contents of every header it includes, the compile
    options and the flashtune version. ``target`` names the arch-specific target the code
    needs (``"sm_90a"`` for wgmma), None when it compiles for any arch
    (``codegen.arch.compile_target`` applies it).
    """

    problem: Problem
    config: KernelConfig
    code: str
    entry: str
    headers: Mapping[str, str] = field(repr=False)
    options: tuple[str, ...]
    digest: str
    smem_bytes: int
    threads: int
    target: str | None = None
