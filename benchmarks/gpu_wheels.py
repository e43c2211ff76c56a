"""The wheels a lent GPU machine needs: flashtune's requirements that its image lacks.

    python3 benchmarks/gpu_wheels.py fetch [--dest .whl] [--max-mib 40]   # here, with network
    python3 benchmarks/gpu_wheels.py list                                 # the missing names
    python3 benchmarks/gpu_wheels.py install --site DIR [--wheels .whl]   # there, no network

The requirements of a GPU run are pyproject.toml's dependencies plus the GPU_EXTRAS entries
of its optional dependencies (CuPy, NVRTC and the runtime headers, pytest). The image's
packages are listed in benchmarks/gpu_image_packages.txt. ``fetch`` downloads, for the
image's Python (3.12, manylinux x86-64) and with ``pip download --no-deps``, every
requirement the image lacks, then every requirement of those (their wheels' Requires-Dist,
markers evaluated for the image) that the image lacks too, until nothing is missing; checks
that every specifier met on the way holds for the version fetched and that the wheels
together stay under ``--max-mib``; and replaces the wheels in DEST with them (one version of
each, listed in DEST/wheels.txt). It needs only python3 with pip (a fresh clone, no
virtual environment).

``install`` (on the GPU machine): installs the wheels of DIR made for this interpreter into
the target DIR (no index, no dependencies) and checks that every requirement of a GPU run
is then met, printing each one's version; exit status 1 when one is not.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from packaging.requirements import Requirement
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
else:
    try:  # a fresh machine's python3 may lack packaging; pip always carries a copy
        from packaging.requirements import Requirement
        from packaging.tags import sys_tags
        from packaging.utils import canonicalize_name, parse_wheel_filename
        from packaging.version import Version
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.tags import sys_tags
        from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
        from pip._vendor.packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
IMAGE_LIST = REPO / "benchmarks" / "gpu_image_packages.txt"

#: Optional dependencies a GPU run needs (extra -> distribution names). The cu13 extra's
#: header wheels (crt, cccl) and nvdisasm are left out: the image's NVRTC 13.0 compiles the
#: kernels with the runtime wheel's headers alone (benchmarks/nvrtc13_compat.sh).
GPU_EXTRAS: Mapping[str, tuple[str, ...]] = {
    "cu13": ("cupy-cuda13x", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime"),
    "dev": ("pytest", "pytest-timeout"),
    "plot": ("matplotlib",),
}

#: The image's interpreter and platform, for pip's target options and marker evaluation.
TARGET_PYTHON = "3.12"
TARGET_PLATFORMS = ("manylinux2014_x86_64", "manylinux1_x86_64",
                    *(f"manylinux_2_{n}_x86_64" for n in range(17, 40)))
TARGET_MARKERS: Mapping[str, str] = {
    "python_version": TARGET_PYTHON, "python_full_version": "3.12.3", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
    "implementation_name": "cpython", "platform_python_implementation": "CPython",
    "extra": "",
}
#: The most a device call carries (64 MiB) less room for the working tree itself.
DEFAULT_MAX_MIB = 40.0


class WheelError(Exception):
    """The wheel set cannot be made or installed as asked; the message says why."""


def _toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError as exc:
            raise WheelError("reading pyproject.toml needs Python 3.11+ (tomllib) or the "
                             "tomli package") from exc
    with path.open("rb") as f:
        data: dict[str, Any] = tomllib.load(f)
    return data


def gpu_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[Requirement]:
    """The requirements of a GPU run: the dependencies plus the GPU_EXTRAS entries."""
    project = _toml(pyproject)["project"]
    reqs = [Requirement(text) for text in project["dependencies"]]
    optional = project.get("optional-dependencies", {})
    for extra, names in GPU_EXTRAS.items():
        by_name = {canonicalize_name(r.name): r for r in map(Requirement, optional.get(extra, ()))}
        for name in names:
            if canonicalize_name(name) not in by_name:
                raise WheelError(f"GPU_EXTRAS names {name} in [{extra}], but pyproject.toml's "
                                 f"optional-dependencies.{extra} has no such entry")
            reqs.append(by_name[canonicalize_name(name)])
    return reqs


def image_packages(path: Path = IMAGE_LIST) -> dict[str, Version | None]:
    """The image's distributions: canonical name -> version (None where unknown)."""
    found: dict[str, Version | None] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()):
            raise WheelError(f"{path}:{number}: {raw!r} is not NAME or NAME==VERSION")
        found[canonicalize_name(name)] = Version(version) if version else None
    return found


def _applies(req: Requirement) -> bool:
    return req.marker is None or bool(req.marker.evaluate(dict(TARGET_MARKERS)))


def missing(reqs: Iterable[Requirement], image: Mapping[str, Version | None]
            ) -> list[Requirement]:
    """``reqs`` that apply to the image and that it lacks; WheelError where the image has a
    package in a known version that does not satisfy its requirement."""
    out = []
    for req in reqs:
        if not _applies(req):
            continue
        name = canonicalize_name(req.name)
        if name not in image:
            out.append(req)
            continue
        version = image[name]
        if version is not None and not req.specifier.contains(version, prereleases=True):
            raise WheelError(f"the image has {name} {version}, which does not satisfy {req}; "
                             f"carrying another {name} is not supported by this script")
    return out


@dataclass(frozen=True)
class Wheel:
    """One fetched wheel and the requirements it declares."""

    name: str
    version: Version
    path: Path
    requires: tuple[Requirement, ...]

    @classmethod
    def read(cls, path: Path) -> Wheel:
        name, version, _, _ = parse_wheel_filename(path.name)
        with zipfile.ZipFile(path) as zf:
            meta_name = next((n for n in zf.namelist()
                              if n.endswith(".dist-info/METADATA") and n.count("/") == 1), None)
            if meta_name is None:
                raise WheelError(f"{path.name} has no .dist-info/METADATA")
            meta = HeaderParser().parsestr(zf.read(meta_name).decode("utf-8", "replace"))
        requires = tuple(Requirement(r) for r in meta.get_all("Requires-Dist") or ())
        return cls(canonicalize_name(name), version, path, requires)


Fetch = Callable[[Requirement, Path], Path]


def pip_fetch(req: Requirement, dest: Path) -> Path:
    """``pip download --no-deps`` of ``req`` for the image's Python and platform into a fresh
    folder under ``dest``; the path of the wheel."""
    folder = Path(tempfile.mkdtemp(prefix="fetch-", dir=dest))
    plain = Requirement(str(req))
    plain.marker = None
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "--python-version", TARGET_PYTHON,
           "--implementation", "cp", "--abi", "cp" + TARGET_PYTHON.replace(".", ""),
           *(arg for p in TARGET_PLATFORMS for arg in ("--platform", p)),
           "-d", str(folder), str(plain)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    wheels = sorted(folder.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise WheelError(f"pip could not download one wheel of {plain} for CPython "
                         f"{TARGET_PYTHON} manylinux x86-64:\n{proc.stdout}{proc.stderr}")
    return wheels[0]


def resolve(reqs: Iterable[Requirement], image: Mapping[str, Version | None], fetch: Fetch,
            scratch: Path) -> list[Wheel]:
    """Fetch what the image lacks of ``reqs``, then what it lacks of their requirements,
    until nothing is missing. The first requirement met for a name picks its version; every
    later one must hold for it (WheelError otherwise)."""
    queue = list(missing(reqs, image))
    chosen: dict[str, Wheel] = {}
    seen: list[Requirement] = []
    while queue:
        req = queue.pop(0)
        seen.append(req)
        name = canonicalize_name(req.name)
        if name in chosen:
            continue
        wheel = Wheel.read(fetch(req, scratch))
        if wheel.name != name:
            raise WheelError(f"asked for {req}, got a wheel of {wheel.name}")
        chosen[name] = wheel
        queue.extend(missing(wheel.requires, image))
    for req in seen:
        wheel = chosen[canonicalize_name(req.name)]
        if not req.specifier.contains(wheel.version, prereleases=True):
            raise WheelError(f"{wheel.name} {wheel.version} was fetched but {req} is also "
                             "required; pin a version that satisfies both in pyproject.toml")
    return sorted(chosen.values(), key=lambda w: w.name)


def place(wheels: Sequence[Wheel], dest: Path, max_mib: float) -> Path:
    """Replace the wheels in ``dest`` with ``wheels`` (size-checked first); the listing."""
    total = sum(w.path.stat().st_size for w in wheels)
    if total > max_mib * 2**20:
        sizes = ", ".join(f"{w.path.name} {w.path.stat().st_size / 2**20:.1f} MiB"
                          for w in wheels)
        raise WheelError(f"the wheels take {total / 2**20:.1f} MiB, over the {max_mib} MiB "
                         f"limit: {sizes}")
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):  # one version of each: two stop the install there
        old.unlink()
    lines = []
    for w in wheels:
        shutil.copy2(w.path, dest / w.path.name)
        lines.append(f"{w.name}=={w.version}\t{w.path.name}\t{w.path.stat().st_size}")
    listing = dest / "wheels.txt"
    listing.write_text("\n".join(lines) + "\n")
    return listing


def fetch_wheels(dest: Path, max_mib: float, fetch: Fetch = pip_fetch,
                 reqs: Sequence[Requirement] | None = None,
                 image: Mapping[str, Version | None] | None = None) -> list[Wheel]:
    """The whole ``fetch`` command: resolve, check sizes, place in ``dest``."""
    with tempfile.TemporaryDirectory(prefix="flashtune-wheels-") as scratch:
        wheels = resolve(gpu_requirements() if reqs is None else reqs,
                         image_packages() if image is None else image, fetch, Path(scratch))
        place(wheels, dest, max_mib)
    return wheels


def usable(paths: Iterable[Path]) -> tuple[list[Path], list[Path]]:
    """The wheels among ``paths`` made for this interpreter, and the others."""
    supported = set(sys_tags())
    good: list[Path] = []
    other: list[Path] = []
    for path in paths:
        try:
            tags = parse_wheel_filename(path.name)[3]
        except Exception:
            other.append(path)
            continue
        (good if tags & supported else other).append(path)
    return good, other


def check_installed(reqs: Iterable[Requirement]) -> list[str]:
    """What is wrong with the installed distributions against ``reqs`` (empty: all met);
    prints each requirement's installed version."""
    import importlib.metadata as md

    problems = []
    for req in reqs:
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            problems.append(f"{req.name} is not installed (needs {req})")
            continue
        ok = req.specifier.contains(Version(version), prereleases=True)
        print(f"  {req.name} {version}" + ("" if ok else f"  (needs {req})"))
        if not ok:
            problems.append(f"{req.name} {version} does not satisfy {req}")
    return problems


def install(wheel_dir: Path, site: Path) -> int:
    """The ``install`` command; see the module docstring."""
    good, other = usable(sorted(wheel_dir.glob("*.whl")))
    for path in other:
        print(f"skipping {path.name}: not for this Python")
    if good:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
               "--no-compile", "--no-cache-dir", "--disable-pip-version-check", "--upgrade",
               "--target", str(site), *map(str, good)]
        if subprocess.run(cmd, timeout=300).returncode != 0:
            print(f"error: pip could not install the wheels of {wheel_dir}", file=sys.stderr)
            return 1
        print(f"installed {len(good)} wheel(s) into {site}")
        sys.path.insert(0, str(site))
    else:
        print(f"no usable wheels in {wheel_dir}: using the interpreter's own packages")
    print("requirements of a GPU run:")
    problems = check_installed(gpu_requirements())
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download the wheels the image lacks (needs network)")
    f.add_argument("--dest", type=Path, default=REPO / ".whl")
    f.add_argument("--max-mib", type=float, default=DEFAULT_MAX_MIB)
    sub.add_parser("list", help="print the requirements the image lacks (no network)")
    i = sub.add_parser("install", help="install carried wheels and check the requirements")
    i.add_argument("--wheels", type=Path, default=REPO / ".whl")
    i.add_argument("--site", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        if args.command == "list":
            for req in missing(gpu_requirements(), image_packages()):
                print(req)
            return 0
        if args.command == "install":
            return install(args.wheels, args.site)
        wheels = fetch_wheels(args.dest, args.max_mib)
    except WheelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sizes = {w.name: (args.dest / w.path.name).stat().st_size for w in wheels}
    for w in wheels:
        print(f"{w.name}=={w.version}  {sizes[w.name] / 2**20:.2f} MiB")
    print(f"{len(wheels)} wheel(s), {sum(sizes.values()) / 2**20:.2f} MiB in {args.dest} "
          f"(listed in {args.dest / 'wheels.txt'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
