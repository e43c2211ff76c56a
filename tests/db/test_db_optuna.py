"""Optuna's study storage and flashtune's tables in one database."""

from __future__ import annotations

import random

import optuna
import pytest
import sqlalchemy as sa
from dbfactories import CONFIGS, H100, PROBLEMS, trial

from flashtune.db import TuningStore, open_optuna_storage, resolve_url
from flashtune.errors import DatabaseError


def test_optuna_and_flashtune_share_one_database(db_url: str, rng: random.Random) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = open_optuna_storage(db_url)
    study = optuna.create_study(study_name="fwd_d128_bf16_causal_n4096", storage=storage)
    seen: list[float] = []

    def objective(t: optuna.trial.Trial) -> float:
        value = float((t.suggest_int("block_m", 1, 8) - 5) ** 2) + rng.random()
        seen.append(value)
        return value

    study.optimize(objective, n_trials=6)
    with TuningStore(db_url) as store:
        store.record_device(H100)
        ours = trial(H100, PROBLEMS[0], 4096, CONFIGS[0], rng=rng, study=study.study_name)
        store.record_trial(ours)

    # Both survive reopening, each through its own tables and version table.
    again = optuna.load_study(study_name=study.study_name, storage=open_optuna_storage(db_url))
    assert len(again.trials) == 6
    assert again.best_value == min(seen)
    with TuningStore(db_url) as store:
        assert store.trials() == [ours]
    engine = sa.create_engine(resolve_url(db_url))
    tables = set(sa.inspect(engine).get_table_names())
    engine.dispose()
    assert {"studies", "trials", "alembic_version", "version_info"} <= tables
    assert {"ft_trials", "ft_best", "ft_alembic_version"} <= tables
    ours_tables = {t for t in tables if t.startswith("ft_")}
    assert ours_tables.isdisjoint({"studies", "trials", "alembic_version"})


def test_open_optuna_storage_sets_the_pragmas_and_busy_timeout(db_url: str,
                                                              backend: str) -> None:
    storage = open_optuna_storage(db_url, busy_timeout_s=7.5)
    optuna.create_study(study_name="pragmas", storage=storage)
    if backend != "sqlite":
        return
    with storage.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 7500
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL


def test_open_optuna_storage_default_timeout_is_the_knob(
        db_url: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHTUNE_DB_BUSY_TIMEOUT_S", "12")
    storage = open_optuna_storage(db_url)
    if backend == "sqlite":
        with storage.engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 12000
    with pytest.raises(DatabaseError, match="busy_timeout_s"):
        open_optuna_storage(db_url, busy_timeout_s=0)
