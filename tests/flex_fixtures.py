"""A fixture of the tests that trace modifications: the features their calls register (one
per traced modification, by digest) are removed afterwards, so that other tests see the
built-in registry."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flashtune.codegen.features import registered, unregister_feature


@pytest.fixture(autouse=True)
def forget_traced_features() -> Iterator[None]:
    before = {f.name for f in registered()}
    yield
    for feature in registered():
        if feature.name not in before:
            unregister_feature(feature.name)
