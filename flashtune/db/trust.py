"""What the database may serve: current kernel sources and trusted sources.

Imported tuning data is data, not authority:

- A result measured on other kernel sources (a template digest that the installed
  flashtune does not render for that problem and config) is stale: it is kept, shown and
  exported, but never served until it is re-measured (a new trial) or re-verified
  (``flashtune db verify`` records a passing check on the current sources).
- Results of OTHER devices serve this one (the ``family`` tier) only from trusted sources:
  by default, results tuned into this database (``local``); imports marked trusted
  (``flashtune db import --trust``); or what the knob FLASHTUNE_TRUSTED_SOURCES names
  (``all``, bundle digest prefixes, ``host:NAME`` of the claimed origin).
- A device's own results serve it whatever their source: importing them was the user's
  choice, and physics checks bound what a timing can claim.
"""

from __future__ import annotations

import functools

from flashtune import knobs
from flashtune.codegen.render import render
from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.db.records import BestEntry
from flashtune.errors import FlashtuneError


@functools.lru_cache(maxsize=4096)
def current_digest(problem_key: str, config_key: str) -> str | None:
    """The template digest the installed flashtune renders for (problem, config), or None
    when the keys are not legal (such a result can never be served)."""
    try:
        return render(Problem.from_key(problem_key), KernelConfig.from_key(config_key)).digest
    except FlashtuneError:
        return None


def is_current(problem_key: str, config_key: str, template_digest: str) -> bool:
    """True when ``template_digest`` is what the installed flashtune renders."""
    return current_digest(problem_key, config_key) == template_digest


def trusted(entry: BestEntry, sources: frozenset[str] | None = None) -> bool:
    """Whether ``entry`` may serve other devices (``sources``: default the knob)."""
    tokens = knobs.TRUSTED_SOURCES.get() if sources is None else sources
    if knobs.TRUST_ALL in tokens:
        return True
    if f"host:{entry.trial.host}" in tokens:
        return True
    provenance = entry.provenance
    if provenance is None:
        return knobs.TRUST_LOCAL in tokens
    if provenance.trusted:
        return True
    return any(len(t) >= 8 and provenance.bundle_sha256.startswith(t) for t in tokens)
