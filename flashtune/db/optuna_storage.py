"""Optuna's study storage on the tuning database's URL.

One SQLite file or PostgreSQL database then carries both Optuna's tables (``studies``,
``trials``, ``alembic_version``, ...) and flashtune's (all prefixed ``ft_``, with their own
version table ``ft_alembic_version``), so a study can be watched with
``optuna-dashboard <url>`` and several machines can tune one study on a shared server.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import URL

from flashtune.db.engine import BUSY_TIMEOUT_MS, resolve_url
from flashtune.db.store import TuningStore

if TYPE_CHECKING:
    from optuna.storages import RDBStorage


def optuna_storage(url: str | Path | URL | None = None, **kwargs: Any) -> RDBStorage:
    """An ``optuna.storages.RDBStorage`` on ``url`` (default: the knob FLASHTUNE_DB).

    The flashtune schema is created or checked first, which also puts a SQLite file in WAL
    mode; SQLite connections get the same busy timeout as flashtune's own. Extra keyword
    arguments go to RDBStorage (e.g. ``heartbeat_interval``).
    """
    import optuna  # slow to import; only the tuner needs it

    resolved = resolve_url(url)
    TuningStore(resolved).close()
    engine_kwargs: dict[str, Any] = dict(kwargs.pop("engine_kwargs", {}))
    if resolved.get_backend_name() == "sqlite":
        engine_kwargs.setdefault("connect_args", {"timeout": BUSY_TIMEOUT_MS / 1000})
    else:
        engine_kwargs.setdefault("pool_pre_ping", True)
    return optuna.storages.RDBStorage(resolved.render_as_string(hide_password=False),
                                      engine_kwargs=engine_kwargs, **kwargs)
