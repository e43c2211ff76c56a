"""Fixtures of these tests: tests/serving_fixtures.py."""

from serving_fixtures import (  # noqa: F401  (fixtures are registered by name)
    dispatcher,
    poisoned_outputs,
    pyref,
    source,
    virtual_sm90a,
)
