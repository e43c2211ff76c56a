"""Fixtures of these tests: tests/toolchain_fixtures.py."""

from toolchain_fixtures import (  # noqa: F401  (fixtures are registered by name)
    _fresh_memo,
    cache,
    nvrtc_calls,
    template_copy,
    toolchain,
)
