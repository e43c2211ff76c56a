"""The tuning database: devices, trials and the best config per (device, problem bucket).

SQLAlchemy models and migrations, the ``TuningStore`` used by the tuner and the runtime
dispatcher, bundle export/import/merge for sharing results, and Optuna's storage on the same
URL. This package imports nothing of flashtune above codegen: it holds records to codegen's
own value types (``Problem``, ``KernelConfig``, ``ProblemBucket``, ``get_arch``), besides
``errors`` and ``knobs``.
"""

from __future__ import annotations

from flashtune.db.bundle import Bundle, dumps, parse_bundle, read_bundle, write_bundle
from flashtune.db.engine import resolve_url, session_scope
from flashtune.db.lookup import BestIndex, Match, resolve
from flashtune.db.optuna_storage import open_optuna_storage, optuna_storage
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

__all__ = [
    "BestEntry", "BestIndex", "Bundle", "DeviceRecord", "Keyed", "Match", "Provenance",
    "SchemaState", "ShareReport", "TrialRecord", "TrialStatus", "TuningStore", "dumps",
    "ensure_schema", "export_bundle", "import_bundle", "merge_databases",
    "open_optuna_storage", "optuna_storage",
    "parse_bundle", "read_bundle", "resolve", "resolve_url", "schema_state", "session_scope",
    "truncate_error", "write_bundle",
]
