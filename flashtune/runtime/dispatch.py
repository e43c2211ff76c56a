"""Problem -> KernelConfig for one device: the serving side of the tuning database.

Lookup order for a (device, problem, sequence bucket):

1. ``exact``   -- the best tuned config of this problem and bucket on this device;
2. ``nearest`` -- this device's best config of the problem at the nearest tuned bucket;
3. ``same_arch`` -- the same, from another GPU of the same arch (e.g. any sm_90);
4. ``default`` -- the family's built-in default table (``families.<op>``).

The family is the problem's own, unless a registered family with an arch-specific target
this device runs ``serves`` its op (``families.served_problem``): on compute capability 9.0 devices
an sm_90a family answers the calls of the op it serves, with its own problem key (tuned
results and defaults are that family's), except that when nothing is tuned for it a config of
the op's own family tuned on this device (tiers 1-2) is served rather than the sm_90a
family's untuned default; every other device gets the op's own family.

The database is read lazily, once per device and process (per Dispatcher), and never
written or created: only what may serve the device is read (its own best entries, and those
of other GPUs of its arch from trusted sources: ``TuningStore.serving_best``), so results of
any number of other or untrusted devices cost nothing at start-up. If it cannot be read a
warning is logged once and every decision falls back to the defaults, so attention never
fails because of the database (a default database that does not exist yet, the normal state
before any tuning, is only logged at info level). Decisions are memoised per (device,
bucket). A tuned config that is malformed, cannot run on its arch or was measured on other
kernel sources is skipped, with one warning per distinct reason (and at most
``MAX_SKIP_WARNINGS`` of them per load, then one line for the rest).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from flashtune import families, settings
from flashtune.codegen.arch import get_arch
from flashtune.codegen.spec import KernelConfig, Problem, ProblemBucket
from flashtune.db.lookup import BestIndex
from flashtune.db.records import BestEntry
from flashtune.db.trust import trusted
from flashtune.errors import FlashtuneError
from flashtune.runtime.installed import unservable_reason

log = logging.getLogger("flashtune.dispatch")

#: Distinct reasons to skip tuned results warned about per load; the rest in one line.
MAX_SKIP_WARNINGS = 5


class DeviceLike(Protocol):
    """What the dispatcher needs to know about a device (``runtime.device.DeviceInfo``)."""

    @property
    def name(self) -> str: ...

    @property
    def arch(self) -> str: ...


@dataclass(frozen=True)
class NamedDevice:
    """A GPU known by name and arch only (another machine's, or this one's as seen without
    its arch-specific families): ``arch_specific_kernels`` None follows the setting
    FLASHTUNE_ARCH_SPECIFIC, as for a GPU."""

    name: str
    arch: str
    arch_specific_kernels: bool | None = None


class TunedSource(Protocol):
    """Where tuned results come from: every best entry at once (``db.TuningStore`` fits).

    A source that also has ``serving_best(device, arch)`` (the store) is asked only for what
    may serve that device; of any other, the dispatcher keeps only that from ``all_best``.
    """

    def all_best(self) -> Iterable[BestEntry]: ...


class Tier(str, Enum):
    EXACT = "exact"
    NEAREST = "nearest"
    SAME_ARCH = "same_arch"
    DEFAULT = "default"

    @property
    def meaning(self) -> str:
        return {
            Tier.EXACT: "tuned on this device for this bucket",
            Tier.NEAREST: "tuned on this device for the nearest bucket",
            Tier.SAME_ARCH: "tuned on another GPU of the same arch",
            Tier.DEFAULT: "built-in default (no tuned result applies)",
        }[self]


@dataclass(frozen=True)
class Decision:
    """Which config serves ``bucket`` on ``device``, which tier answered and from what."""

    bucket: ProblemBucket
    device: str
    arch: str
    config: KernelConfig
    tier: Tier
    entry: BestEntry | None

    def __str__(self) -> str:
        return self.describe()

    @property
    def problem(self) -> Problem:
        return self.bucket.problem

    def describe(self) -> str:
        """A few lines a person can read: what was asked, what answered, with what config."""
        c = self.config
        lines = [
            f"problem:  {self.bucket.key()} (sequence bucket {self.bucket.seqlen})",
            f"device:   {self.device} ({self.arch})",
            f"tier:     {self.tier.value} -- {self.tier.meaning}",
            f"config:   {c.key()} (block_m={c.block_m}, block_n={c.block_n}, "
            f"num_warps={c.num_warps}, num_stages={c.num_stages})",
        ]
        if self.entry is not None:
            e = self.entry
            speed = f", {e.trial.tflops:.1f} TFLOP/s" if e.trial.tflops is not None else ""
            shape = f" {e.shape_class}" if e.shape_class else ""
            lines.append(f"source:   {e.device} ({e.arch}), bucket n{e.seqlen}{shape}, median "
                         f"{e.median_ms:.4g} ms{speed}, template {e.trial.template_digest[:12]}")
        return "\n".join(lines)


def default_config(problem: Problem, arch: str) -> KernelConfig:
    """The built-in default config of ``problem`` on ``arch`` (its family's table)."""
    return families.of(problem).default_config(problem, get_arch(arch))


def usable_config(entry: BestEntry) -> KernelConfig | str:
    """The config of a tuned entry, or why it cannot serve (malformed, illegal on its arch,
    measured on other kernel sources than the installed ones)."""
    try:
        problem = Problem.from_key(entry.problem)
        config = KernelConfig.from_key(entry.config.key)
        spec = get_arch(entry.arch)
        ProblemBucket(problem, entry.seqlen, entry.shape_class)
    except FlashtuneError as exc:
        return str(exc)
    reason = families.of(problem).static_check(problem, config, spec)
    if reason is not None:
        return f"config {config.key()} cannot run on {spec.name}: {reason}"
    stale = unservable_reason(entry)  # imported data is data: see runtime/installed.py
    return config if stale is None else stale


def _entry_key(entry: BestEntry) -> tuple[str, str, int, str]:
    return (entry.device, entry.problem, entry.seqlen, entry.shape_class)


class _Tuned:
    """The usable tuned entries of one device, indexed for lookups without the database."""

    def __init__(self, entries: Iterable[BestEntry]) -> None:
        self.configs: dict[tuple[str, str, int, str], KernelConfig] = {}
        usable: list[BestEntry] = []
        skipped: dict[str, list[BestEntry]] = {}  # reason -> its entries, in order
        for entry in entries:
            found = usable_config(entry)
            if isinstance(found, str):
                skipped.setdefault(found, []).append(entry)
                continue
            self.configs[_entry_key(entry)] = found
            usable.append(entry)
        self.entries = tuple(usable)
        self.index = BestIndex(self.entries)
        _warn_skipped(skipped)


def _warn_skipped(skipped: dict[str, list[BestEntry]]) -> None:
    """One warning per distinct reason (at most MAX_SKIP_WARNINGS), not one per entry."""
    for reason, entries in list(skipped.items())[:MAX_SKIP_WARNINGS]:
        first = entries[0]
        more = f" (and {len(entries) - 1} more with the same reason)" if len(entries) > 1 else ""
        log.warning("skipping the tuned result %s/%s_n%d%s: %s", first.device, first.problem,
                    first.seqlen, more, reason)
    rest = list(skipped.values())[MAX_SKIP_WARNINGS:]
    if rest:
        log.warning("skipping %d more tuned results for %d other reasons (FLASHTUNE_LOG_LEVEL="
                    "debug lists them)", sum(len(e) for e in rest), len(rest))
        for entries in rest:
            for entry in entries:
                log.debug("skipping the tuned result %s/%s_n%d", entry.device, entry.problem,
                          entry.seqlen)


class Dispatcher:
    """Chooses configs from a tuned source (read once, lazily) and the default table."""

    def __init__(self, source: Callable[[], TunedSource] | None = None) -> None:
        self._open_source = source if source is not None else open_database
        self._tuned: dict[tuple[str, str], _Tuned] = {}
        self._memo: dict[tuple[str, str, bool, ProblemBucket], Decision] = {}
        self._lock = threading.Lock()

    def _load(self, device: str, arch: str) -> _Tuned:
        """What may serve ``device`` (read on its first decision, then kept)."""
        with self._lock:
            tuned = self._tuned.get((device, arch))
            if tuned is None:
                tuned = _Tuned(_read_entries(self._open_source, device, arch))
                self._tuned[(device, arch)] = tuned
            return tuned

    def decide(self, bucket: ProblemBucket, device: DeviceLike) -> Decision:
        """The config for ``bucket`` on ``device`` (memoised; never tunes or writes)."""
        memo_key = (device.name, device.arch, _arch_specific_kernels(device), bucket)
        decision = self._memo.get(memo_key)
        if decision is None:
            decision = self._decide(bucket, device)
            self._memo[memo_key] = decision
            log.debug("dispatch %s on %s (%s): %s -> %s", bucket.key(), device.name,
                      device.arch, decision.tier.value, decision.config.key())
        return decision

    def _decide(self, bucket: ProblemBucket, device: DeviceLike) -> Decision:
        arch = get_arch(device.arch).name
        tuned = self._load(device.name, arch)
        served = served_problem(bucket.problem, device)
        if served != bucket.problem:  # an arch-specific family (sm_90a) serves this device
            decision = self._lookup(tuned, dataclasses.replace(bucket, problem=served), device,
                                    arch)
            if decision is not None:
                return decision
            # Nothing tuned for it: a config of the op's own family tuned on this very device
            # (measured and verified there) beats the arch-specific family's untuned default.
            own = self._lookup(tuned, bucket, device, arch)
            if own is not None and own.tier in (Tier.EXACT, Tier.NEAREST):
                return own
            bucket = dataclasses.replace(bucket, problem=served)
        decision = self._lookup(tuned, bucket, device, arch)
        if decision is not None:
            return decision
        return Decision(bucket, device.name, arch, default_config(bucket.problem, arch),
                        Tier.DEFAULT, None)

    @staticmethod
    def _lookup(tuned: _Tuned, bucket: ProblemBucket, device: DeviceLike, arch: str
               ) -> Decision | None:
        """The tuned config of ``bucket`` the lookup tiers find for ``device``, or None."""
        match = tuned.index.lookup(device=device.name, arch=arch,
                                   problem=bucket.problem.key(), seqlen=bucket.seqlen,
                                   shape_class=bucket.shape_class)
        if match is None:
            return None
        config = tuned.configs[_entry_key(match.entry)]
        reason = families.of(bucket.problem).static_check(bucket.problem, config,
                                                         get_arch(arch))
        if reason is None:
            return Decision(bucket, device.name, arch, config, Tier(match.how), match.entry)
        log.warning("the tuned config %s (%s, %s) cannot run on %s (%s): %s; using the "
                    "default", config.key(), match.entry.device, match.entry.arch,
                    device.name, arch, reason)
        return None


def served_problem(problem: Problem, device: DeviceLike) -> Problem:
    """The problem a call of ``problem`` runs on ``device``: that of the arch-specific family
    serving its op there (``families.served_problem``) when the device runs such families, else
    ``problem`` itself."""
    if not _arch_specific_kernels(device):
        return problem
    return families.served_problem(problem, get_arch(device.arch))


def _arch_specific_kernels(device: DeviceLike) -> bool:
    """Whether arch-specific families (sm_90a) may serve calls on ``device``: its
    ``arch_specific_kernels`` (``runtime.device.DeviceInfo``); for a device that does not
    say, the setting FLASHTUNE_ARCH_SPECIFIC, as for a GPU."""
    said = getattr(device, "arch_specific_kernels", None)
    return settings.ARCH_SPECIFIC.get() if said is None else bool(said)


def _read_entries(open_source: Callable[[], TunedSource], device: str, arch: str
                  ) -> list[BestEntry]:
    """The source's best entries that may serve ``device`` of ``arch`` (its own, and other
    devices' of the arch from trusted sources); [] (with one log line) if it cannot be read."""
    try:
        source = open_source()
        try:
            serving = getattr(source, "serving_best", None)
            if callable(serving):
                return list(serving(device, arch))
            return [e for e in source.all_best()
                    if e.device == device or (e.arch == arch and trusted(e))]
        finally:
            close = getattr(source, "close", None)
            if callable(close):
                close()
    except _NoDatabase as missing:
        log.info("%s; every kernel uses the built-in default configs", missing)
    except Exception as exc:  # any failure of the database must not fail attention
        log.warning("the tuning database could not be read (%s: %s); every kernel uses the "
                    "built-in default configs. Repair or migrate it (`flashtune db --help`) or "
                    "point FLASHTUNE_DB at another database", type(exc).__name__, exc)
    return []


class _NoDatabase(Exception):
    """The default database file does not exist yet: nothing has been tuned here."""


def open_database() -> TunedSource:
    """The tuning database at FLASHTUNE_DB, opened without creating or migrating it."""
    from flashtune import settings
    from flashtune.db.engine import resolve_url, sqlite_file
    from flashtune.db.store import TuningStore

    url = resolve_url()
    path = sqlite_file(url)
    if path is not None and not path.is_file() and not settings.DB_URL.is_set():
        raise _NoDatabase(f"no tuning database at {path} (nothing tuned on this machine yet)")
    return TuningStore(url, create=False)


_dispatcher: Dispatcher | None = None
_dispatcher_lock = threading.Lock()


def get_dispatcher() -> Dispatcher:
    """The process-wide dispatcher (its database is read on the first decision)."""
    global _dispatcher
    if _dispatcher is None:
        with _dispatcher_lock:
            if _dispatcher is None:
                _dispatcher = Dispatcher()
    return _dispatcher


def set_dispatcher(dispatcher: Dispatcher | None) -> None:
    """Replace the process-wide dispatcher (None: a fresh one, reading the database again, on
    next use). Used by tests and by applications that bring their own source; callers that
    keep plans (ops) must drop them too (``flashtune.runtime.plans.clear_caches``)."""
    global _dispatcher
    with _dispatcher_lock:
        _dispatcher = dispatcher
