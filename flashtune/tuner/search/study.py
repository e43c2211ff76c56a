"""Optuna studies of the tuner: names, storage, samplers and the template digest.

One study per (device, problem bucket, template digest), stored in Optuna's RDB storage on
the same database URL as the tuning results, so ``--resume`` and several workers (on one
machine or many, against PostgreSQL) share it. Trials send heartbeats; a trial whose
worker died (no heartbeat for ``grace_period`` seconds, or a dead process on this host) is
failed so that its config can be proposed again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import optuna
from sqlalchemy.engine import URL

from flashtune._version import __version__
from flashtune.codegen import render
from flashtune.codegen.spec import ProblemBucket
from flashtune.db.records import check_study
from flashtune.db.study_storage import open_optuna_storage
from flashtune.errors import TuningError
from flashtune.families import fixed as fixing
from flashtune.families.fixed import Fixed
from flashtune.tuner.measure.base import COST_ATTR as COST_ATTR

# What the tuner records on a trial (user attributes), read by the search, its samplers,
# the final pick and the report.
OWNER_ATTR = "flashtune_owner"
CONFIG_ATTR = "config"
STATUS_ATTR = "status"
DUPLICATE_ATTR = "duplicate_of"
MODEL_PRUNED_ATTR = "model_pruned"

@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Silence Optuna's notices about heartbeats: they are meant for Study.optimize, and an
    experimental feature there; the tuner drives ask/tell and sends its own heartbeats."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed",
                                category=UserWarning)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        yield
_UNSAFE = re.compile(r"[^A-Za-z0-9._:=+-]+")


@functools.lru_cache(maxsize=1)
def templates_digest() -> str:
    """Digest over every template and header file, the compile options and the version.

    Any byte changed in ``flashtune/templates`` gives a new digest, hence new studies: a
    study never mixes measurements of different kernel code.
    """
    h = hashlib.sha256(f"flashtune {__version__}\0".encode())
    for option in render.COMPILE_OPTIONS:
        h.update(option.encode() + b"\0")
    root = render.templates_dir()
    for path in sorted(root.iterdir()):
        if path.is_file() and path.suffix in (".jinja", ".cuh", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def study_name(device: str, bucket: ProblemBucket, digest: str, prefix: str | None = None,
               fixed: Fixed = ()) -> str:
    """``flashtune/<device>/<bucket>/<digest12>``, or ``<prefix>/<bucket>`` with --study;
    a search with ``fixed`` knobs (--fix) adds ``/fixed:<name>=<value>+...``, so that it
    never resumes (or is resumed by) the search of the whole space."""
    if prefix:
        name = f"{prefix}/{bucket.key()}"
    else:
        slug = _UNSAFE.sub("-", device).strip("-") or "device"
        name = f"flashtune/{slug}/{bucket.key()}/{digest[:12]}"
    if fixed:
        name += f"/fixed:{fixing.text(fixed)}"
    try:
        return check_study(name, "study name")
    except ValueError as exc:
        raise TuningError(f"{exc}; choose a --study name of letters, digits and ._:=+-") from None


@dataclass(frozen=True)
class Heartbeat:
    """Seconds between a worker's heartbeats, and after which a silent trial is stale."""

    interval: int = 10
    grace_period: int = 60

    def __post_init__(self) -> None:
        if self.interval < 1 or self.grace_period <= self.interval:
            raise TuningError(f"heartbeat interval {self.interval} s must be >= 1 and below the "
                              f"grace period {self.grace_period} s")


def open_storage(url: str | URL | None, heartbeat: Heartbeat = Heartbeat()
                 ) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage on the tuning database, with the tuner's heartbeats (the one
    opener of ``flashtune.db.study_storage``: pragmas, busy timeout, racing creators)."""
    with quiet_optuna():
        return open_optuna_storage(url, heartbeat_interval=heartbeat.interval,
                                   grace_period=heartbeat.grace_period)


class TrialScan:
    """Reads a study's trials incrementally: each finished trial once, the unfinished ones
    (running, waiting) on every update, so a long study costs O(new trials) per look."""

    def __init__(self) -> None:
        self._next = 0
        self._open: list[int] = []

    def update(self, study: optuna.Study) -> tuple[list[optuna.trial.FrozenTrial],
                                                   list[optuna.trial.FrozenTrial]]:
        """(trials finished since the last update, trials unfinished now), by number."""
        trials = study.get_trials(deepcopy=False)
        if trials and trials[-1].number != len(trials) - 1:  # storages list them by number
            trials = sorted(trials, key=lambda t: t.number)
        by_number = trials
        look = [by_number[i] for i in self._open] + list(by_number[self._next:])
        finished = [t for t in look if t.state.is_finished()]
        unfinished = [t for t in look if not t.state.is_finished()]
        finished.sort(key=lambda t: t.number)
        self._open = [t.number for t in unfinished]
        self._next = len(by_number)
        return finished, unfinished
