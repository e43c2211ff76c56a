# mypy shim: tests import hardening_helpers as top-level (pytest puts tests/hardening/ on sys.path).
from hardening.hardening_helpers import *  # noqa: F403
