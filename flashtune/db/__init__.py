"""The tuning database: devices, trials and the best config per (device, problem bucket).

SQLAlchemy models and migrations, the ``TuningStore`` used by the tuner and the runtime
dispatcher, bundle export/import/merge for sharing results, and Optuna's storage on the same
URL. This package imports nothing of flashtune above codegen: it holds records to codegen's
own value types (``Problem``, ``KernelConfig``, ``ProblemBucket``, ``get_arch``), besides
``errors`` and ``settings``.

The names below are imported on first use, so that the light modules (``records``: the
value types and ``TrialStatus``) can be imported without SQLAlchemy and Optuna, e.g. by the
command line when it builds its options.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashtune._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "Bundle": "flashtune.db.bundle",
    "dumps": "flashtune.db.bundle",
    "parse_bundle": "flashtune.db.bundle",
    "read_bundle": "flashtune.db.bundle",
    "write_bundle": "flashtune.db.bundle",
    "resolve_url": "flashtune.db.engine",
    "session_scope": "flashtune.db.engine",
    "BestIndex": "flashtune.db.lookup",
    "Match": "flashtune.db.lookup",
    "resolve": "flashtune.db.lookup",
    "BestEntry": "flashtune.db.records",
    "DeviceRecord": "flashtune.db.records",
    "Keyed": "flashtune.db.records",
    "Provenance": "flashtune.db.records",
    "TrialRecord": "flashtune.db.records",
    "TrialStatus": "flashtune.db.records",
    "truncate_error": "flashtune.db.records",
    "SchemaState": "flashtune.db.schema",
    "ensure_schema": "flashtune.db.schema",
    "schema_state": "flashtune.db.schema",
    "ShareReport": "flashtune.db.sharing",
    "export_bundle": "flashtune.db.sharing",
    "import_bundle": "flashtune.db.sharing",
    "merge_databases": "flashtune.db.sharing",
    "TuningStore": "flashtune.db.store",
    "open_optuna_storage": "flashtune.db.study_storage",
}

__all__ = [
    "BestEntry", "BestIndex", "Bundle", "DeviceRecord", "Keyed", "Match", "Provenance",
    "SchemaState", "ShareReport", "TrialRecord", "TrialStatus", "TuningStore", "dumps",
    "ensure_schema", "export_bundle", "import_bundle", "merge_databases",
    "open_optuna_storage",
    "parse_bundle", "read_bundle", "resolve", "resolve_url", "schema_state", "session_scope",
    "truncate_error", "write_bundle",
]

if TYPE_CHECKING:
    from flashtune.db.bundle import Bundle, dumps, parse_bundle, read_bundle, write_bundle
    from flashtune.db.engine import resolve_url, session_scope
    from flashtune.db.lookup import BestIndex, Match, resolve
    from flashtune.db.records import (
        BestEntry,
        DeviceRecord,
        Keyed,
        Provenance,
        TrialRecord,
        TrialStatus,
        truncate_error,
    )
    from flashtune.db.schema import SchemaState, ensure_schema, schema_state
    from flashtune.db.sharing import (
        ShareReport,
        export_bundle,
        import_bundle,
        merge_databases,
    )
    from flashtune.db.store import TuningStore
    from flashtune.db.study_storage import open_optuna_storage

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
