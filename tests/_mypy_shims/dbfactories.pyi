# mypy shim: tests import dbfactories as top-level (pytest puts tests/db/ on sys.path).
from db.dbfactories import *  # noqa: F403
