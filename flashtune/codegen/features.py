"""Attention features as declarations: one registry of the switches a Problem can carry.

A ``Feature`` (sliding window, softcap, ALiBi, varlen, ...) is compiled into a kernel or
not. Its declaration says everything codegen needs to know about it: its name (the Problem's
keyword and attribute, ``Problem(..., softcap=True)``, ``problem.softcap``, the field of
``Problem.to_dict``), its word in problem keys, what it is called in messages, and what it
cannot be combined with. ``Problem``'s constructor, key, ``from_key``, ``to_dict`` /
``from_dict`` and the families' ``features`` gate all read this registry, so registering a
feature (``register_feature``) makes problems with it expressible, keyed, stored and refused
by every family that does not declare it, with no other edit. A family then implements it
in its own folder (template switch, run-time values, reference), unless the feature
declares a score modification (``score``: a ``codegen.score_mods.ScoreMod``, its device
hook, run-time params and float64 reference): then every family that takes declared
modifications (``KernelFamily.score_mods``) serves it with no edit of its own.

Key order is registration order: the built-ins are registered here in the order today's keys
spell them (``fwd_d64_fp16_local_softcap_alibi_varlen``), so their keys never change; later
built-ins (``sinks``) come after them.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import overload

from flashtune.codegen.score_mods import ScoreMod
from flashtune.errors import InvalidProblem

_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,15}$")
#: The key's mask words that are not a feature's: causal, and no mask.
MASK_WORDS = ("causal", "full")
#: Names a feature cannot take: the Problem's own fields and attributes (a test holds this
#: equal to Problem's public names) and the key's mask words.
RESERVED = frozenset({"head_dim", "dtype", "kv_dtype", "o_dtype", "dtypes", "causal", "op",
                      "features", "has", "mask", "key", "from_key", "to_dict", "from_dict",
                      "bucket", "padded_head_dim", "head_dim_v", "v_head_dim",
                      "padded_v_head_dim", "split_head_dims", *MASK_WORDS})


@dataclass(frozen=True)
class Feature:
    """One attention feature a Problem can switch on.

    name: the Problem's keyword, attribute and dict field (lowercase letters and digits);
    word: its word in problem keys (e.g. ``local`` for ``window``);
    title: what messages call it, with the API's keyword in parentheses
      (``sliding-window attention (window_size)``);
    excludes: the switches it cannot be combined with: ``causal`` or other features' names;
    mask: its word stands in the key's mask slot instead of ``full`` (a mask of its own:
      mask features exclude ``causal``, which must be listed in ``excludes``, and each other);
    hint: how to write an excluded combination instead, appended to the refusal;
    score: its score modification, for a feature that is one (None: the families that
      declare the feature implement it themselves).
    """

    name: str
    word: str
    title: str
    excludes: frozenset[str] = field(default_factory=frozenset)
    mask: bool = False
    hint: str = ""
    score: ScoreMod | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "excludes", frozenset(self.excludes))
        for what, value in (("name", self.name), ("word", self.word)):
            if not isinstance(value, str) or not _NAME_RE.match(value):
                raise InvalidProblem(f"feature {what} {value!r} is illegal; expected lowercase "
                                     "letters and digits, e.g. 'softcap'")
            if value in RESERVED:
                raise InvalidProblem(f"feature {what} {value!r} is taken by the Problem or its "
                                     f"key; reserved: {sorted(RESERVED)}")
        if not self.title:
            raise InvalidProblem(f"feature {self.name!r} needs a title for messages")
        if self.name in self.excludes:
            raise InvalidProblem(f"feature {self.name!r} cannot exclude itself")
        if self.mask and "causal" not in self.excludes:
            raise InvalidProblem(f"feature {self.name!r} is a mask (its key word replaces the "
                                 "mask word), so it must exclude 'causal'")


_lock = threading.Lock()
#: Registered features by name, in key order.
_registry: dict[str, Feature] = {}
#: Bumped on every change of the registry (memos of parsed keys are per generation).
_generation = [0]


def generation() -> int:
    """A number that changes whenever a feature is registered or removed."""
    return _generation[0]


def register_feature(feature: Feature) -> None:
    """Add ``feature`` at the end of the key order; InvalidProblem when its name or key word
    is taken, or it excludes a switch that is not registered."""
    with _lock:
        if feature.name in _registry:
            raise InvalidProblem(f"feature {feature.name!r} is already registered")
        for other in _registry.values():
            if {feature.name, feature.word} & {other.name, other.word}:
                raise InvalidProblem(f"feature {feature.name!r} (key word {feature.word!r}) "
                                     f"clashes with {other.name!r} (key word {other.word!r})")
        taken = {p.name: other.name for other in _registry.values() if other.score
                 for p in other.score.params}
        clash = [p.name for p in feature.score.params if p.name in taken] if feature.score else []
        if clash:
            raise InvalidProblem(f"feature {feature.name!r}: score modification params {clash} "
                                 f"are taken by {sorted({taken[n] for n in clash})} (kernel "
                                 "arguments must be unique); rename them")
        unknown = sorted(feature.excludes - {"causal", *_registry})
        if unknown:
            raise InvalidProblem(f"feature {feature.name!r} excludes {unknown}, which are not "
                                 f"registered; expected 'causal' or one of {list(_registry)}")
        _registry[feature.name] = feature
        _generation[0] += 1


def unregister_feature(name: str) -> None:
    """Remove a feature added with ``register_feature`` (tests); a built-in stays."""
    if any(f.name == name for f in BUILTIN):
        raise InvalidProblem(f"feature {name!r} is built in and cannot be removed")
    with _lock:
        if _registry.pop(name, None) is not None:
            _generation[0] += 1


def registered() -> tuple[Feature, ...]:
    """Every registered feature, in key order."""
    return tuple(_registry.values())


def feature(name: str) -> Feature:
    """The registered feature ``name``; InvalidProblem naming the registered ones."""
    found = _registry.get(name)
    if found is None:
        raise InvalidProblem(f"{name!r} is not an attention feature; expected one of "
                             f"{list(_registry)}")
    return found


def by_word(word: str) -> Feature | None:
    """The registered feature whose key word is ``word``, or None."""
    return next((f for f in _registry.values() if f.word == word), None)


def switch_set(names: frozenset[str], causal: bool) -> tuple[str, ...]:
    """The features ``names`` (with ``causal`` on or off) in key order; InvalidProblem for
    a name that is not registered or a combination a feature excludes."""
    return _switch_set(names, causal, _generation[0])


@functools.lru_cache(maxsize=1024)
def _switch_set(names: frozenset[str], causal: bool, generation: int) -> tuple[str, ...]:
    for name in sorted(names):
        feature(name)
    on = [f for f in _registry.values() if f.name in names]
    for f in on:
        for other in sorted(f.excludes):
            if other in names or (other == "causal" and causal):
                raise InvalidProblem(f"{other}=True and {f.name}=True are exclusive"
                                     + (f": {f.hint}" if f.hint else ""))
    masks = [f.name for f in on if f.mask]
    if len(masks) > 1:
        raise InvalidProblem(f"{' and '.join(f'{m}=True' for m in masks)} are exclusive: "
                             "each is a mask of its own; switch on one")
    return tuple(f.name for f in on)


def mods_of(names: Collection[str]) -> tuple[tuple[str, ScoreMod], ...]:
    """(name, modification) of the features ``names`` that declare one, in key order."""
    return tuple((f.name, f.score) for f in _registry.values()
                 if f.score is not None and f.name in names)


def tile_ranged(names: Collection[str]) -> list[str]:
    """The features of ``names`` whose modification takes a block mask's tile ranges (a
    ``tiles`` param): the kernels that walk every key tile refuse them."""
    return [name for name, mod in mods_of(names) if any(p.type == "tiles" for p in mod.params)]


class FeatureNames(Sequence[str]):
    """The registered features' names in key order, read live (``codegen.spec.FEATURES``):
    a feature registered later is in it."""

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...

    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return tuple(_registry)[index]

    def __len__(self) -> int:
        return len(_registry)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_registry))

    def __contains__(self, name: object) -> bool:
        return name in _registry

    def __repr__(self) -> str:
        return f"FeatureNames({tuple(_registry)!r})"


class FeatureTitles(Mapping[str, str]):
    """Each registered feature's title by name, read live (``codegen.spec.FEATURE_NAMES``)."""

    def __getitem__(self, name: str) -> str:
        return _registry[name].title

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_registry))

    def __len__(self) -> int:
        return len(_registry)


#: The built-in features, in the order today's keys spell them.
BUILTIN: tuple[Feature, ...] = (
    Feature("window", "local", "sliding-window attention (window_size)",
            excludes=frozenset({"causal"}), mask=True,
            hint="a causal sliding window is the window (left, 0); use window=True alone"),
    Feature("softcap", "softcap", "logit softcapping (softcap)"),
    Feature("alibi", "alibi", "ALiBi biases (alibi_slopes)"),
    Feature("varlen", "varlen", "variable-length batches (attention_varlen)"),
    # gpt-oss's sinks: a learnable logit per query head that joins each row's softmax
    # denominator (after the existing words, so that every existing key is unchanged).
    Feature("sinks", "sinks", "attention sinks (sinks)"),
    Feature("dropout", "dropout", "attention dropout (dropout_p)"),
)
for _builtin in BUILTIN:
    register_feature(_builtin)
