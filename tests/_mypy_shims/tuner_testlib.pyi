# mypy shim: tests import tuner_testlib as top-level (pytest puts tests/tuner/ on sys.path).
from tuner.tuner_testlib import *  # noqa: F403
