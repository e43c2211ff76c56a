"""mypy sees every test helper that tests import by a top-level name.

pytest puts each test folder on sys.path, so tests import helpers as top-level modules
(``import dbfactories``). A folder with a conftest.py of its own is not a mypy package base
(pyproject.toml says why), so such a helper is type-checked only through its one-line
re-export in tests/_mypy_shims/. Without that re-export mypy types the helper as Any and
says nothing (``ignore_missing_imports``): this test is what notices.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SHIMS = TESTS / "_mypy_shims"


def _top_level_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _helpers_behind_a_conftest() -> dict[str, Path]:
    """Modules of the test folders with their own conftest.py, by top-level name."""
    return {module.stem: module
            for conftest in TESTS.glob("*/conftest.py")
            for module in conftest.parent.glob("*.py") if module.name != "conftest.py"}


def test_every_imported_helper_behind_a_conftest_has_its_shim() -> None:
    helpers = _helpers_behind_a_conftest()
    imported = set().union(*(_top_level_imports(p) for p in TESTS.rglob("*.py")
                             if SHIMS not in p.parents))
    missing = sorted(name for name in imported & helpers.keys()
                     if not (SHIMS / f"{name}.pyi").is_file())
    assert not missing, (
        f"tests import {missing} by top-level name, but tests/_mypy_shims/ has no re-export "
        "for them, so mypy types them as Any; add tests/_mypy_shims/<name>.pyi with "
        "`from <folder>.<name> import *  # noqa: F403`")


def test_every_shim_re_exports_the_helper_of_its_name() -> None:
    helpers = _helpers_behind_a_conftest()
    for shim in sorted(SHIMS.glob("*.pyi")):
        assert shim.stem in helpers, f"{shim.name} re-exports no helper of a conftest folder"
        folder = helpers[shim.stem].parent.name
        expected = f"from {folder}.{shim.stem} import *"
        assert expected in shim.read_text(), f"{shim.name} should say `{expected}`"
