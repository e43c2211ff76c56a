"""A recorded tuning landscape: its file, its search space and its record.

A landscape is a brute-forced search space of one kernel on one GPU: every configuration
compiled and timed on the device, in the "T4" auto-tuning output format (gzip JSON:
``results[]`` with ``configuration``, ``times`` in ms - ``compilation``, ``framework``,
``runtimes`` - the objective in ``measurements`` and ``invalidity``: ``correct``, or
``compile`` / ``runtime`` for a failure there).

Two landscapes ship with flashtune as package data (``flashtune/tuner/landscapes``: the 2D
convolution on an NVIDIA A100 and an A6000, MIT-licensed, see its README): ``--replay
convolution_A6000`` names one (``resolve_landscape``), a path names any other file.

``Landscape.load`` turns one into a ``SearchSpace`` (each parameter's recorded values in
ascending order; legal = recorded) plus the record of every point, which
``measure.recorded.RecordedMeasurer`` answers from when the search is replayed on it
(``flashtune.tuner.replay``). ``parse_budget`` reads a run's time budget.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashtune.codegen.params import Param, ParamSpace, Point, Value
from flashtune.db.records import TrialStatus
from flashtune.errors import TuningError
from flashtune.tuner.measure.recorded import Config, Recorded
from flashtune.tuner.search.space import SearchSpace

#: The landscapes shipped as package data.
PACKAGED_DIR = Path(__file__).resolve().parent / "landscapes"
_SUFFIXES = (".json.gz", ".json")

_FAILURES = {"compile": TrialStatus.COMPILE_FAILED, "runtime": TrialStatus.RUNTIME_FAILED,
             "correctness": TrialStatus.WRONG_RESULT}
#: Objectives whose name says higher is better; every other one (time) is minimised.
_HIGHER_IS_BETTER = re.compile(r"flop|throughput|bandwidth|/s\b", re.IGNORECASE)


def packaged_landscapes() -> list[str]:
    """Names of the landscapes shipped with flashtune (``convolution_A6000``, ...)."""
    return sorted(p.name.split(".")[0] for p in PACKAGED_DIR.glob("*.json*"))


def resolve_landscape(name_or_path: str | Path) -> Path:
    """The file of a landscape: an existing path as given, else the packaged landscape of
    that name (``convolution_A6000`` or ``convolution_A6000.json.gz``); TuningError naming
    the packaged ones when it is neither."""
    path = Path(name_or_path)
    if path.exists() or len(path.parts) != 1:
        return path
    for suffix in ("", *_SUFFIXES):
        candidate = PACKAGED_DIR / f"{path.name}{suffix}"
        if candidate.is_file():
            return candidate
    raise TuningError(f"no landscape file {str(name_or_path)!r} and no packaged landscape of "
                      f"that name; give a path to a T4 file or one of "
                      f"{packaged_landscapes()}")


def _value(raw: Any) -> Value:
    if isinstance(raw, bool | int | str):
        return raw
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    return repr(raw)


def _order(values: set[Value]) -> tuple[Value, ...]:
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return tuple(sorted(values, key=int))
    return tuple(sorted(values, key=str))


@dataclass(frozen=True)
class Landscape:
    """A recorded landscape (see the module docstring)."""

    path: Path
    kernel: str
    device: str
    objective: str
    minimize: bool
    space: SearchSpace
    records: Mapping[Config, Recorded] = field(repr=False)

    @staticmethod
    def load(path: str | Path) -> Landscape:
        """Read a T4 landscape (a path, or the name of a packaged one: see
        ``resolve_landscape``); TuningError saying what is wrong with a malformed file."""
        path = resolve_landscape(path)
        try:
            with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as f:
                data = json.load(f)
            results = data["results"]
            configs = [r["configuration"] for r in results]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TuningError(f"cannot read the landscape {path}: {exc}; expected a T4 file "
                              "(gzip JSON with results[].configuration, times, "
                              "measurements, invalidity)") from exc
        if not results:
            raise TuningError(f"the landscape {path} has no results")
        names = list(configs[0])
        values: dict[str, set[Value]] = {n: set() for n in names}
        for c in configs:
            for n in names:
                values[n].add(_value(c[n]))
        params = ParamSpace(tuple(Param(n, _order(values[n])) for n in names))
        objective = str((results[0].get("objectives") or ["time"])[0])
        records: dict[Config, Recorded] = {}
        for r in results:
            key = tuple(_value(r["configuration"][n]) for n in names)
            records[key] = _record(r, objective, path)
        stem = path.name.split(".")[0]
        kernel, _, device = stem.rpartition("_")
        recorded = frozenset(records)

        def legality(point: Point) -> str | None:
            if tuple(point[n] for n in names) in recorded:
                return None
            return f"not in the recorded space of {path.name} (a restriction of the kernel)"

        return Landscape(path, kernel or stem, device or "unknown", objective,
                         not _HIGHER_IS_BETTER.search(objective),
                         SearchSpace(params, legality), records)

    @property
    def brute_force_s(self) -> float:
        """What measuring every configuration cost (the 100% of a relative budget)."""
        return sum(r.seconds for r in self.records.values())

    @property
    def optimum(self) -> float:
        """The best recorded objective."""
        ok = [r.objective for r in self.records.values() if r.objective is not None]
        if not ok:
            raise TuningError(f"no configuration of {self.path.name} succeeded")
        return min(ok) if self.minimize else max(ok)

    def quality(self, objective: float | None) -> float:
        """``objective`` relative to the optimum, in (0, 1]: 1 is the best (0: none)."""
        if objective is None:
            return 0.0
        return self.optimum / objective if self.minimize else objective / self.optimum

    def sibling(self, device: str) -> Path:
        """The landscape of the same kernel on ``device`` in the same directory."""
        for suffix in _SUFFIXES:
            candidate = self.path.with_name(f"{self.kernel}_{device}{suffix}")
            if candidate.exists():
                return candidate
        others = sorted(p.name for p in self.path.parent.glob(f"{self.kernel}_*.json*"))
        raise TuningError(f"no landscape of {self.kernel} on {device} next to {self.path}; "
                          f"found {others}")


def _record(r: Mapping[str, Any], objective: str, path: Path) -> Recorded:
    times = r.get("times", {})
    ms = (float(times.get("compilation", 0.0)) + float(times.get("framework", 0.0))
          + sum(float(t) for t in times.get("runtimes", [])))
    invalidity = str(r.get("invalidity", "correct"))
    if invalidity != "correct":
        return Recorded(_FAILURES.get(invalidity, TrialStatus.RUNTIME_FAILED), None, ms / 1e3)
    value = next((m.get("value") for m in r.get("measurements", [])
                  if m.get("name") == objective), None)
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise TuningError(f"{path.name}: a correct result has no numeric {objective!r} "
                          f"measurement ({value!r})")
    return Recorded(TrialStatus.OK, float(value), ms / 1e3)


def parse_budget(text: str, landscape: Landscape | None = None) -> float:
    """Seconds of a budget: ``'5%'`` of a landscape's brute-force time (replay only), or a
    duration such as ``'10m'``, ``'1h30m'``, ``'90s'`` or plain seconds."""
    raw = text.strip().lower()
    if raw.endswith("%"):
        if landscape is None:
            raise TuningError(f"budget {text!r}: a percentage is of a landscape's brute-force "
                              "time, so it needs --replay; give a duration such as '10m'")
        try:
            share = float(raw[:-1])
        except ValueError:
            share = -1.0
        if not 0 < share <= 100:
            raise TuningError(f"budget {text!r} must be a percentage in (0, 100], e.g. '5%'")
        return landscape.brute_force_s * share / 100
    if re.fullmatch(r"\d+(\.\d+)?", raw):
        return float(raw)
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", raw)
    if not raw or not match or not any(match.groups()):
        raise TuningError(f"budget {text!r} is malformed; expected e.g. '10m', '1h30m', "
                          "'90s', seconds, or with --replay a percentage such as '5%'")
    hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    return float(hours * 3600 + minutes * 60 + seconds)
