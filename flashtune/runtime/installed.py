"""The installed kernel sources, as the database needs them to decide what may be served.

The database keeps, with every tuned result, the digest of the kernel source it was
measured on; only the kernel families (above the database) can render the source the
installed flashtune would run. ``installed_digest`` is that digest, handed to the database
and used by the dispatcher: a result measured on other sources is stale and never served
until it is re-measured or re-verified (``flashtune db verify``).
"""

from __future__ import annotations

import functools

from flashtune.codegen.spec import KernelConfig, Problem
from flashtune.db.records import BestEntry, State
from flashtune.errors import FlashtuneError


@functools.lru_cache(maxsize=4096)
def installed_digest(problem_key: str, config_key: str) -> str | None:
    """The template digest the installed flashtune renders for (problem, config), or None
    when the keys are not legal here (such a result can never be served)."""
    from flashtune import families  # imports torch: only when a digest is needed

    try:
        problem, config = Problem.from_key(problem_key), KernelConfig.from_key(config_key)
        return families.render(problem, config).digest
    except FlashtuneError:
        return None


def serving_state(entry: BestEntry) -> State:
    """``entry.state`` on the installed kernel sources (current, reverified, stale, failed)."""
    return entry.state(installed_digest(entry.problem, entry.config.key))


def unservable_reason(entry: BestEntry) -> str | None:
    """Why ``entry`` must not be served on the installed kernel sources, or None."""
    state = serving_state(entry)
    if state == "stale":
        return ("it was measured on other kernel sources (template digest "
                f"{entry.trial.template_digest[:12]}) than this flashtune renders; re-tune, or "
                "re-verify it with `flashtune db verify`")
    if state == "failed":
        return "`flashtune db verify` found it wrong on the installed kernel sources"
    return None
