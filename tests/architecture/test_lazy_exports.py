"""The packages whose public names are imported on first use (flashtune._lazy): every
listed name resolves to the object of the module that defines it, and nothing else does."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import flashtune

LAZY_PACKAGES = ("flashtune", "flashtune.db", "flashtune.tuner")


@pytest.mark.parametrize("name", LAZY_PACKAGES)
def test_every_export_is_its_modules_object(name: str) -> None:
    package = importlib.import_module(name)
    exports: dict[str, str] = package._EXPORTS
    assert set(exports) <= set(package.__all__) <= set(exports) | {"__version__"}
    # every defining module loaded first: importing a submodule binds its name on the
    # package, which would shadow an export of the same name
    modules = {export: importlib.import_module(module) for export, module in exports.items()}
    for export, module in modules.items():
        expected = module if module.__name__ == f"{name}.{export}" else getattr(module, export)
        assert getattr(package, export) is expected, f"{name}.{export}"
        assert export in dir(package)
    with pytest.raises(AttributeError, match=f"module '{name}' has no attribute 'not_a_name'"):
        package.not_a_name  # noqa: B018


def test_a_submodule_export_resolves_on_first_access() -> None:
    """``flashtune.families`` (an export that is a submodule) on a fresh interpreter, before
    anything imported the submodule."""
    code = ("import flashtune, types\n"
            "value = flashtune.families\n"
            "print(isinstance(value, types.ModuleType), value.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(flashtune.__file__).resolve().parents[1], timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "flashtune.families"]
    assert isinstance(flashtune.families, ModuleType)


def test_a_lazy_module_imports_on_first_read_and_takes_its_place() -> None:
    """``lazy_module``: nothing is imported until an attribute is read; then the real module
    replaces the stand-in in the namespace (later reads pay no indirection)."""
    from flashtune._lazy import lazy_module

    name = "flashtune._lazy_probe_target"
    sys.modules.pop(name, None)
    namespace: dict[str, object] = {}
    namespace[name] = lazy_module(name, namespace)
    assert name not in sys.modules and "imported on first use" in repr(namespace[name])
    with pytest.raises(ModuleNotFoundError, match=name):
        namespace[name].anything  # type: ignore[attr-defined]  # noqa: B018  (no such module)
    namespace["json"] = lazy_module("json", namespace)
    proxy = namespace["json"]
    assert proxy.dumps([1]) == "[1]"  # type: ignore[attr-defined]
    assert namespace["json"] is importlib.import_module("json") and proxy is not namespace["json"]
