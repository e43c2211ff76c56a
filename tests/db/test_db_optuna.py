"""Optuna's study storage and flashtune's tables in one database."""

from __future__ import annotations

import random

import optuna
import sqlalchemy as sa
from dbfactories import CONFIGS, H100, PROBLEMS, trial

from flashtune.db import TuningStore, optuna_storage, resolve_url


def test_optuna_and_flashtune_share_one_database(db_url: str, rng: random.Random) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna_storage(db_url)
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
    again = optuna.load_study(study_name=study.study_name, storage=optuna_storage(db_url))
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
