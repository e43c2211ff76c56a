"""A fixture of the tests that trace modifications: the features their calls register (one
per traced modification, by digest) are removed afterwards, so that other tests see the
built-in registry."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from flashtune.codegen.features import registered, unregister_feature
from flashtune.codegen.trace import TracedMod
from flashtune.families.base import Inputs


@pytest.fixture(autouse=True)
def forget_traced_features() -> Iterator[None]:
    before = {f.name for f in registered()}
    yield
    for feature in registered():
        if feature.name not in before:
            unregister_feature(feature.name)


def with_ranges(traced: TracedMod, ranges: torch.Tensor, drawn: Inputs) -> Inputs:
    """``drawn`` (a family's random inputs) with ``traced``'s captured tensors and the
    block mask tile ranges ``ranges`` as its values."""
    values: dict[str, Any] = traced.values(torch.device("cpu"))
    values[traced.ranges_param] = ranges
    values.update({f"{traced.ranges_param}_n{j}": int(s)
                   for j, s in enumerate(ranges.shape[:3])})
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    scalars = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
    return Inputs(dict(drawn.tensors) | tensors, dict(drawn.scalars) | scalars)


def four_documents(n: int, seed: int) -> tuple[list[int], torch.Tensor]:
    """The cuts and document ids (n,) of 4 packed documents, the first long enough (at
    least n / 2 positions) to hold full tiles, the other cuts drawn with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    first = n // 2 + int(torch.randint(0, n // 8 + 1, (), generator=gen))
    cuts = [first, *sorted((first + 1 + torch.randperm(n - first - 2, generator=gen)[:2])
                           .tolist())]
    docs = torch.zeros(n, dtype=torch.int64)
    for cut in cuts:
        docs[cut:] += 1
    return cuts, docs
