"""benchmarks/gpu_wheels.py: which wheels a GPU run carries, computed from the project's
requirements and the image's package list (fetching is replaced by local fake wheels)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import gpu_wheels as gw
import pytest
from packaging.requirements import Requirement
from packaging.version import Version


def _wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(meta) + "\n")
        zf.writestr(f"{name}/__init__.py", "x" * 1000)
    return path


class FakeIndex:
    """Serves prepared wheels by name and records what was asked for."""

    def __init__(self, wheels: dict[str, Path]) -> None:
        self.wheels = wheels
        self.asked: list[str] = []

    def __call__(self, req: Requirement, scratch: Path) -> Path:
        self.asked.append(str(req))
        return self.wheels[req.name]


def test_the_image_lacks_what_the_issue_lists() -> None:
    """The image's list against pyproject.toml: these four are missing at the top level
    (colorlog and mako follow from optuna and alembic, see the fetch below)."""
    lacking = gw.missing(gw.gpu_requirements(), gw.image_packages())
    assert sorted(r.name for r in lacking) == ["alembic", "optuna", "platformdirs",
                                               "sqlalchemy"]
    names = {r.name for r in gw.gpu_requirements()}
    assert {"torch", "cupy-cuda13x", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime",
            "pytest-timeout"} <= names
    assert not {"nvidia-cuda-crt", "nvidia-cuda-cccl"} & names
    assert gw.image_packages()["torch"] == Version("2.11.0")


def test_resolve_follows_requirements_the_image_lacks(tmp_path: Path) -> None:
    index = FakeIndex({
        "top": _wheel(tmp_path, "top", "2.0", "dep>=1", "numpy",
                      'old-only; python_version < "3.11"', 'doc-only; extra == "docs"',
                      'linux-only; platform_machine == "x86_64"',
                      'windows-only; sys_platform == "win32"'),
        "dep": _wheel(tmp_path, "dep", "1.5", "top"),  # a cycle back
        "linux-only": _wheel(tmp_path, "linux_only", "0.1"),
    })
    image = {"numpy": Version("2.5.2"), "jinja2": None}
    reqs = [Requirement("top>=1"), Requirement("jinja2"), Requirement("numpy>=1.24")]
    wheels = gw.resolve(reqs, image, index, tmp_path)
    assert [(w.name, str(w.version)) for w in wheels] == [
        ("dep", "1.5"), ("linux-only", "0.1"), ("top", "2.0")]
    assert index.asked == ["top>=1", "dep>=1", 'linux-only; platform_machine == "x86_64"']


def test_resolve_refuses_conflicting_versions(tmp_path: Path) -> None:
    index = FakeIndex({"a": _wheel(tmp_path, "a", "1.0", "b<1"),
                       "b": _wheel(tmp_path, "b", "1.5")})
    with pytest.raises(gw.WheelError, match=r"b 1.5 was fetched but b<1 is also required"):
        gw.resolve([Requirement("b>=1"), Requirement("a")], {}, index, tmp_path)


def test_an_image_version_that_does_not_fit_is_an_error() -> None:
    with pytest.raises(gw.WheelError, match="the image has torch 2.11.0, which does not"):
        gw.missing([Requirement("torch>=2.12")], {"torch": Version("2.11.0")})


def test_place_replaces_old_wheels_and_checks_the_size(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    old = _wheel(dest, "optuna", "4.0")
    new = [gw.Wheel.read(_wheel(tmp_path / "new", n, "1.0")) for n in ("a", "b")]
    with pytest.raises(gw.WheelError, match="over the 0.001 MiB limit"):
        gw.place(new, dest, max_mib=0.001)
    assert old.exists()  # nothing changed on refusal
    listing = gw.place(new, dest, max_mib=1)
    assert sorted(p.name for p in dest.glob("*.whl")) == ["a-1.0-py3-none-any.whl",
                                                          "b-1.0-py3-none-any.whl"]
    assert [line.split("\t")[0] for line in listing.read_text().splitlines()] == [
        "a==1.0", "b==1.0"]


def test_fetch_wheels_end_to_end(tmp_path: Path) -> None:
    index = FakeIndex({"optuna": _wheel(tmp_path / "idx", "optuna", "5.0", "colorlog"),
                       "colorlog": _wheel(tmp_path / "idx", "colorlog", "6.0")})
    wheels = gw.fetch_wheels(tmp_path / "out", 1.0, index, [Requirement("optuna>=4")], {})
    assert [w.name for w in wheels] == ["colorlog", "optuna"]
    assert (tmp_path / "out" / "wheels.txt").is_file()


def test_usable_wheels_match_this_interpreter(tmp_path: Path) -> None:
    pure, other, bad = (tmp_path / "a-1.0-py3-none-any.whl",
                        tmp_path / "b-1.0-cp27-cp27m-win32.whl", tmp_path / "not-a-wheel.whl")
    assert gw.usable([pure, other, bad]) == ([pure], [other, bad])


def test_gpu_extras_must_exist_in_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gw, "GPU_EXTRAS", {"cu13": ("nvidia-cuda-nope",)})
    with pytest.raises(gw.WheelError, match="optional-dependencies.cu13 has no such entry"):
        gw.gpu_requirements()


def test_image_list_lines_are_checked(tmp_path: Path) -> None:
    listing = tmp_path / "image.txt"
    listing.write_text("# comment\nTorch==2.11.0\nfoo_bar  # trailing\n")
    assert gw.image_packages(listing) == {"torch": Version("2.11.0"), "foo-bar": None}
    listing.write_text("torch 2.11\n")
    with pytest.raises(gw.WheelError, match="image.txt:1: 'torch 2.11' is not NAME"):
        gw.image_packages(listing)


def test_installed_requirements_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert gw.check_installed([Requirement("pytest>=1"),
                               Requirement('nothing-here; python_version < "3"')]) == []
    assert "pytest" in capsys.readouterr().out
    problems = gw.check_installed([Requirement("pytest<1"),
                                   Requirement("surely-not-installed-pkg")])
    assert problems[0].startswith("pytest ") and "does not satisfy pytest<1" in problems[0]
    assert problems[1] == ("surely-not-installed-pkg is not installed (needs "
                           "surely-not-installed-pkg)")
