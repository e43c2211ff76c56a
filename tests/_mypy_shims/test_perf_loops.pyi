# mypy shim: tests import test_perf_loops as top-level (pytest puts tests/perf/ on sys.path).
from perf.test_perf_loops import *  # noqa: F403
