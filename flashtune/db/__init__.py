"""The tuning database: devices, trials and the best config per (device, problem bucket).

SQLAlchemy models and migrations, the ``TuningStore`` used by the tuner and the runtime
dispatcher, bundle export/import/merge for sharing results, and Optuna's storage on the same
URL. This package imports nothing of flashtune but ``errors`` and ``knobs``; the rules of
legal problems and configs come in through a ``RecordValidator``.
"""

from __future__ import annotations

from flashtune.db.bundle import Bundle, dumps, parse_bundle, read_bundle, write_bundle
from flashtune.db.engine import resolve_url, session_scope
from flashtune.db.lookup import BestIndex, Match, resolve
from flashtune.db.optuna_storage import optuna_storage
from flashtune.db.records import (
    BestEntry,
    DeviceRecord,
    Keyed,
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
from flashtune.db.validation import RecordValidator

__all__ = [
    "BestEntry", "BestIndex", "Bundle", "DeviceRecord", "Keyed", "Match", "RecordValidator",
    "SchemaState", "ShareReport", "TrialRecord", "TrialStatus", "TuningStore", "dumps",
    "ensure_schema", "export_bundle", "import_bundle", "merge_databases", "optuna_storage",
    "parse_bundle", "read_bundle", "resolve", "resolve_url", "schema_state", "session_scope",
    "truncate_error", "write_bundle",
]
