"""Plain, validated values that go into and come out of the tuning database.

Every record is a frozen dataclass that checks its own fields on construction (types,
ranges, string lengths and character sets), so a record that exists is safe to store, to
print and to share. Bundle import builds these records from untrusted JSON, which makes this
module the single place where field-level rules live; the semantic rules of problems and
configs (legal head dims, block sizes, ...) are codegen's own: ``Problem``,
``KernelConfig``, ``ProblemBucket`` and ``get_arch`` (db may import codegen, nothing above).
"""

from __future__ import annotations

import functools
import math
import re
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from importlib import metadata
from typing import Literal, Protocol

from flashtune.codegen.arch import ArchSpec, get_arch
from flashtune.codegen.spec import SHAPE_CLASS_RE, KernelConfig, Problem, ProblemBucket
from flashtune.errors import InvalidConfig

#: JSON scalars allowed as values of problem/config fields.
FieldValue = str | int | float | bool | None


class TrialStatus(str, Enum):
    """Outcome of one tuning trial.

    Only ``ok`` trials carry a timing and only they can become the best of a bucket;
    ``verified_untimed`` is a dry run that compiled and verified without timing.
    """

    OK = "ok"
    VERIFIED_UNTIMED = "verified_untimed"
    INVALID = "invalid"
    COMPILE_FAILED = "compile_failed"
    RUNTIME_FAILED = "runtime_failed"
    WRONG_RESULT = "wrong_result"

    @property
    def failed(self) -> bool:
        """True for outcomes the tuner must never retry with the same kernel source."""
        return self in FAILED_STATUSES


FAILED_STATUSES = frozenset({TrialStatus.INVALID, TrialStatus.COMPILE_FAILED,
                             TrialStatus.RUNTIME_FAILED, TrialStatus.WRONG_RESULT})

#: Which result a merge or an import keeps per bucket when both sides have one (here, with
#: the choices, so that the command line lists them without importing SQLAlchemy; the first
#: is the default): ``local-first`` as ``faster``, except that a result measured here (not
#: imported) is never displaced; ``faster`` the faster median; ``ours``; ``theirs``.
Prefer = Literal["local-first", "ours", "theirs", "faster"]
PREFER_CHOICES: tuple[Prefer, ...] = ("local-first", "faster", "ours", "theirs")

# Limits: generous for any real GPU or measurement, small enough to reject absurd input.
MAX_NAME_LEN = 128
MAX_HOST_LEN = 253
MAX_VERSION_LEN = 64
MAX_ERROR_LEN = 16_384
MAX_TIME_MS = 1e7              # about 2.8 hours for one kernel launch
MAX_TFLOPS = 1e5               # 100 PFLOP/s on one device
MAX_TIMING_COUNT = 1_000_000
MAX_SEQLEN = 1 << 24
MAX_SM_COUNT = 10_000
MAX_MEMORY_BYTES = 1 << 50     # 1 PiB
MAX_FIELDS = 32

_DEVICE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._()/+:,@-]*")
_KEY_RE = re.compile(r"[a-z0-9][a-z0-9_.-]*")
_FIELD_NAME_RE = re.compile(r"[a-z][a-z0-9_]*")
_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+_-]*")
_HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_STUDY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/=+-]*")
_DIGEST_RE = re.compile(r"[0-9a-f]{8,128}")
_UID_RE = re.compile(r"[0-9a-f]{32}")
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SURROGATE_RE = re.compile(r"[\ud800-\udfff]")
#: Characters that reorder or break the text around them when printed: bidi embeddings,
#: overrides and isolates, marks, line and paragraph separators (and control characters).
_UNPRINTABLE_RE = re.compile(
    r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e"
    r"\u2066-\u2069\ud800-\udfff\ufeff]")


def check_int(value: object, what: str, lo: int, hi: int) -> int:
    """``value`` as an int in [lo, hi]; bools and numeric strings are refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{what}={value} is out of range; expected {lo} <= {what} <= {hi}")
    return value


def check_float(value: object, what: str, lo: float, hi: float) -> float:
    """``value`` as a finite float in [lo, hi]; ints are accepted, bools and strings are not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number) or not lo <= number <= hi:
        raise ValueError(f"{what}={value!r} is out of range; expected a finite number in "
                         f"[{lo:g}, {hi:g}]")
    return number


def check_text(value: object, what: str, pattern: re.Pattern[str], max_len: int,
               example: str) -> str:
    """``value`` as a string of at most ``max_len`` characters that fully matches ``pattern``."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__} {value!r}")
    if not 1 <= len(value) <= max_len:
        raise ValueError(f"{what} must have 1 to {max_len} characters, got {len(value)}")
    if not pattern.fullmatch(value):
        shown = value if len(value) <= 60 else value[:57] + "..."
        raise ValueError(f"{what}={shown!r} has characters outside {pattern.pattern!r} "
                         f"(e.g. {example!r})")
    return value


def check_key(value: object, what: str) -> str:
    return check_text(value, what, _KEY_RE, MAX_NAME_LEN, "fwd_d128_bf16_causal")


def check_digest(value: object, what: str = "template_digest") -> str:
    return check_text(value, what, _DIGEST_RE, 128, "lowercase hex, 8 to 128 digits")


def check_uid(value: object, what: str = "uid") -> str:
    return check_text(value, what, _UID_RE, 32, "32 lowercase hex digits")


def check_version(value: object, what: str) -> str:
    return check_text(value, what, _VERSION_RE, MAX_VERSION_LEN, "13.0.48")


def check_device_name(value: object, what: str = "device name") -> str:
    return check_text(value, what, _DEVICE_NAME_RE, MAX_NAME_LEN, "NVIDIA H100 80GB HBM3")


def check_study(value: object, what: str = "study") -> str:
    return check_text(value, what, _STUDY_RE, MAX_NAME_LEN, "h100/fwd_d128_bf16_causal")


def check_error_text(value: object, what: str = "error") -> str:
    """Free text shown to people: bounded, and free of control characters (no escape codes)."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    if len(value) > MAX_ERROR_LEN:
        raise ValueError(f"{what} has {len(value)} characters; at most {MAX_ERROR_LEN} allowed")
    bad = _CONTROL_RE.search(value)
    if bad:
        raise ValueError(f"{what} contains the control character {bad.group()!r} at "
                         f"{bad.start()}; only printable text, tabs and newlines are allowed")
    lone = _SURROGATE_RE.search(value)
    if lone:
        raise ValueError(f"{what} contains the lone surrogate \\u{ord(lone.group()):04x} at "
                         f"{lone.start()}, which is not text (it cannot be stored or printed)")
    return value


def printable(text: str) -> str:
    """``text`` safe to print to a terminal: control, bidi-reordering and line-separator
    characters (and lone surrogates) are shown as ``\\uXXXX`` escapes, so stored text can
    neither hide nor reorder what is printed around it. Newlines and tabs are kept."""
    return _UNPRINTABLE_RE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def check_datetime(value: object, what: str) -> datetime:
    """An aware datetime, returned in UTC."""
    if not isinstance(value, datetime):
        raise ValueError(f"{what} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None:
        raise ValueError(f"{what}={value.isoformat()} has no time zone; use UTC")
    if not 2000 <= value.year <= 2200:
        raise ValueError(f"{what}={value.isoformat()} is not a plausible time (years 2000-2200)")
    return value.astimezone(timezone.utc)


def truncate_error(text: str) -> str:
    """Make arbitrary compiler or runtime output storable: strip control characters, cap it."""
    clean = _SURROGATE_RE.sub("?", _CONTROL_RE.sub("?", text))
    if len(clean) <= MAX_ERROR_LEN:
        return clean
    note = "\n[... truncated ...]\n"
    half = (MAX_ERROR_LEN - len(note)) // 2
    return clean[:half] + note + clean[-half:]


@functools.cache
def this_host() -> str:
    """This machine's host name, reduced to the characters a stored host name may have."""
    raw = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:MAX_HOST_LEN].strip("-.")
    return raw or "localhost"


@functools.cache
def this_version() -> str:
    """The installed flashtune version (read from package metadata, not from flashtune)."""
    try:
        return metadata.version("flashtune")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def new_uid() -> str:
    return uuid.uuid4().hex


class SupportsKey(Protocol):
    """What Problem and KernelConfig offer: a canonical key and a plain-dict form."""

    def key(self) -> str: ...

    def to_dict(self) -> Mapping[str, object]: ...


@dataclass(frozen=True)
class Keyed:
    """A problem or config as stored: its canonical key and its fields (JSON scalars)."""

    key: str
    fields: tuple[tuple[str, FieldValue], ...]

    def __post_init__(self) -> None:
        check_key(self.key, "key")
        if not isinstance(self.fields, tuple) or len(self.fields) > MAX_FIELDS:
            raise ValueError(f"fields of {self.key!r} must be a tuple of at most {MAX_FIELDS} "
                             "(name, value) pairs")
        names = [name for name, _ in self.fields]
        if names != sorted(set(names)):
            raise ValueError(f"field names of {self.key!r} must be unique and sorted")
        for name, value in self.fields:
            check_text(name, f"field name of {self.key!r}", _FIELD_NAME_RE, 32, "head_dim")
            if isinstance(value, str):
                check_key(value, f"{self.key}.{name}")
            elif isinstance(value, float):
                check_float(value, f"{self.key}.{name}", -1e12, 1e12)
            elif isinstance(value, int) and not isinstance(value, bool):
                check_int(value, f"{self.key}.{name}", -(1 << 40), 1 << 40)
            elif not (value is None or isinstance(value, bool)):
                raise ValueError(f"{self.key}.{name} must be a JSON scalar, got "
                                 f"{type(value).__name__}")

    @classmethod
    def from_mapping(cls, key: str, fields: Mapping[str, object]) -> Keyed:
        """Build from a key and a dict of fields (which must be JSON scalars)."""
        if not isinstance(fields, Mapping):
            raise ValueError(f"fields of {key!r} must be an object, got {type(fields).__name__}")
        items: list[tuple[str, FieldValue]] = []
        for name, value in sorted(fields.items()):
            if not (value is None or isinstance(value, (str, int, float, bool))):
                raise ValueError(f"{key}.{name} must be a JSON scalar, got "
                                 f"{type(value).__name__}")
            items.append((name, value))
        return cls(key, tuple(items))

    @classmethod
    def of(cls, obj: SupportsKey) -> Keyed:
        """From a Problem or KernelConfig (enum values are stored by their ``value``)."""
        fields = {name: getattr(value, "value", value) for name, value in obj.to_dict().items()}
        return cls.from_mapping(obj.key(), fields)

    def as_dict(self) -> dict[str, FieldValue]:
        return dict(self.fields)


@dataclass(frozen=True)
class DeviceRecord:
    """A GPU as identified in the database.

    ``name`` identifies the device; the hardware fields must stay the same for a name, the
    software versions are the latest seen. ``arch`` (e.g. ``sm_90``) is the family used when
    no result exists for this exact device.
    """

    name: str
    cc_major: int
    cc_minor: int
    sm_count: int
    memory_bytes: int
    driver_version: str
    cuda_version: str
    nvrtc_version: str
    cupy_version: str

    def __post_init__(self) -> None:
        check_device_name(self.name)
        check_int(self.cc_major, "cc_major", 1, 99)
        check_int(self.cc_minor, "cc_minor", 0, 9)
        check_int(self.sm_count, "sm_count", 1, MAX_SM_COUNT)
        check_int(self.memory_bytes, "memory_bytes", 1, MAX_MEMORY_BYTES)
        for name in ("driver_version", "cuda_version", "nvrtc_version", "cupy_version"):
            check_version(getattr(self, name), name)

    @property
    def arch(self) -> str:
        return f"sm_{self.cc_major}{self.cc_minor}"

    @property
    def arch_spec(self) -> ArchSpec | None:
        """codegen's description of this device's arch, or None if flashtune has none."""
        try:
            return get_arch(self.arch)
        except InvalidConfig:
            return None

    @property
    def hardware(self) -> tuple[int, int, int, int]:
        """The fields that must not change for a given device name."""
        return (self.cc_major, self.cc_minor, self.sm_count, self.memory_bytes)


@dataclass(frozen=True)
class TrialRecord:
    """One measured (or failed) config for a (device, problem, seqlen bucket, shape class).

    Timings are in milliseconds: ``median_ms``/``min_ms``/``max_ms`` over ``count`` timed
    runs. ``template_digest`` is the digest of the kernel source that was measured
    (``KernelSource.digest``); ``uid`` identifies the trial across databases and bundles.
    ``error`` must be printable text of bounded length: pass raw compiler or runtime output
    through ``truncate_error`` first. ``shape_class``: the bucket's class of call shapes
    (``ProblemBucket.shape_class``; '' for none).
    """

    device: str
    problem: Keyed
    seqlen: int
    config: Keyed
    status: TrialStatus
    template_digest: str
    shape_class: str = ""
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    count: int = 0
    tflops: float | None = None
    predicted_ms: float | None = None
    error: str | None = None
    study: str | None = None
    host: str = field(default_factory=this_host)
    flashtune_version: str = field(default_factory=this_version)
    created_at: datetime = field(default_factory=now_utc)
    uid: str = field(default_factory=new_uid)

    def __post_init__(self) -> None:
        check_device_name(self.device, "device")
        if not isinstance(self.problem, Keyed) or not isinstance(self.config, Keyed):
            raise ValueError("problem and config must be Keyed values (use Keyed.of(...))")
        check_int(self.seqlen, "seqlen", 1, MAX_SEQLEN)
        if not isinstance(self.shape_class, str) or (
                self.shape_class and not SHAPE_CLASS_RE.match(self.shape_class)):
            raise ValueError(f"shape_class={self.shape_class!r} is malformed; expected '' or a "
                             "lowercase word of letters and digits, e.g. 'g8q4p16'")
        try:
            object.__setattr__(self, "status", TrialStatus(self.status))
        except ValueError:
            raise ValueError(f"status={self.status!r} is not one of "
                             f"{[s.value for s in TrialStatus]}") from None
        check_digest(self.template_digest)
        for name in ("median_ms", "min_ms", "max_ms", "predicted_ms"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_float(value, name, 0.0, MAX_TIME_MS))
        if self.tflops is not None:
            object.__setattr__(self, "tflops", check_float(self.tflops, "tflops", 0.0, MAX_TFLOPS))
        check_int(self.count, "count", 0, MAX_TIMING_COUNT)
        if self.error is not None:
            check_error_text(self.error)
        if self.study is not None:
            check_study(self.study)
        check_text(self.host, "host", _HOST_RE, MAX_HOST_LEN, "gpu-node-01")
        check_version(self.flashtune_version, "flashtune_version")
        object.__setattr__(self, "created_at", check_datetime(self.created_at, "created_at"))
        check_uid(self.uid)
        self._check_timings()

    def _check_timings(self) -> None:
        times = (self.median_ms, self.min_ms, self.max_ms)
        if self.status is TrialStatus.OK:
            if self.median_ms is None or self.min_ms is None or self.max_ms is None:
                raise ValueError("an 'ok' trial needs median_ms, min_ms and max_ms")
            if self.count < 1:
                raise ValueError("an 'ok' trial needs count >= 1 timed runs")
            if not (self.min_ms <= self.median_ms <= self.max_ms) or self.median_ms <= 0:
                raise ValueError(f"timings must satisfy 0 < min_ms <= median_ms <= max_ms, got "
                                 f"{self.min_ms}, {self.median_ms}, {self.max_ms}")
        elif any(t is not None for t in times) or self.count or self.tflops is not None:
            raise ValueError(f"a {self.status.value!r} trial has no timings; only 'ok' trials "
                             "carry median_ms/min_ms/max_ms/count/tflops")

    @property
    def bucket(self) -> str:
        tail = f"_{self.shape_class}" if self.shape_class else ""
        return f"{self.problem.key}_n{self.seqlen}{tail}"

    def problem_bucket(self) -> ProblemBucket:
        """The trial's bucket as codegen's value (raises InvalidProblem when illegal)."""
        return ProblemBucket(Problem.from_key(self.problem.key), self.seqlen, self.shape_class)

    def kernel_config(self) -> KernelConfig:
        """The trial's config as codegen's value (raises InvalidConfig when illegal)."""
        return KernelConfig.from_key(self.config.key)

    @property
    def can_be_best(self) -> bool:
        return self.status is TrialStatus.OK and self.median_ms is not None


@dataclass(frozen=True)
class Provenance:
    """Where imported rows came from: one import (of a bundle or another database).

    ``bundle_sha256`` is the content digest of what was imported; ``source`` the file or
    database it was read from; ``exported_by``/``exported_at`` what the bundle claims about
    its export; ``trusted`` whether the user marked the import as a trusted source.
    """

    bundle_sha256: str
    source: str
    exported_by: str
    exported_at: datetime
    imported_at: datetime
    imported_by: str
    trusted: bool

    def __post_init__(self) -> None:
        check_text(self.bundle_sha256, "bundle_sha256", _DIGEST_RE, 64, "64 lowercase hex")
        check_error_text(self.source, "source")
        if not 1 <= len(self.source) <= 255:
            raise ValueError("source must have 1 to 255 characters")
        check_version(self.exported_by, "exported_by")
        check_text(self.imported_by, "imported_by", _HOST_RE, MAX_HOST_LEN, "gpu-node-01")
        for name in ("exported_at", "imported_at"):
            object.__setattr__(self, name, check_datetime(getattr(self, name), name))
        if not isinstance(self.trusted, bool):
            raise ValueError(f"trusted must be a bool, got {self.trusted!r}")

    def describe(self) -> str:
        trust = "trusted" if self.trusted else "not marked trusted"
        return (f"imported {self.imported_at:%Y-%m-%d %H:%M} UTC on {self.imported_by} from "
                f"{self.source} (bundle {self.bundle_sha256[:12]}, exported by flashtune "
                f"{self.exported_by} at {self.exported_at:%Y-%m-%d %H:%M} UTC; {trust})")


#: A function giving the template digest the installed flashtune renders for a (problem
#: key, config key), or None for keys it cannot render. The database cannot render kernels
#: (it sits below the kernel families), so the layers above hand it one (see
#: ``flashtune.runtime.installed.installed_digest``).
DigestOf = Callable[[str, str], "str | None"]
State = Literal["current", "reverified", "stale", "failed"]


@dataclass(frozen=True)
class BestEntry:
    """The best trial of one (device, problem, seqlen bucket, shape class), with the
    device's arch.

    ``provenance`` is None for results tuned into this database, else the import they came
    from. ``verified`` / ``refuted``: the template digests on which ``flashtune db verify``
    last found this entry's config right / wrong. Whether the entry may be served depends on
    the installed kernel sources: see ``state``.
    """

    trial: TrialRecord
    arch: str
    provenance: Provenance | None = None
    verified: frozenset[str] = frozenset()
    refuted: frozenset[str] = frozenset()

    def state(self, installed_digest: str | None) -> State:
        """``current``: measured on the installed kernel sources (``installed_digest``);
        ``reverified``: measured on other sources, re-verified on the installed ones;
        ``failed``: re-verification on the installed sources found it wrong; ``stale``:
        measured on other sources (or keys the installed flashtune cannot render), not
        re-verified. Only current and reverified entries are ever served."""
        if installed_digest is None:
            return "stale"
        if installed_digest in self.refuted:
            return "failed"
        if self.trial.template_digest == installed_digest:
            return "current"
        return "reverified" if installed_digest in self.verified else "stale"

    def servable(self, installed_digest: str | None) -> bool:
        return self.state(installed_digest) in ("current", "reverified")

    @property
    def origin(self) -> str:
        """Which source this result came from, for people (``explain``, ``db show``)."""
        t = self.trial
        if self.provenance is None:
            return (f"tuned into this database on host {t.host} at "
                    f"{t.created_at:%Y-%m-%d %H:%M} UTC by flashtune {t.flashtune_version}")
        return f"{self.provenance.describe()}; claimed host {t.host}"

    @property
    def device(self) -> str:
        return self.trial.device

    @property
    def problem(self) -> str:
        return self.trial.problem.key

    @property
    def seqlen(self) -> int:
        return self.trial.seqlen

    @property
    def shape_class(self) -> str:
        return self.trial.shape_class

    @property
    def config(self) -> Keyed:
        return self.trial.config

    @property
    def median_ms(self) -> float:
        assert self.trial.median_ms is not None  # guaranteed: only ok trials become best
        return self.trial.median_ms
