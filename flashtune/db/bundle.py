"""The tuning bundle: a versioned, self-describing JSON file for sharing tuning results.

Layout (``schema_version`` 1)::

    {
      "format": "flashtune-tuning-bundle",
      "schema_version": 1,
      "flashtune_version": "0.1.0",          # the exporter's version
      "created_at": "2026-01-01T00:00:00+00:00",
      "content_sha256": "...",               # required; over everything but created_at
      "devices":  [{"name", "cc_major", "cc_minor", "sm_count", "memory_bytes",
                    "driver_version", "cuda_version", "nvrtc_version", "cupy_version"}],
      "problems": [{"key", "fields": {...}}],
      "configs":  [{"key", "fields": {...}}],
      "trials":   [{"uid", "device", "problem", "seqlen", "config", "status", "median_ms",
                    "min_ms", "max_ms", "count", "tflops", "predicted_ms", "error",
                    "template_digest", "flashtune_version", "host", "study",
                    "created_at", "shape_class" (only when not '')}],
      "best": ["<trial uid>", ...],           # the best trial of each bucket
      "template_digests": ["..."]             # every digest the trials were measured on
    }

Everything but ``created_at`` is a pure function of the content (lists sorted, keys
sorted), so exporting the same data twice differs only in ``created_at``, and
``content_sha256`` identifies the content (it is required, and checked). Reading is strict:
the file is size-capped and its structure counted before parsing (so a hostile file cannot
make the parser use more than a small multiple of its size), and unknown or missing fields,
wrong types, out-of-range values, illegal names, lone surrogates, problems, configs and
buckets that codegen refuses, timings that physics refuses, dangling references and a newer
schema version are all rejected with ``BundleError`` naming the offending field.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from flashtune.db.checks import physics_problem, semantic_problem
from flashtune.db.records import (
    DeviceRecord,
    Keyed,
    TrialRecord,
    check_datetime,
    check_digest,
    check_int,
    check_key,
    check_uid,
    check_version,
)
from flashtune.errors import BundleError

T = TypeVar("T")

FORMAT = "flashtune-tuning-bundle"
SCHEMA_VERSION = 1
#: Bundles larger than this are refused before parsing.
MAX_BUNDLE_BYTES = 64 * 1024 * 1024
MAX_ITEMS = 1_000_000
#: Structure a bundle may have per byte, counted before parsing (see ``_check_structure``):
#: flashtune's own bundles have one object or list per 150 to 600 bytes and one value per
#: 23 to 33 (compact or indented); the limits leave room for hand-written JSON and bound
#: the parser's memory to a small multiple of the file's size.
BYTES_PER_CONTAINER = 64
BYTES_PER_VALUE = 16
_QUOTE, _BACKSLASH, _BRACE, _BRACKET, _COMMA = b'"\\{[,'

_TOP = ("format", "schema_version", "flashtune_version", "created_at", "content_sha256",
        "devices", "problems", "configs", "trials", "best", "template_digests")
_OPTIONAL_TOP: frozenset[str] = frozenset()
_DEVICE_FIELDS = tuple(f.name for f in fields(DeviceRecord))
_TRIAL_FIELDS = ("uid", "device", "problem", "seqlen", "config", "status", "median_ms",
                 "min_ms", "max_ms", "count", "tflops", "predicted_ms", "error",
                 "template_digest", "flashtune_version", "host", "study", "created_at",
                 "shape_class")
#: Written only when not '', so the content (and its digest) of a bundle without shape
#: classes is what it was before they existed.
_OPTIONAL_TRIAL_FIELDS = frozenset({"shape_class"})


@dataclass(frozen=True)
class Bundle:
    """Devices, trials and the best trial uids of a bundle, validated."""

    devices: tuple[DeviceRecord, ...]
    trials: tuple[TrialRecord, ...]
    best: frozenset[str]
    flashtune_version: str
    created_at: datetime

    @property
    def problems(self) -> list[Keyed]:
        return sorted({t.problem for t in self.trials}, key=lambda k: k.key)

    @property
    def configs(self) -> list[Keyed]:
        return sorted({t.config for t in self.trials}, key=lambda k: k.key)

    @property
    def template_digests(self) -> list[str]:
        return sorted({t.template_digest for t in self.trials})

    @property
    def content_sha256(self) -> str:
        """The digest that identifies the content (what ``content_sha256`` holds)."""
        return content_digest(_content(self))


# ------------------------------------------------------------------------- writing


def _trial_dict(trial: TrialRecord) -> dict[str, Any]:
    return {
        "uid": trial.uid, "device": trial.device, "problem": trial.problem.key,
        "seqlen": trial.seqlen, "config": trial.config.key, "status": trial.status.value,
        "median_ms": trial.median_ms, "min_ms": trial.min_ms, "max_ms": trial.max_ms,
        "count": trial.count, "tflops": trial.tflops, "predicted_ms": trial.predicted_ms,
        "error": trial.error, "template_digest": trial.template_digest,
        "flashtune_version": trial.flashtune_version, "host": trial.host,
        "study": trial.study, "created_at": trial.created_at.isoformat(),
        **({"shape_class": trial.shape_class} if trial.shape_class else {}),
    }


def _content(bundle: Bundle) -> dict[str, Any]:
    trials = sorted(bundle.trials, key=lambda t: (t.created_at, t.uid))
    return {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "flashtune_version": bundle.flashtune_version,
        "devices": [{name: getattr(d, name) for name in _DEVICE_FIELDS}
                    for d in sorted(bundle.devices, key=lambda d: d.name)],
        "problems": [{"key": k.key, "fields": k.as_dict()} for k in bundle.problems],
        "configs": [{"key": k.key, "fields": k.as_dict()} for k in bundle.configs],
        "trials": [_trial_dict(t) for t in trials],
        "best": sorted(bundle.best),
        "template_digests": bundle.template_digests,
    }


def content_digest(content: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of ``content`` without created_at / content_sha256."""
    body = {k: v for k, v in content.items() if k not in ("created_at", "content_sha256")}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def to_dict(bundle: Bundle) -> dict[str, Any]:
    """The JSON object of ``bundle``, deterministic apart from ``created_at``."""
    content = _content(bundle)
    head = {"format": FORMAT, "schema_version": SCHEMA_VERSION,
            "flashtune_version": bundle.flashtune_version,
            "created_at": bundle.created_at.isoformat(),
            "content_sha256": content_digest(content)}
    return {**head, **content}


def dumps(bundle: Bundle) -> str:
    """The bundle as JSON text: the identifying fields first, then the data."""
    return json.dumps(to_dict(bundle), indent=1, ensure_ascii=True) + "\n"


def write_bundle(bundle: Bundle, path: Path) -> None:
    """Write ``bundle`` to ``path`` atomically (a reader never sees half a file);
    IsADirectoryError, naming a file to pass instead, when ``path`` is a directory (the
    rename would fail naming its temporary file)."""
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; expected the path of the bundle "
                                f"file to write, e.g. {path / 'tuning-bundle.json'}")
    text = dumps(bundle)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------------- reading


def read_bundle(path: Path, *, max_bytes: int = MAX_BUNDLE_BYTES) -> Bundle:
    """Read and fully validate the bundle at ``path`` (size-capped before parsing)."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise BundleError(f"bundle {path} has {size} bytes, more than the limit of "
                              f"{max_bytes}; split the export (--device/--problem/--best-only)")
        with path.open("rb") as handle:
            raw = handle.read(max_bytes + 1)
    except OSError as exc:
        raise BundleError(f"cannot read bundle {path}: {exc}") from exc
    return parse_bundle(raw, max_bytes=max_bytes, source=str(path))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r} in a JSON object")
        result[key] = value
    return result


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def structure_counts(raw: bytes, chunk: int | None = None) -> tuple[int, int]:
    """(objects and lists, values) of JSON text, counting ``{``, ``[`` and ``,`` outside
    strings, without parsing: vectorised over chunks (default: 1/32 of the text, between
    16 KiB and 1 MiB), so it costs a fraction of a second and buffers of a fraction of the
    text's size even for the largest bundle a reader accepts."""
    if chunk is None:
        chunk = max(1 << 14, min(1 << 20, len(raw) // 32))
    data = np.frombuffer(raw, dtype=np.uint8)
    containers = commas = 0
    inside = 0      # 1 while the scan is inside a string
    carried = 0     # backslashes that end the previous chunk
    for start in range(0, len(data), chunk):
        part = data[start:start + chunk]
        positions = np.arange(len(part))
        last = np.maximum.accumulate(np.where(part == _BACKSLASH, -1, positions))
        quotes = np.flatnonzero(part == _QUOTE)
        before = quotes - 1
        safe = np.maximum(before, 0)
        run = np.where(before >= 0, before - last[safe], 0)
        run = run + np.where((before < 0) | (last[safe] < 0), carried, 0)
        real = quotes[run % 2 == 0]  # a quote after an odd run of backslashes is escaped
        for symbols, is_container in (((_BRACE, _BRACKET), True), ((_COMMA,), False)):
            where = np.flatnonzero(np.isin(part, symbols))
            outside = int(((np.searchsorted(real, where) + inside) % 2 == 0).sum())
            if is_container:
                containers += outside
            else:
                commas += outside
        inside = (inside + len(real)) % 2
        carried = carried + len(part) if last[-1] < 0 else len(part) - 1 - int(last[-1])
    return containers, containers + commas


def _check_structure(raw: bytes, source: str) -> None:
    """Refuse, before parsing, a file with far more objects, lists or values per byte than
    a bundle has: parsed, each costs tens of bytes, so e.g. 63 MB of ``{}`` would take
    gigabytes. Structural characters inside strings are not counted."""
    containers, values = structure_counts(raw)
    if (containers > len(raw) // BYTES_PER_CONTAINER + 1024
            or values > len(raw) // BYTES_PER_VALUE + 4096):
        raise BundleError(
            f"{source} has {containers} JSON objects/lists and about {values} values in "
            f"{len(raw)} bytes, far more than a tuning bundle has (at most one object or list "
            f"per {BYTES_PER_CONTAINER} bytes and one value per {BYTES_PER_VALUE}); it is not "
            "a flashtune bundle")


def parse_bundle(raw: bytes, *, max_bytes: int = MAX_BUNDLE_BYTES,
                 source: str = "bundle") -> Bundle:
    """Parse and fully validate bundle bytes; raises BundleError naming the bad field."""
    if len(raw) > max_bytes:
        raise BundleError(f"{source} is larger than the limit of {max_bytes} bytes")
    _check_structure(raw, source)
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates,
                          parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BundleError(f"{source} is not valid JSON ({exc}); was it truncated or "
                          "edited by hand? Export it again") from None
    try:
        bundle = _from_json(data)
        check_bundle(bundle)
        # Last, so that a malformed field is named as such rather than as a changed bundle.
        if data["content_sha256"] != bundle.content_sha256:
            raise BundleError("content_sha256 does not match the content: the bundle was "
                              "changed or damaged after export; export it again from its "
                              "database")
    except BundleError as exc:
        raise BundleError(f"{source}: {exc}") from None
    return bundle


def _at(path: str, build: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``build(*args, **kwargs)``, with the ValueError of a bad field as a BundleError at
    ``path``."""
    try:
        return build(*args, **kwargs)
    except BundleError as exc:
        raise BundleError(f"{path}: {exc}") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise BundleError(f"{path}: {exc}") from None


def _object(value: object, path: str, names: Sequence[str],
            optional: frozenset[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BundleError(f"{path} must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(names))
    missing = sorted(set(names) - set(value) - optional)
    if unknown or missing:
        raise BundleError(f"{path} has unknown fields {unknown} / lacks fields {missing}; "
                          f"expected exactly {sorted(names)}")
    return value


def _list(value: object, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise BundleError(f"{path} must be a JSON list, got {type(value).__name__}")
    if len(value) > MAX_ITEMS:
        raise BundleError(f"{path} has {len(value)} entries; at most {MAX_ITEMS} allowed")
    return value


def _timestamp(value: object, what: str) -> datetime:
    if not isinstance(value, str) or len(value) > 40:
        raise ValueError(f"{what} must be an ISO 8601 timestamp string, got {value!r}")
    text = value[:-1] + "+00:00" if value.endswith("Z") else value
    return check_datetime(datetime.fromisoformat(text), what)


def _from_json(data: object) -> Bundle:
    top = _object(data, "bundle", _TOP, frozenset(_OPTIONAL_TOP))
    if top["format"] != FORMAT:
        raise BundleError(f"format is {top['format']!r}, not {FORMAT!r}: this is not a "
                          "flashtune tuning bundle")
    version = _at("schema_version", check_int, top["schema_version"], "schema_version", 1,
                  1 << 30)
    if version > SCHEMA_VERSION:
        raise BundleError(f"bundle schema version {version} is newer than this flashtune "
                          f"reads (up to {SCHEMA_VERSION}); upgrade flashtune to import it")
    if version != SCHEMA_VERSION:  # pragma: no cover - only version 1 exists
        raise BundleError(f"bundle schema version {version} is not supported")
    exporter = _at("flashtune_version", check_version, top["flashtune_version"],
                   "flashtune_version")
    created = _at("created_at", _timestamp, top["created_at"], "created_at")

    devices = []
    for i, item in enumerate(_list(top["devices"], "devices")):
        obj = _object(item, f"devices[{i}]", _DEVICE_FIELDS)
        devices.append(_at(f"devices[{i}]", DeviceRecord, **obj))
    problems = _keyed_table(top["problems"], "problems")
    configs = _keyed_table(top["configs"], "configs")
    trials = []
    for i, item in enumerate(_list(top["trials"], "trials")):
        obj = _object(item, f"trials[{i}]", _TRIAL_FIELDS, _OPTIONAL_TRIAL_FIELDS)
        trials.append(_at(f"trials[{i}]", _trial, obj, problems, configs))
    best = _list(top["best"], "best")
    for i, uid in enumerate(best):
        _at(f"best[{i}]", check_uid, uid, "trial uid")
    digests = _list(top["template_digests"], "template_digests")
    for i, digest in enumerate(digests):
        _at(f"template_digests[{i}]", check_digest, digest)
    if len(set(best)) != len(best):
        raise BundleError("best lists a trial uid twice")

    bundle = Bundle(tuple(devices), tuple(trials), frozenset(best), exporter, created)
    unused = sorted(set(problems) - {k.key for k in bundle.problems}) + sorted(
        set(configs) - {k.key for k in bundle.configs})
    if unused:
        raise BundleError(f"problems/configs {unused} are listed but used by no trial")
    if sorted(digests) != bundle.template_digests:
        raise BundleError(f"template_digests {sorted(digests)} differ from the digests of the "
                          f"trials {bundle.template_digests}")
    _at("content_sha256", check_digest, top["content_sha256"], "content_sha256")
    return bundle


def _keyed(obj: Mapping[str, Any]) -> Keyed:
    return Keyed.from_mapping(check_key(obj["key"], "key"), obj["fields"])


def _keyed_table(value: object, path: str) -> dict[str, Keyed]:
    table: dict[str, Keyed] = {}
    for i, item in enumerate(_list(value, path)):
        obj = _object(item, f"{path}[{i}]", ("key", "fields"))
        keyed = _at(f"{path}[{i}]", _keyed, obj)
        if keyed.key in table:
            raise BundleError(f"{path}[{i}]: key {keyed.key!r} is listed twice")
        table[keyed.key] = keyed
    return table


def _trial(obj: dict[str, Any], problems: Mapping[str, Keyed],
           configs: Mapping[str, Keyed]) -> TrialRecord:
    for name, table in (("problem", problems), ("config", configs)):
        if not isinstance(obj[name], str) or obj[name] not in table:
            raise ValueError(f"{name} {obj[name]!r} is not listed in the bundle's {name}s")
    values = dict(obj, problem=problems[obj["problem"]], config=configs[obj["config"]],
                  created_at=_timestamp(obj["created_at"], "created_at"))
    if not isinstance(values["status"], str):
        raise ValueError(f"status must be a string, got {values['status']!r}")
    return TrialRecord(**values)


def check_bundle(bundle: Bundle) -> None:
    """Semantic, physical and cross-reference checks of a bundle (also used for merges).

    Problems, configs and buckets must be legal by codegen's rules with canonical keys;
    every trial's device must be listed and its timing physically possible on it; trial
    uids unique; every best uid must name an ``ok`` trial, at most one per bucket.
    """
    names = [d.name for d in bundle.devices]
    if len(set(names)) != len(names):
        raise BundleError("a device name is listed twice")
    devices = {d.name: d for d in bundle.devices}
    uids: dict[str, TrialRecord] = {}
    for trial in bundle.trials:
        if trial.device not in names:
            raise BundleError(f"trial {trial.uid}: device {trial.device!r} is not listed")
        if trial.uid in uids:
            raise BundleError(f"trial uid {trial.uid} appears twice")
        uids[trial.uid] = trial
        reason = semantic_problem(trial) or physics_problem(trial, devices[trial.device])
        if reason is not None:
            raise BundleError(reason)
    buckets: set[tuple[str, str, int, str]] = set()
    for uid in sorted(bundle.best):
        best = uids.get(uid)
        if best is None:
            raise BundleError(f"best trial {uid} is not among the trials")
        if not best.can_be_best:
            raise BundleError(f"best trial {uid} has status {best.status.value!r}; only 'ok' "
                              "trials with a time can be best")
        bucket = (best.device, best.problem.key, best.seqlen, best.shape_class)
        if bucket in buckets:
            raise BundleError(f"two best trials for {best.device!r} {best.bucket}")
        buckets.add(bucket)
