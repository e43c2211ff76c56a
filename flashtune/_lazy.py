"""Packages whose public names are imported on first use (PEP 562).

A package's ``__init__`` lists its names and their modules; ``lazy_exports`` returns the
package's ``__getattr__`` and ``__dir__``, so that importing the package (and its light
modules) does not import the heavy ones (torch, SQLAlchemy, Optuna) its names live in.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str], public: Iterable[str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``exports`` maps each name to the
    module that defines it (a name mapped to the submodule of that name is the submodule).

    A resolved name is stored in the package, so later lookups are plain attribute reads.
    An exported name must not equal the name of a submodule of another export: importing a
    submodule binds its name on the package, which would shadow the export.
    """
    namespace = sys.modules[package].__dict__
    names = sorted(set(public))

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        loaded = importlib.import_module(module)
        value = loaded if module == f"{package}.{name}" else getattr(loaded, name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(names) | {name for name in namespace if name.startswith("__")})

    return __getattr__, __dir__


class _LazyModule:
    """Stands for module ``name`` in one module's namespace until first used: the first
    attribute read imports it and binds the real module under its name there, so later
    reads are plain global lookups."""

    def __init__(self, name: str, namespace: dict[str, Any]) -> None:
        self._name, self._namespace = name, namespace

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self._name)
        self._namespace[self._name] = module
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"


def lazy_module(name: str, namespace: dict[str, Any]) -> Any:
    """A stand-in for ``import name`` in the module whose globals are ``namespace``: the
    import happens at the first attribute read.

    For modules whose functions need a heavy dependency (torch) that merely importing them
    (to list or render kernels) does not; bind it under TYPE_CHECKING for the type checker.
    """
    return _LazyModule(name, namespace)
