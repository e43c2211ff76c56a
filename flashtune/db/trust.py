"""Which tuned results may serve which device: trusted sources.

Imported tuning data is data, not authority:

- Results of OTHER devices serve this one (the ``same_arch`` tier) only from trusted
  sources: by default, results tuned into this database (``local``); imports marked trusted
  (``flashtune db import --trust``); or what the setting FLASHTUNE_TRUSTED_SOURCES names
  (``all``, bundle digest prefixes, ``host:NAME`` of the claimed origin).
- A device's own results serve it whatever their source: importing them was the user's
  choice, and physics checks bound what a timing can claim.
- Whatever the source, a result is served only on the kernel sources it was measured or
  re-verified on (``BestEntry.state``, given the installed digest by the layers above).
"""

from __future__ import annotations

import sqlalchemy as sa

from flashtune import settings
from flashtune.db.models import ImportRow, TrialRow
from flashtune.db.records import BestEntry


def trusted(entry: BestEntry, sources: frozenset[str] | None = None) -> bool:
    """Whether ``entry`` may serve other devices (``sources``: default the setting)."""
    tokens = settings.TRUSTED_SOURCES.get() if sources is None else sources
    if settings.TRUST_ALL in tokens:
        return True
    if f"host:{entry.trial.host}" in tokens:
        return True
    provenance = entry.provenance
    if provenance is None:
        return settings.TRUST_LOCAL in tokens
    if provenance.trusted:
        return True
    return any(len(t) >= 8 and provenance.bundle_sha256.startswith(t) for t in tokens)


def trusted_condition(sources: frozenset[str] | None = None) -> sa.ColumnElement[bool]:
    """``trusted`` as a condition on a query of trials outer-joined to their import, so
    that results of other devices no source vouches for are never read (the dispatcher's
    start-up: a bundle of thousands of invented devices costs nothing). Equivalent to
    ``trusted`` on every row; ``trusted`` is still applied to what comes back."""
    tokens = settings.TRUSTED_SOURCES.get() if sources is None else sources
    if settings.TRUST_ALL in tokens:
        return sa.true()
    hosts = sorted(t[len("host:"):] for t in tokens if t.startswith("host:"))
    either: list[sa.ColumnElement[bool]] = [ImportRow.trusted.is_(True)]
    if hosts:
        either.append(TrialRow.host.in_(hosts))
    if settings.TRUST_LOCAL in tokens:
        either.append(TrialRow.import_id.is_(None))
    either += [ImportRow.bundle_sha256.startswith(t, autoescape=True) for t in sorted(tokens)
               if len(t) >= 8 and not t.startswith("host:")]
    return sa.or_(*either)
