"""Optuna's study storage on the tuning database's URL: the one place that opens it.

One SQLite file or PostgreSQL database then carries both Optuna's tables (``studies``,
``trials``, ``alembic_version``, ...) and flashtune's (all prefixed ``ft_``, with their own
version table ``ft_alembic_version``), so a study can be watched with
``optuna-dashboard <url>`` and several machines can tune one study on a shared server.

SQLite connections get the pragmas of flashtune's own writers (``engine.sqlite_pragmas``):
a busy timeout (setting FLASHTUNE_DB_BUSY_TIMEOUT_S unless given), WAL and
``synchronous = NORMAL``; PostgreSQL connections are checked before use.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy
from sqlalchemy.engine import URL

from flashtune.db.engine import busy_timeout_s as default_busy_timeout_s
from flashtune.db.engine import describe, resolve_url, sqlite_file, sqlite_pragmas
from flashtune.db.store import TuningStore
from flashtune.errors import DatabaseError

if TYPE_CHECKING:
    from optuna.storages import RDBStorage

#: Processes starting together race to create Optuna's tables; the losers retry.
_ATTEMPTS = 3


def open_optuna_storage(url: str | Path | URL | None = None, *,
                        busy_timeout_s: float | None = None, ensure_schema: bool = True,
                        **kwargs: Any) -> RDBStorage:
    """An ``optuna.storages.RDBStorage`` on ``url`` (default: the setting FLASHTUNE_DB).

    ``busy_timeout_s``: how long a SQLite writer waits for another (default: the setting
    FLASHTUNE_DB_BUSY_TIMEOUT_S, 60 s). With ``ensure_schema`` the flashtune schema is
    created or checked first (a SchemaVersionError says what to do with an old database);
    without it only the directory of a SQLite file is made. Extra keyword arguments go to
    RDBStorage (e.g. ``heartbeat_interval``, ``grace_period``); its ``engine_kwargs`` are
    merged over the defaults above. Raises DatabaseError when the storage cannot be opened.
    """
    import optuna  # slow to import; only the tuner needs it

    resolved = resolve_url(url)
    timeout = default_busy_timeout_s() if busy_timeout_s is None else float(busy_timeout_s)
    if not 0 < timeout <= 3600:
        raise DatabaseError(f"busy_timeout_s={busy_timeout_s!r} must be in (0, 3600] seconds")
    sqlite = resolved.get_backend_name() == "sqlite"
    if ensure_schema:
        TuningStore(resolved).close()
    elif (path := sqlite_file(resolved)) is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DatabaseError(f"cannot create the directory of the database {path}: "
                                f"{exc}") from None
    engine_kwargs: dict[str, Any] = (
        {"connect_args": {"timeout": timeout}} if sqlite else {"pool_pre_ping": True})
    engine_kwargs.update(kwargs.pop("engine_kwargs", {}))
    text = resolved.render_as_string(hide_password=False)
    for attempt in range(_ATTEMPTS):
        try:
            storage = optuna.storages.RDBStorage(text, engine_kwargs=engine_kwargs, **kwargs)
            break
        except Exception as exc:  # optuna wraps driver errors in several types
            if attempt + 1 < _ATTEMPTS:
                time.sleep(0.5 * (attempt + 1))
                continue
            raise DatabaseError(f"cannot open the Optuna study storage at "
                                f"{describe(resolved)}: {exc}") from exc
    if sqlite:
        # Connections opened from now on get the pragmas; the ones Optuna opened while
        # creating its tables are dropped so that none runs without them.
        sqlalchemy.event.listen(storage.engine, "connect",
                                functools.partial(sqlite_pragmas, timeout=timeout))
        storage.engine.dispose()
    return storage
