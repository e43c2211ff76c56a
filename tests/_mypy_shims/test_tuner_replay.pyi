# mypy shim: tests import test_tuner_replay as top-level (pytest puts tests/tuner/ on sys.path).
from tuner.test_tuner_replay import *  # noqa: F403
