# mypy shim: tests import fixed_predictions as top-level (pytest puts tests/perf/ on sys.path).
from perf.fixed_predictions import *  # noqa: F403
