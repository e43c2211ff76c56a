"""Helpers shared by the benchmark scripts: statistics, FLOP counts, provenance, output.

The scripts under benchmarks/ are run as files (``python benchmarks/host.py``), not as a
package, so each one imports this module through :func:`add_benchmarks_to_path`.
"""

from __future__ import annotations

import csv
import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCHMARKS_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCHMARKS_DIR.parent


def add_benchmarks_to_path() -> None:
    """Make the sibling benchmark modules (compile_time, host_overhead, ...) importable,
    and the repository's flashtune importable when it is not installed."""
    for path in (BENCHMARKS_DIR, REPO_ROOT):
        text = str(path)
        if text not in sys.path:
            sys.path.insert(0 if path == BENCHMARKS_DIR else len(sys.path), text)


@dataclass(frozen=True)
class Stats:
    """Summary of repeated measurements of one quantity (any unit)."""

    median: float
    minimum: float
    maximum: float
    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"Stats needs at least one sample, got count={self.count}")
        if not (self.minimum <= self.median <= self.maximum):
            raise ValueError(f"inconsistent stats: min {self.minimum}, median {self.median}, "
                             f"max {self.maximum}")

    @classmethod
    def of(cls, samples: Iterable[float]) -> Stats:
        values = [float(s) for s in samples]
        if not values:
            raise ValueError("Stats.of() needs at least one sample; got none")
        if any(math.isnan(v) for v in values):
            raise ValueError(f"a sample is NaN: {values}")
        return cls(statistics.median(values), min(values), max(values), len(values))


def attention_flops(batch: int, seqlen_q: int, seqlen_k: int, heads: int, head_dim: int,
                    causal: bool) -> float:
    """Forward FLOPs as the field counts them: 4*B*Nq*Nk*H*D, halved when causal.

    The halving is the convention for Nq == Nk (FlashAttention's benchmark); it is applied
    as is for other lengths too, so numbers stay comparable with published ones.
    """
    for name, value in (("batch", batch), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k),
                        ("heads", heads), ("head_dim", head_dim)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    flops = 4.0 * batch * seqlen_q * seqlen_k * heads * head_dim
    return flops / 2 if causal else flops


def utc_now() -> str:
    """The current time as an ISO-8601 UTC string (seconds)."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def _version(*distributions: str) -> str:
    """Installed version of the first of ``distributions`` that is installed, read from its
    metadata (nothing is imported)."""
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def _flashtune_version() -> str:
    try:
        from flashtune._version import __version__
    except ImportError:
        return "not importable"
    return __version__


def _first_line(argv: Sequence[str], cwd: Path | None = None) -> str | None:
    """First output line of a quick command, or None when it cannot run."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=10,
                              cwd=cwd, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0] if lines else None


def _git_revision() -> str | None:
    """The repository's commit, with ``+dirty`` when the tree has changes."""
    commit = _first_line(["git", "rev-parse", "--short=12", "HEAD"], REPO_ROOT)
    if commit is None:
        return None
    dirty = _first_line(["git", "status", "--porcelain", "--untracked-files=no"], REPO_ROOT)
    return commit + ("+dirty" if dirty else "")


def _host_cxx() -> str:
    """The emulator's host compiler (the FLASHTUNE_CXX setting)."""
    try:
        from flashtune import settings
    except ImportError:
        return "g++"
    return settings.HOST_CXX.get()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment_info(probe_gpu: bool = True) -> dict[str, Any]:
    """Provenance of a measurement: date, machine, library versions and, with ``probe_gpu``
    (which imports torch and CuPy), the GPU and the NVRTC version."""
    info: dict[str, Any] = {
        "date_utc": utc_now(),
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "flashtune": _flashtune_version(),
        "torch": _version("torch"),
        "cupy": _version("cupy-cuda13x", "cupy-cuda12x", "cupy"),
        "git": _git_revision(),
        "host_cxx": _first_line([_host_cxx(), "--version"]),
        "gpu": None,
    }
    if not probe_gpu:
        return info
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = props.name
            info["gpu_capability"] = f"{props.major}.{props.minor}"
            info["gpu_sms"] = props.multi_processor_count
            info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    except Exception as exc:  # provenance must never stop a benchmark
        info["torch_error"] = repr(exc)
    try:  # the NVRTC flashtune compiles with
        from flashtune.toolchain import nvrtc
        from flashtune.toolchain.cuda import find_toolchain

        major, minor = nvrtc.load(find_toolchain().nvrtc_path).version
        info["nvrtc"] = f"{major}.{minor}"
    except Exception as exc:
        info["nvrtc"] = f"unavailable ({type(exc).__name__})"
    return info


def write_csv(path: Path, fieldnames: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> None:
    """Write ``rows`` to ``path`` atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(fieldnames))
            writer.writeheader()
            for row in rows:
                unknown = set(row) - set(fieldnames)
                if unknown:
                    raise ValueError(f"row has column(s) {sorted(unknown)} not among "
                                     f"{list(fieldnames)}")
                writer.writerow({k: _cell(row.get(k)) for k in fieldnames})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else value


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


class Deadline:
    """A wall-clock budget; ``None`` seconds means no limit."""

    def __init__(self, seconds: float | None) -> None:
        if seconds is not None and seconds <= 0:
            raise ValueError(f"a time budget must be > 0 seconds, got {seconds}")
        self._end = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float:
        return math.inf if self._end is None else self._end - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0


def format_seconds(seconds: float) -> str:
    """Human-readable duration with a unit that keeps 3 significant digits."""
    if math.isnan(seconds):
        return "nan"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _main(argv: Sequence[str]) -> int:
    """``python benchmarks/_common.py --env-json PATH``: record the environment."""
    if len(argv) != 2 or argv[0] != "--env-json":
        print("usage: python benchmarks/_common.py --env-json PATH", file=sys.stderr)
        return 2
    info = environment_info()
    write_json(Path(argv[1]), info)
    print(json.dumps(info, indent=2, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
